"""The body of `POST /v1/chat/completions` (OpenAI's CreateChatCompletionRequest): its messages, tools and
answer format, and the chat template's switches the Responses API shares
(services/api/responses_api/response_schemas.py)."""

from __future__ import annotations

import json
from functools import cached_property
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.api.answer.formats import ChatFormat, Head
from services.api.answer.schemas.field_checks import (
    FORBID,
    BadRequest,
    check_effort,
    check_schema_name,
    one_of,
    refuse_unless,
    schema_text,
)
from services.api.answer.schemas.sampling_fields import SamplingFields
from services.api.answer.schemas.submission import Budget, FieldLimits, Stamp, Submission, submission
from shared.messages import ChatMessage, Guided, SamplingParams, ToolChoice


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
