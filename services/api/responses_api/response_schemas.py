"""The body of `POST /v1/responses` (OpenAI's Responses API) at the HTTP edge, and what it submits.

A response is a chat request underneath: `instructions`, the conversation of `previous_response_id` (its stored
items, services/api/responses_api/responses.py) and `input` become the chat messages of one tokenize job, `tools` and
`text.format` the chat request's tools and structured-output constraint. Every field OpenAI's SDK sends is
honoured or refused with a 400 naming it; unknown fields are refused as everywhere else (services/api/answer/schemas/).

Items are kept as OpenAI shows them (`input_items`, a later `previous_response_id`), normalized and checked by
services/api/responses_api/response_items.py. Tools are functions and custom tools (free-form input: to the
template a function of one string, `input`; a `regex` grammar constrains it where a function's parameters
constrain its arguments, when the call is forced; a `lark` grammar cannot constrain text the model writes
inside a JSON string, so forcing such a call is refused).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from services.api.answer.schemas.chat import response_format_constraint, template_kwargs
from services.api.answer.schemas.field_checks import (
    FORBID,
    BadRequest,
    check_effort,
    check_schema_name,
    one_of,
    refuse_unless,
)
from services.api.answer.schemas.sampling_fields import CacheSalt, SloTargets
from services.api.answer.schemas.submission import Budget, Stamp, Submission, submission
from services.api.responses_api.response_items import Opener, chat_messages, checked_item
from shared.messages import ChatMessage, SamplingParams, ToolChoice

if TYPE_CHECKING:
    from services.api.answer.limits import Limits
    from services.api.responses_api.response_format import ResponseFormat

RESPONSE_ID = re.compile(r"^resp_[A-Za-z0-9_-]{1,128}$")
TOOL_NAME = r"^[A-Za-z0-9_.:-]+$"
ENCRYPTED = "reasoning.encrypted_content"
# What `include` may ask for: the sealed reasoning (honoured), or parts of items of hosted tools this server never
# runs (nothing to include). `message.output_text.logprobs` is refused: responses carry no logprobs here.
INCLUDABLE = (ENCRYPTED, "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs")
FREE_FORM = "Free-form input: call it with the whole input as the string argument `input`."


def response_uid(response_id: str, param: str = "response_id") -> str:
    """The request uid of a response id (`resp_<uid>`); a malformed id is a 400."""
    if not RESPONSE_ID.match(response_id):
        raise BadRequest(f"`{response_id[:80]}` is not a response id (resp_...)", param)
    return response_id.removeprefix("resp_")


class FunctionTool(BaseModel):
    model_config = FORBID
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict[str, Any]:
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters,
              "strict": self.strict}
        return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


class TextInput(BaseModel):
    model_config = FORBID
    type: Literal["text"]


class GrammarInput(BaseModel):
    model_config = FORBID
    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: str = Field(min_length=1)


class CustomTool(BaseModel):
    """A tool whose input is free text (OpenAI's CustomToolParam)."""

    model_config = FORBID
    type: Literal["custom"]
    name: str = Field(min_length=1, max_length=64, pattern=TOOL_NAME)
    description: str | None = None
    format: Annotated[TextInput | GrammarInput | None, one_of(
        '{"type": "text"} or {"type": "grammar", "syntax": "lark" or "regex", "definition": ...}')] = None

    def chat_tool(self) -> dict[str, Any]:
        text: dict[str, Any] = {"type": "string"}
        if isinstance(self.format, GrammarInput) and self.format.syntax == "regex":
            text["pattern"] = f"^(?:{self.format.definition})$"
        params = {"type": "object", "properties": {"input": text}, "required": ["input"],
                  "additionalProperties": False}
        description = f"{self.description}\n\n{FREE_FORM}" if self.description else FREE_FORM
        return {"type": "function", "function": {"name": self.name, "description": description,
                                                 "parameters": params}}

    def lark(self) -> bool:
        return isinstance(self.format, GrammarInput) and self.format.syntax == "lark"


class NamedFunction(BaseModel):
    """tool_choice naming one tool: {"type": "function" or "custom", "name": ...}."""

    model_config = FORBID
    type: Literal["function", "custom"]
    name: str


class AllowedTools(BaseModel):
    """tool_choice {"type": "allowed_tools"}: the model sees and may call only these of `tools`."""

    model_config = FORBID
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[NamedFunction] = Field(min_length=1)


class StreamOptions(BaseModel):
    model_config = FORBID
    include_obfuscation: bool | None = None


class TextFormat(BaseModel):
    model_config = FORBID
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _complete(self) -> TextFormat:
        """A json_schema format has its `name` and `schema`, as OpenAI requires (the response echoes them)."""
        if self.type == "json_schema":
            check_schema_name(self.name, "text.format.name")
            if self.schema_ is None:
                raise BadRequest("`text.format.schema` is required with type json_schema", "text.format.schema")
        return self

    def response_format(self) -> dict[str, Any]:
        """The chat request's `response_format` it stands for."""
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": {"name": self.name, "schema": self.schema_}}

    def shown(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextOptions(BaseModel):
    model_config = FORBID
    format: TextFormat = Field(default_factory=TextFormat)
    verbosity: str | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> TextOptions:
        refuse_unless(self.verbosity, (None, "medium"), "text.verbosity", "there is one verbosity")
        return self


class Reasoning(BaseModel):
    model_config = FORBID
    effort: str | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None

    @model_validator(mode="after")
    def _known(self) -> Reasoning:
        check_effort(self.effort, "reasoning.effort")
        return self


class ResponseRequest(BaseModel):
    """OpenAI's ResponseCreateParams, what rsinfer honours of it (what the official SDK and the Agents SDK send;
    a field that asks for nothing, such as `conversation: null`, is accepted)."""

    model_config = FORBID
    model: str = Field(min_length=1)
    input: Annotated[str | list[dict[str, Any]], one_of("a string or a list of input items (objects)")]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    tools: list[Annotated[FunctionTool | CustomTool, one_of("a function or a custom tool")]] | None = None
    tool_choice: Annotated[Literal["none", "auto", "required"] | NamedFunction | AllowedTools | None, one_of(
        '"none", "auto", "required", {"type": "function" or "custom", "name": ...} or {"type": "allowed_tools", '
        '"mode": ..., "tools": [...]}')] = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: Annotated[int, Field(ge=1, le=1 << 20)] | None = None  # calls of hosted tools: none run here
    text: TextOptions | None = None
    reasoning: Reasoning | None = None
    include: list[str] | None = Field(None, max_length=len(INCLUDABLE))
    store: bool | None = True
    background: bool | None = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    service_tier: str | None = None
    cache_salt: CacheSalt | None = None  # vLLM's: prefix-cache pages shared only with the same salt (and tenant)
    slo: SloTargets | None = None  # latency targets (services/api/answer/slo.py)
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    prompt_cache_options: Any = None

    @field_validator("tools", mode="before")
    @classmethod
    def _tool_types(cls, tools: Any) -> Any:
        for k, tool in enumerate(tools if isinstance(tools, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in ("function", "custom"):
                raise BadRequest(f"`tools[{k}]`: tool type {str(kind)[:40]!r} is not supported (function, custom): "
                                 "this server runs no hosted tools", "tools")
        return tools

    @model_validator(mode="after")
    def _consistent(self) -> ResponseRequest:
        if self.background and self.store is False:
            raise BadRequest("`background` requires `store` (a background response is read back later)", "store")
        self._check_tools()
        refuse_unless(self.service_tier, (None, "auto", "default"), "service_tier", "there is one tier")
        for name in ("conversation", "prompt", "context_management", "prompt_cache_options"):
            refuse_unless(getattr(self, name), (None,), name, "not kept by this server (chain turns with "
                          "previous_response_id, or send them as `input`)")
        refuse_unless(self.prompt_cache_retention, (None, "in_memory"), "prompt_cache_retention",
                      "the prefix cache is in the engines' memory only")
        refuse_unless(self.top_logprobs, (None, 0), "top_logprobs", "responses carry no logprobs here")
        refuse_unless(self.truncation, (None, "disabled"), "truncation",
                      "a conversation past the context is refused, not cut (send fewer items)")
        refuse_unless(self.stream_options.include_obfuscation if self.stream_options else None, (None, False),
                      "stream_options.include_obfuscation", "events are not padded")
        for value in self.include or []:
            refuse_unless(value, INCLUDABLE, "include", f"{str(value)[:60]!r} cannot be included (supported: "
                          f"{ENCRYPTED})")
        if self.previous_response_id is not None:
            response_uid(self.previous_response_id, "previous_response_id")
        return self

    def _check_tools(self) -> None:
        tools = {t.name: t for t in self.tools or []}
        if len(tools) < len(self.tools or []):
            raise BadRequest("two `tools` have the same name", "tools")
        choice = self.tool_choice
        named = [choice] if isinstance(choice, NamedFunction) else choice.tools if isinstance(
            choice, AllowedTools) else []
        for tool in named:
            if tool.name not in tools or tools[tool.name].type != tool.type:
                raise BadRequest(f"tool_choice names the {tool.type} tool `{tool.name}`, which is not among the "
                                 "tools", "tool_choice")
        if choice not in (None, "none", "auto") and not self.tools:
            raise BadRequest("tool_choice \"required\" or a named tool needs `tools`", "tool_choice")
        forced = self.tool_choice_struct()
        for k, tool in enumerate(self.offered()):
            if (isinstance(tool, CustomTool) and tool.lark() and forced is not None
                    and forced.mode in ("required", "function") and forced.name in (None, tool.name)):
                raise BadRequest(f"`tools[{k}].format`: a lark grammar cannot constrain a forced call's input here "
                                 "(the model writes it inside JSON); give a regex, or tool_choice \"auto\"",
                                 "tools")

    # -- what it asks for ------------------------------------------------------------------------------------
    def input_items(self, opener: Opener | None = None) -> list[dict[str, Any]]:
        """`input` as items (a string is one user message), each checked (a 400 naming the bad item); `opener`
        opens reasoning items' encrypted_content."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": self.input}]}]
        if not self.input:
            raise BadRequest("`input` must not be empty", "input")
        return [checked_item(item, f"input[{k}]", opener) for k, item in enumerate(self.input)]

    def checked(self, limits: Limits, items: int) -> SamplingParams:
        """The sampling parameters, once every field is within the server's limits; `items`: the
        conversation's items, previous responses' included."""
        limits.response_items(items)
        limits.record_fields(self.user, self.safety_identifier, self.metadata, self.prompt_cache_key)
        params = self.params()
        limits.sampling(params)
        limits.chat_fields(self.tool_dicts(), None)
        return params

    def params(self) -> SamplingParams:
        fmt = self.text.format.response_format() if self.text else None
        guided = response_format_constraint(fmt)
        choice = self.tool_choice_struct()
        if guided is not None and choice is not None and choice.mode in ("required", "function"):
            raise BadRequest("a required tool call cannot be combined with `text.format`", "tool_choice")
        values: dict[str, Any] = {"max_tokens": self.max_output_tokens, "temperature": self.temperature,
                                  "top_p": self.top_p, "guided": guided}
        return SamplingParams(**{k: v for k, v in values.items() if v is not None})

    def budget(self, params: SamplingParams) -> Budget:
        return Budget(1, 1, params.max_tokens, tokens_param="max_output_tokens")

    def offered(self) -> list[FunctionTool | CustomTool]:
        """The tools the model sees: those of an allowed_tools tool_choice, else all."""
        if isinstance(self.tool_choice, AllowedTools):
            allowed = {t.name for t in self.tool_choice.tools}
            return [t for t in self.tools or [] if t.name in allowed]
        return list(self.tools or [])

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.chat_tool() for t in self.offered()] or None

    def tool_choice_struct(self) -> ToolChoice | None:
        if not self.tools:
            return None
        parallel = self.parallel_tool_calls is not False
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            return ToolChoice("function", choice.name, parallel)
        if isinstance(choice, AllowedTools):
            return ToolChoice(choice.mode, None, parallel)
        return ToolChoice(choice or "auto", None, parallel)

    def encrypts(self) -> bool:
        return ENCRYPTED in (self.include or [])

    def shown(self, previous: str | None) -> dict[str, Any]:
        """The request's fields as the response object shows them (OpenAI echoes them)."""
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, BaseModel) else (
            self.tool_choice or "auto")
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata or {}, "model": self.model,
                "parallel_tool_calls": self.parallel_tool_calls is not False, "previous_response_id": previous,
                "temperature": self.temperature if self.temperature is not None else 1.0,
                "top_p": self.top_p if self.top_p is not None else 1.0, "tool_choice": choice,
                "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
                "text": {"format": (self.text.format if self.text else TextFormat()).shown()},
                "reasoning": self.reasoning.model_dump() if self.reasoning else None,
                "store": self.store is not False, "background": bool(self.background), "user": self.user,
                "safety_identifier": self.safety_identifier, "prompt_cache_key": self.prompt_cache_key,
                "max_tool_calls": self.max_tool_calls, "truncation": "disabled", "service_tier": "default"}

    def annotations(self) -> dict[str, str]:
        """What the request record keeps of what the client tells about itself (bounded by `checked`)."""
        fields = {"user": self.user, "safety_identifier": self.safety_identifier,
                  "prompt_cache_key": self.prompt_cache_key}
        return {k: v for k, v in fields.items() if v}

    def submission(self, params: SamplingParams, stamp: Stamp, messages: list[ChatMessage],
                   fmt: ResponseFormat) -> Submission:
        effort = self.reasoning.effort if self.reasoning else None
        # a hybrid reasoner's switch (Qwen3's templates read `enable_thinking`) follows the effort asked for
        thinking = {"enable_thinking": effort != "none"} if effort is not None else None
        job = stamp.job(None, self.background, params=params, messages=messages, tools=self.tool_dicts(),
                        tool_choice=self.tool_choice_struct(), chat_template_kwargs=template_kwargs(thinking, effort))
        fmt.start(job.uid, int(job.created_at))
        return submission([job], fmt, "response", self.stream, annotations=self.annotations())

    def messages(self, history: list[dict[str, Any]], items: list[dict[str, Any]]) -> list[ChatMessage]:
        """The chat messages of `instructions` (a previous response's are not carried over, as at OpenAI),
        the earlier conversation and this input."""
        head = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        return head + chat_messages([*history, *items])
