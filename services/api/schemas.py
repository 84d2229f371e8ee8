"""Request bodies at the HTTP edge (pydantic), and their translation into SamplingParams.

Each body builds what it submits (`submission`: its jobs, one per prompt, the format of its answer and what the
request record keeps), given what the server adds (`Stamp`), once its fields passed the server's limits
(`checked`).

Fields follow OpenAI's CreateChatCompletionRequest / CreateCompletionRequest, plus the extensions vLLM
and SGLang accept (top_k, min_p, ignore_eos, repetition_penalty, min_tokens, stop_token_ids,
skip_special_tokens, add_generation_prompt, continue_final_message), `timeout` (seconds, capped by the
server's --request-timeout-s) and `background`. Every field is honoured or refused with a 400 naming it:
an unknown field is refused as OpenAI refuses it ("Unrecognized request argument supplied"), and a known
field we cannot honour is refused when set to anything but its no-op value.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Any, Literal, Protocol

import msgspec
import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator, field_validator, model_validator

from services.api.formats import ChatFormat, CompletionFormat, Format, GenerateFormat, Head
from shared.messages import ChatMessage, Guided, SamplingParams, TokenizeJob, ToolChoice


class FieldLimits(Protocol):
    """What a request body's `checked` asks of the server's limits (services/api/limits.py's Limits): the
    schemas stay below the limits, which build on them."""

    def record_fields(self, user: str | None, safety_identifier: str | None = None,
                      metadata: dict[str, str] | None = None) -> None: ...

    def sampling(self, params: SamplingParams, prefix: str = "") -> None: ...

    def chat_fields(self, tools: list[dict] | None, chat_template_kwargs: dict | None) -> None: ...


MAX_N = 16
MAX_PROMPTS = 64  # prompts in one completion request
MAX_STOP = 16
FORBID = ConfigDict(extra="forbid")
# OpenAI's ReasoningEffort and json_schema `name` (a-z, A-Z, 0-9, underscores and dashes, at most 64): both are
# echoed (the Responses object shows them), so a value OpenAI's schema refuses is refused here too.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# Extensions other servers accept that rsinfer does not (yet): refused with what they are, not just "unknown".
UNSUPPORTED_EXTENSIONS = {
    **dict.fromkeys(("guided_decoding_backend", "structured_outputs", "guided_whitespace_pattern"),
                    "structured outputs take `response_format`, `regex`, `json`, `ebnf` or vLLM's `guided_*` "
                    "fields; the backend is llguidance"),
    "structural_tag": "structural tags are not supported; tools with tool_choice \"required\" are constrained",
    **dict.fromkeys(("chat_template", "documents", "mm_processor_kwargs"),
                    "custom chat templates are not supported (chat_template_kwargs are)"),
    "lora_request": "name a LoRA adapter as `model` (or in SGLang's `lora_path`); adapters are loaded with "
                    "POST /v1/load_lora_adapter or --lora-modules",
    **dict.fromkeys(("include_stop_str_in_output", "no_stop_trim"), "stop strings are always removed from the "
                    "output"),
    "spaces_between_special_tokens": "special tokens are decoded as the tokenizer joins them",
    "return_hidden_states": "hidden states are not returned",
    "prompt_logprobs": "prompt logprobs are not supported",
}


def generation_prompt(add_generation_prompt: bool | None, continue_final_message: bool) -> bool:
    """Whether the chat template opens the answer: as asked, else not when the last message is continued."""
    return not continue_final_message if add_generation_prompt is None else add_generation_prompt


def check_continuation(add_generation_prompt: bool | None, continue_final_message: bool,
                       messages: list[Message]) -> None:
    """continue_final_message continues the last message, an assistant's: it opens no new answer."""
    if not continue_final_message:
        return
    if add_generation_prompt:
        raise BadRequest("continue_final_message cannot be combined with add_generation_prompt true (it continues "
                         "the last message instead of opening an answer)", "continue_final_message")
    if messages[-1].role != "assistant":
        raise BadRequest("continue_final_message needs an assistant message last", "continue_final_message")


def refuse_unless(value: Any, allowed: tuple, field: str, why: str) -> None:
    """A known field we cannot honour is accepted only at a value that asks for nothing."""
    if value not in allowed:
        raise BadRequest(f"`{field}` is not supported: {why}", field)


class BadRequest(ValueError):
    """A request that is well-formed JSON but cannot be served as asked (-> 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ShapeError(ValueError):
    """A union field given a value of none of its shapes: the refusal is one sentence naming the field and what it
    takes (services/api/errors.py adds the field's place in the body)."""

    def __init__(self, shapes: str):
        super().__init__(f"must be {shapes}")
        self.shapes = shapes


def one_of(shapes: str) -> WrapValidator:
    """The validator of a union field (`Annotated[A | B, one_of("a string or ...")]`): a value of none of its
    types is refused with one sentence, "`prompt` must be a string, a list of strings, ...", instead of pydantic's
    error per member ("prompt.str: Input should be a valid string"). A member's own check (a BadRequest) still
    speaks for itself. tests/unit/api/test_union_fields.py checks that every union field of a body has one."""

    def validate(value: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            return handler(value)
        except ValidationError as e:
            for error in e.errors():
                if isinstance(own := (error.get("ctx") or {}).get("error"), BadRequest):
                    raise own from None
            raise ShapeError(shapes) from None

    validate.shapes = shapes  # type: ignore[attr-defined]
    return WrapValidator(validate)


TOKEN_PROMPTS = "a string, a list of strings, a list of token ids or a list of lists of token ids"
SCHEMA_SHAPES = "a JSON schema: an object, or its JSON text"
STRINGS = "a string or a list of strings"


def schema_text(value: dict[str, Any] | str, param: str) -> str:
    """A JSON schema given as an object or as JSON text, as compact JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise BadRequest(f"`{param}` must be a JSON schema (an object, or its JSON text)", param) from None
    if not isinstance(value, dict):
        raise BadRequest(f"`{param}` must be a JSON schema object", param)
    return json.dumps(value, separators=(",", ":"))


def check_effort(effort: str | None, param: str) -> None:
    """A reasoning effort is one of OpenAI's values."""
    if effort is not None and effort not in REASONING_EFFORTS:
        raise BadRequest(f"`{param}` must be one of {', '.join(REASONING_EFFORTS)}; got {str(effort)[:40]!r}", param)


def check_schema_name(name: Any, param: str) -> None:
    """A json_schema's `name` is required, as OpenAI requires it."""
    if not isinstance(name, str) or not SCHEMA_NAME.match(name):
        raise BadRequest(f"`{param}` is required: the schema's name, 1 to 64 letters, digits, underscores or "
                         "dashes", param)


def template_kwargs(kwargs: dict[str, Any] | None, effort: str | None) -> dict[str, Any]:
    """The chat template's variables: a reasoning effort reaches it as `reasoning_effort` (as vLLM passes it; the
    templates that read it, gpt-oss's, honour it), unless chat_template_kwargs set that variable themselves."""
    return {"reasoning_effort": effort, **(kwargs or {})} if effort is not None else dict(kwargs or {})


def response_format_constraint(fmt: dict[str, Any] | None) -> Guided | None:
    """OpenAI's response_format: text (nothing), json_object, or json_schema {name, schema, strict}."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Guided("json_object", param="response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")  # type: ignore[union-attr]
        if not isinstance(spec, dict):
            raise BadRequest("response_format.json_schema must be an object with `name` and `schema`",
                             "response_format")
        check_schema_name(spec.get("name"), "response_format.json_schema.name")
        if spec.get("schema") is None:
            return Guided("json_object", param="response_format")
        return Guided("json_schema", schema_text(spec["schema"], "response_format"), param="response_format")
    raise BadRequest(f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
                     "response_format")


@dataclass(frozen=True)
class Budget:
    """What one request asks the engines for, in sequences, completion tokens and logprob entries.

    `max_tokens` None (omitted) counts as the model's whole context per sequence, the most it can run; while
    the context is unknown (no worker of the model has declared it yet) it counts as the whole token budget,
    so a single sequence is always taken and several need a `max_tokens`. A `max_tokens` past the context
    counts as the context: the tokenizer refuses it with the context error, the clearer one.
    `prompt_tokens`: an upper bound of each prompt's tokens, counted for logprobs when the prompt is echoed
    with them (its UTF-8 bytes: every token is at least one byte; or its token ids)."""

    prompts: int
    choices: int  # per prompt: best_of, or n
    max_tokens: int | None
    logprobs: int | None = None  # top logprobs per token when logprobs are returned, else None
    echo_prompt_tokens: tuple[int, ...] = ()  # per prompt, when an echoed prompt's logprobs are returned
    tokens_param: str = "max_tokens"
    choices_param: str = "n"
    prompts_param: str = "prompt"  # the field the prompts come from (`input`, `items` in prefill-only requests)
    logprobs_param: str = "logprobs"


@dataclass(frozen=True)
class Stamp:
    """What the server adds to the jobs of a body it takes for `model`: its identity, uids its reply hub reads
    (services/api/reply_hub.py `new_uid`), the cap on the deadline, and what the stages report of the model."""

    model: str
    pod: str
    timeout_s: float  # --request-timeout-s: the longest a request lives, whatever its `timeout`
    new_uid: Callable[[], str]
    model_info: dict
    adapter: str | None = None  # the LoRA adapter the request names (services/api/adapters.py)

    def job(self, timeout: float | None, background: bool | None, **fields: Any) -> TokenizeJob:
        now = time.time()
        return TokenizeJob(uid=self.new_uid(), model=self.model, pod=self.pod, created_at=now,
                           deadline=now + (min(timeout, self.timeout_s) if timeout else self.timeout_s),
                           background=bool(background), adapter=self.adapter, **fields)


@dataclass(frozen=True)
class Submission:
    """What a body submits: its jobs (one per prompt), the format of its answer, and the fields of its record
    that say how it is answered (services/api/request.py writes them with each job)."""

    jobs: list[TokenizeJob]
    fmt: Format
    record: dict
    stream: bool
    label: str  # how it is answered, in the metrics: stream, full, generate
    # What the request stores beside its record (a stored response, services/api/responses.py): queued on the
    # pipeline that opens it (services/api/request.py), in the same transaction, so nothing is stored for a
    # request that was not opened.
    writes: Callable[[Any], None] | None = None


def submission(jobs: list[TokenizeJob], fmt: Format, kind: str, stream: bool | None, *, label: str | None = None,
               annotations: dict[str, str] | None = None) -> Submission:
    """`kind`: the record's (chat, completion, generate); `annotations`: what the client tells about itself, and
    what a reattach needs besides the format's fields; `label` by default says stream or full."""
    record = {"kind": kind, "n": jobs[0].params.n, **fmt.record_fields(), **(annotations or {})}
    if jobs[0].adapter:  # the LoRA adapter the client named as `model` (a reattached stream says it too)
        record["adapter"] = jobs[0].adapter
    return Submission(jobs, fmt, record, bool(stream), label or ("stream" if stream else "full"))


class StreamOptions(BaseModel):
    model_config = FORBID
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: every chunk carries the usage so far
    include_obfuscation: bool | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> StreamOptions:
        refuse_unless(self.include_obfuscation, (None, False), "stream_options.include_obfuscation",
                      "streams are not padded")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # other part types carry other fields; they are refused by type
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = FORBID
    name: str
    arguments: Annotated[str | dict[str, Any], one_of("a string of JSON or an object")] = "{}"


class ToolCall(BaseModel):
    model_config = FORBID
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = FORBID
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # arguments are always constrained to `parameters` when a call is enforced


class Tool(BaseModel):
    model_config = FORBID
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(BaseModel):
    model_config = FORBID
    type: Literal["function"]
    function: dict[str, str]

    @field_validator("function")
    @classmethod
    def _named(cls, v: dict[str, str]) -> dict[str, str]:
        if set(v) != {"name"}:
            raise ValueError("tool_choice.function must be {\"name\": ...}")
        return v


class Message(BaseModel):
    model_config = FORBID
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Annotated[str | list[TextPart] | None, one_of(
        'a string or a list of content parts ({"type": "text", "text": ...})')] = None
    name: str | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # an earlier answer's reasoning, as returned; templates may use it
    function_call: Any = None
    audio: Any = None

    @model_validator(mode="after")
    def _unsupported(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise BadRequest("only assistant messages carry tool_calls", "messages.tool_calls")
        refuse_unless(self.function_call, (None,), "messages.function_call",
                      "the deprecated function_call is not supported; use tool_calls")
        refuse_unless(self.audio, (None,), "messages.audio", "audio is not supported")
        return self

    def flat(self) -> ChatMessage:
        content = self.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise BadRequest("only text content parts are supported", "messages")
            content = "".join(p.text or "" for p in content)
        role = "system" if self.role == "developer" else self.role
        calls = [c.model_dump(exclude_none=True) for c in self.tool_calls] if self.tool_calls else None
        return ChatMessage(role=role, content=content or self.refusal or "", name=self.name,
                           tool_call_id=self.tool_call_id, tool_calls=calls, reasoning_content=self.reasoning_content)


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: str = Field(min_length=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None  # 0 is greedy
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1
    stop: Annotated[str | list[str] | None, one_of(STRINGS)] = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # kept in the request record, as OpenAI keeps it for abuse monitoring
    # Extensions (vLLM / SGLang).
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    ignore_eos: bool | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    timeout: Annotated[float, Field(gt=0)] | None = None
    background: bool | None = False
    priority: int = Field(0, ge=-(2**31), lt=2**31)  # lower first (vLLM's order)
    # Structured outputs (SGLang: regex, json, ebnf; vLLM: guided_*): the answer follows the constraint.
    regex: str | None = None
    json_: Annotated[dict[str, Any] | str | None, one_of(SCHEMA_SHAPES)] = Field(None, alias="json")
    ebnf: str | None = None
    guided_json: Annotated[dict[str, Any] | str | None, one_of(SCHEMA_SHAPES)] = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    lora_path: str | None = None  # SGLang's: the name of the LoRA adapter to run with (services/api/adapters.py)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return v

    def constraints(self) -> list[Guided]:
        """The structured-output fields set, as constraints (at most one may be)."""
        out = []
        for field, kind in (("regex", "regex"), ("json_", "json_schema"), ("ebnf", "ebnf"),
                            ("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_grammar", "ebnf"),
                            ("guided_choice", "choice")):
            value = getattr(self, field)
            if value is None:
                continue
            name = field.rstrip("_")
            if kind == "json_schema":
                value = schema_text(value, name)
            elif kind == "choice":
                if not value:
                    raise BadRequest("guided_choice must list at least one string", name)
                value = json.dumps(value)
            out.append(Guided(kind, value, param=name))
        return out

    def guided(self, extra: tuple[Guided, ...] = ()) -> Guided | None:
        found = [*self.constraints(), *extra]
        if len(found) > 1:
            raise BadRequest("give at most one structured-output constraint; got " +
                             ", ".join(f"`{g.param}`" for g in found), found[1].param)
        return found[0] if found else None

    def sampling(self, max_tokens: int | None, logprobs: bool, top_logprobs: int,
                 guided: Guided | None = None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        values: dict[str, Any] = dict(
            max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, n=self.n, logprobs=logprobs,
            top_logprobs=top_logprobs, skip_special_tokens=self.skip_special_tokens, guided=guided,
            logit_bias=self.token_bias())
        return SamplingParams(**{k: v for k, v in values.items() if v is not None})

    def token_bias(self) -> dict[int, float] | None:
        """OpenAI's logit_bias: token ids (as JSON object keys) to a bias in [-100, 100]."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            if not key.lstrip("-").isdigit() or int(key) < 0:
                raise BadRequest(f"logit_bias keys must be token ids; got {key!r}", "logit_bias")
            if not -100 <= bias <= 100:
                raise BadRequest(f"logit_bias values must be in [-100, 100]; got {bias}", "logit_bias")
            out[int(key)] = float(bias)
        return out

    def annotations(self) -> dict[str, str]:
        """What the client tells about itself, kept in the request record."""
        return {"user": self.user} if self.user else {}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Annotated[Literal["none", "auto", "required"] | NamedToolChoice | None, one_of(
        '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}')] = None
    parallel_tool_calls: bool | None = None  # no effect without tools, as with OpenAI
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    safety_identifier: str | None = None  # kept in the request record, like `user`
    metadata: dict[str, str] | None = None  # kept in the request record
    prompt_cache_key: str | None = None  # a hint; the prefix cache needs none
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    moderation: Any = None
    add_generation_prompt: bool | None = None  # omitted: true, unless continue_final_message (SGLang infers it)
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise BadRequest("tool_choice \"required\" or a named function needs `tools`", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function["name"] not in {
                t.function.name for t in self.tools or []}:
            raise BadRequest(f"tool_choice names `{self.tool_choice.function['name']}`, which is not among the "
                             "tools", "tool_choice")
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs requires logprobs to be true", "top_logprobs")
        refuse_unless(self.store, (None, False), "store", "requests are kept only for the server's record TTL")
        refuse_unless(self.service_tier, (None, "auto", "default"), "service_tier", "there is one tier")
        refuse_unless(self.modalities, (None, ["text"]), "modalities", "only text output is supported")
        refuse_unless(self.prompt_cache_retention, (None, "in_memory"), "prompt_cache_retention",
                      "cached prefixes live in the KV cache's memory only")
        refuse_unless(self.prompt_cache_options, (None, {}), "prompt_cache_options",
                      "cached prefixes live in the KV cache's memory only")
        check_effort(self.reasoning_effort, "reasoning_effort")
        for name in ("verbosity", "audio", "prediction", "web_search_options", "functions", "function_call",
                     "moderation"):
            refuse_unless(getattr(self, name), (None,), name, "this server does not offer it")
        check_continuation(self.add_generation_prompt, self.continue_final_message, self.messages)
        return self

    def checked(self, limits: FieldLimits) -> SamplingParams:
        """The sampling parameters, once every field is within the server's limits (a 400 naming the field)."""
        params = self.params()
        limits.record_fields(self.user, self.safety_identifier, self.metadata)
        limits.sampling(params)
        limits.chat_fields(self.tool_dicts, self.chat_template_kwargs)
        return params

    def submission(self, params: SamplingParams, stamp: Stamp) -> Submission:
        job = stamp.job(self.timeout, self.background, params=params, messages=self.chat_messages(),
                        add_generation_prompt=generation_prompt(self.add_generation_prompt,
                                                                self.continue_final_message),
                        continue_final_message=self.continue_final_message, tools=self.tool_dicts,
                        tool_choice=self.tool_choice_struct(),
                        chat_template_kwargs=template_kwargs(self.chat_template_kwargs, self.reasoning_effort),
                        priority=self.priority)
        parse = self.answer_parsing(stamp.model_info)
        fmt = ChatFormat(Head(f"chatcmpl-{job.uid}", self.model, int(job.created_at), params.n, params.logprobs,
                              self.include_usage), parse)
        fmt.continuous_usage = self.continuous_usage
        annotations = {**self.annotations(), **({"parse": orjson.dumps(parse).decode()} if parse else {})}
        return submission([job], fmt, "chat", self.stream, annotations=annotations)

    def answer_parsing(self, model_info: dict) -> dict:
        """How this model's answers are split (what its tokenizer detected): reasoning, and tool calls when the
        request offers tools and lets the model call them."""
        out: dict = {}
        if model_info.get("reasoning_parser", "none") != "none":
            out["reasoning"] = model_info["reasoning_parser"]
        elif self.reasoning_effort not in (None, "none"):
            raise BadRequest(f"`reasoning_effort` is not supported by model `{self.model}` (its template does not "
                             "reason)", "reasoning_effort")
        if self.parses_tool_calls and model_info.get("tool_call_parser", "none") != "none":
            out["tools"] = model_info["tool_call_parser"]
        return out

    def params(self) -> SamplingParams:
        fmt = response_format_constraint(self.response_format)
        guided = self.guided((fmt,) if fmt else ())
        choice = self.tool_choice_struct()
        if guided is not None and choice is not None and choice.mode in ("required", "function"):
            raise BadRequest(f"tool_choice {self.tool_choice!r} constrains the answer to tool calls; it cannot be "
                             f"combined with `{guided.param}`", "tool_choice")
        return self.sampling(self.max_completion_tokens or self.max_tokens, bool(self.logprobs),
                             self.top_logprobs or 0, guided)

    def budget(self, params: SamplingParams) -> Budget:
        return Budget(1, params.n, params.max_tokens, params.top_logprobs if params.logprobs else None,
                      tokens_param="max_completion_tokens" if self.max_completion_tokens else "max_tokens",
                      logprobs_param="top_logprobs" if self.top_logprobs else "logprobs")

    def tool_choice_struct(self) -> ToolChoice | None:
        if not self.tools:
            return None
        parallel = self.parallel_tool_calls is not False
        if isinstance(self.tool_choice, NamedToolChoice):
            return ToolChoice("function", self.tool_choice.function["name"], parallel)
        return ToolChoice(self.tool_choice or "auto", None, parallel)

    @cached_property
    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def annotations(self) -> dict[str, str]:
        out = super().annotations()
        if self.safety_identifier:
            out["safety_identifier"] = self.safety_identifier
        if self.metadata:
            out["metadata"] = json.dumps(self.metadata, separators=(",", ":"))
        return out

    def chat_messages(self) -> list[ChatMessage]:
        return [m.flat() for m in self.messages]


class CompletionRequest(SamplingFields):
    # null or omitted: OpenAI's default prompt, `<|endoftext|>` (the tokenizer's bos or eos text without it)
    prompt: Annotated[str | list[int] | list[str] | list[list[int]] | None, one_of(TOKEN_PROMPTS)] = None
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool | None = False
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < (self.n or 1):
            raise BadRequest(f"best_of ({self.best_of}) must be at least n ({self.n or 1})", "best_of")
        if self.stream and self.best_of is not None and self.best_of > (self.n or 1):
            raise BadRequest("best_of above n cannot be streamed (the best choices are known at the end)",
                             "best_of")
        return self

    def checked(self, limits: FieldLimits) -> SamplingParams:
        """The sampling parameters, once every field is within the server's limits (a 400 naming the field)."""
        params = self.params()
        self.prompt_list  # noqa: B018  (the prompts' own 400s come first, as they are read)
        limits.record_fields(self.user)
        limits.sampling(params)
        return params

    def submission(self, params: SamplingParams, stamp: Stamp) -> Submission:
        jobs = [stamp.job(self.timeout, self.background, params=params, prompt=prompt, input_ids=ids,
                          suffix=self.suffix, priority=self.priority) for prompt, ids in self.prompt_list]
        fmt = CompletionFormat(Head(f"cmpl-{jobs[0].uid}", self.model, int(jobs[0].created_at), len(jobs) * params.n,
                                    self.logprobs is not None, self.include_usage), echo=bool(self.echo),
                               best_of=params.n, keep=self.n or 1)
        fmt.continuous_usage = self.continuous_usage
        annotations = {**self.annotations(), **({"echo": "1"} if self.echo else {})}
        return submission(jobs, fmt, "completion", self.stream, annotations=annotations)

    @cached_property
    def prompt_list(self) -> list[tuple[str | None, list[int] | None]]:
        return self.prompts()

    def prompts(self) -> list[tuple[str | None, list[int] | None]]:
        """The request's prompts, each as text or as token ids (OpenAI takes one or a list of either)."""
        p = self.prompt
        if p is None:
            return [(None, None)]  # the tokenizer's default prompt (services/tokenizer/encode.py)
        if isinstance(p, str):
            return [(p, None)]
        if not p:
            raise BadRequest("prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [(None, list(p))]  # type: ignore[arg-type]
        if len(p) > MAX_PROMPTS:
            raise BadRequest(f"at most {MAX_PROMPTS} prompts in one request", "prompt")
        return [(x, None) if isinstance(x, str) else (None, list(x)) for x in p]  # type: ignore[misc]

    @property
    def choices_per_prompt(self) -> int:
        """Choices the engine runs per prompt: best_of of them, of which the best n are returned."""
        return max(self.best_of or 1, self.n or 1)

    def budget(self, params: SamplingParams) -> Budget:
        """Logprobs count only when returned (best_of ranks choices by logprobs the answer leaves out)."""
        prompts = self.prompt_list
        echoed = tuple(len(text.encode()) if text is not None else len(ids) if ids is not None else 1
                       for text, ids in prompts)
        return Budget(len(prompts), params.n, params.max_tokens, self.logprobs,
                      echoed if self.echo and self.logprobs is not None else (),
                      choices_param="best_of" if self.best_of else "n")

    def params(self) -> SamplingParams:
        lp = self.logprobs
        p = self.sampling(self.max_tokens, lp is not None or self.choices_per_prompt > (self.n or 1), lp or 0,
                          self.guided())
        return msgspec.structs.replace(p, n=self.choices_per_prompt, echo=bool(self.echo),
                                       prompt_logprobs=lp if self.echo and lp is not None else None)


class GenerateRequest(BaseModel):
    """SGLang-style native request: text or input_ids, sampling_params, stream, priority."""

    model_config = FORBID
    model: str | None = None
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    priority: int = Field(0, ge=-(2**31), lt=2**31)
    lora_path: str | None = None  # SGLang's: the name of the LoRA adapter to run with (services/api/adapters.py)

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise BadRequest("give exactly one of text and input_ids", "text")
        return self

    def checked(self, limits: FieldLimits) -> SamplingParams:
        params = self.params()
        limits.sampling(params, "sampling_params.")
        return params

    def submission(self, params: SamplingParams, stamp: Stamp) -> Submission:
        job = stamp.job(None, False, params=params, prompt=self.text, input_ids=self.input_ids,
                        priority=self.priority)
        fmt = GenerateFormat(job.uid, stamp.model, int(job.created_at))
        return submission([job], fmt, "generate", self.stream, label="generate")

    def budget(self, params: SamplingParams) -> Budget:
        return Budget(1, 1, params.max_tokens, tokens_param="sampling_params")

    def params(self) -> SamplingParams:
        sp = dict(self.sampling_params)
        for top in ("priority", "lora_path"):
            if top in sp:
                raise BadRequest(f"`{top}` goes at the top level of the request, not in sampling_params",
                                 "sampling_params")
        if sp.get("n") not in (None, 1):  # one text answers: several choices would run together in it
            raise BadRequest("/generate answers with one text; for several choices use /v1/completions with `n`",
                             "sampling_params.n")
        renames = (("max_new_tokens", "max_tokens"), ("min_new_tokens", "min_tokens"), ("json_schema", "json"))
        for sglang, ours in renames:
            if sglang in sp:
                sp[ours] = sp.pop(sglang)
        sp.setdefault("max_tokens", 128)
        try:
            fields = SamplingFields(model="native", **sp)
        except ValueError as e:
            raise BadRequest(f"bad sampling_params: {e}", "sampling_params") from e
        return fields.sampling(fields.max_tokens, False, 0, fields.guided())
