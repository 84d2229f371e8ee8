"""The body of `POST /v1/responses` (OpenAI's Responses API) at the HTTP edge, and what it submits.

A response is a chat request underneath: `instructions`, the conversation of `previous_response_id` (its stored
items, services/api/responses_api/responses.py) and `input` become the chat messages of one tokenize job, `tools` and
`text.format` the chat request's tools and structured-output constraint. Every field OpenAI's SDK sends is
honoured or refused with a 400 naming it; unknown fields are refused as everywhere else (services/api/answer/schemas/).

Items are kept as OpenAI shows them (`input_items`, a later `previous_response_id`): messages with text content
parts, `function_call` and `function_call_output` items.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, Field, model_validator

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
from shared.messages import ChatMessage, SamplingParams, ToolChoice

if TYPE_CHECKING:
    from services.api.answer.limits import Limits
    from services.api.responses_api.response_format import ResponseFormat

RESPONSE_ID = re.compile(r"^resp_[A-Za-z0-9_-]{1,128}$")
TEXT_PARTS = ("input_text", "output_text", "text")


def response_uid(response_id: str, param: str = "response_id") -> str:
    """The request uid of a response id (`resp_<uid>`); a malformed id is a 400."""
    if not RESPONSE_ID.match(response_id):
        raise BadRequest(f"`{response_id[:80]}` is not a response id (resp_...)", param)
    return response_id.removeprefix("resp_")


class FunctionTool(BaseModel):
    model_config = FORBID
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict[str, Any]:
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters,
              "strict": self.strict}
        return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


class NamedFunction(BaseModel):
    model_config = FORBID
    type: Literal["function"]
    name: str


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
    """OpenAI's ResponseCreateParams, what rsinfer honours of it."""

    model_config = FORBID
    model: str = Field(min_length=1)
    input: Annotated[str | list[dict[str, Any]], one_of("a string or a list of input items (objects)")]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Annotated[Literal["none", "auto", "required"] | NamedFunction | None, one_of(
        '"none", "auto", "required" or {"type": "function", "name": ...}')] = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: Reasoning | None = None
    store: bool | None = True
    background: bool | None = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: bool | None = False
    truncation: Literal["disabled"] | None = None
    service_tier: str | None = None
    cache_salt: CacheSalt | None = None  # vLLM's: prefix-cache pages shared only with the same salt (and tenant)
    slo: SloTargets | None = None  # latency targets (services/api/answer/slo.py)

    @model_validator(mode="after")
    def _consistent(self) -> ResponseRequest:
        if self.background and self.store is False:
            raise BadRequest("`background` requires `store` (a background response is read back later)", "store")
        if isinstance(self.tool_choice, NamedFunction) and self.tool_choice.name not in {
                t.name for t in self.tools or []}:
            raise BadRequest(f"tool_choice names `{self.tool_choice.name}`, which is not among the tools",
                             "tool_choice")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise BadRequest("tool_choice \"required\" or a named function needs `tools`", "tool_choice")
        refuse_unless(self.service_tier, (None, "auto", "default"), "service_tier", "there is one tier")
        if self.previous_response_id is not None:
            response_uid(self.previous_response_id, "previous_response_id")
        return self

    # -- what it asks for ------------------------------------------------------------------------------------
    def input_items(self) -> list[dict[str, Any]]:
        """`input` as items (a string is one user message), each checked (a 400 naming the bad item)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": self.input}]}]
        if not self.input:
            raise BadRequest("`input` must not be empty", "input")
        return [checked_item(item, f"input[{k}]") for k, item in enumerate(self.input)]

    def checked(self, limits: Limits, items: int) -> SamplingParams:
        """The sampling parameters, once every field is within the server's limits; `items`: the
        conversation's items, previous responses' included."""
        limits.response_items(items)
        limits.record_fields(self.user, None, self.metadata)
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

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.chat_tool() for t in self.tools] if self.tools else None

    def tool_choice_struct(self) -> ToolChoice | None:
        if not self.tools:
            return None
        parallel = self.parallel_tool_calls is not False
        if isinstance(self.tool_choice, NamedFunction):
            return ToolChoice("function", self.tool_choice.name, parallel)
        return ToolChoice(self.tool_choice or "auto", None, parallel)

    def shown(self, previous: str | None) -> dict[str, Any]:
        """The request's fields as the response object shows them (OpenAI echoes them)."""
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedFunction) else (
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
                "truncation": "disabled", "service_tier": "default"}

    def submission(self, params: SamplingParams, stamp: Stamp, messages: list[ChatMessage],
                   fmt: ResponseFormat) -> Submission:
        job = stamp.job(None, self.background, params=params, messages=messages, tools=self.tool_dicts(),
                        tool_choice=self.tool_choice_struct(),
                        chat_template_kwargs=template_kwargs(None, self.reasoning.effort if self.reasoning else None))
        fmt.start(job.uid, int(job.created_at))
        return submission([job], fmt, "response", self.stream, annotations={"user": self.user} if self.user else {})

    def messages(self, history: list[dict[str, Any]], items: list[dict[str, Any]]) -> list[ChatMessage]:
        """The chat messages of `instructions` (a previous response's are not carried over, as at OpenAI),
        the earlier conversation and this input."""
        head = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        return head + chat_messages([*history, *items])


def checked_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    """One input item in OpenAI's shape, normalized (content as a list of text parts, a `type`)."""
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise BadRequest(f"{where}: a message's role is user, system, developer or assistant", "input")
        return {"type": "message", "role": role, "content": text_parts(item.get("content"), where)}
    if kind == "function_call":
        fields = {k: item.get(k) for k in ("call_id", "name", "arguments")}
        if not all(isinstance(v, str) for v in fields.values()):
            raise BadRequest(f"{where}: a function_call has string `call_id`, `name` and `arguments`", "input")
        return {"type": "function_call", **fields}
    if kind == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or not isinstance(output, str):
            raise BadRequest(f"{where}: a function_call_output has string `call_id` and `output`", "input")
        return {"type": "function_call_output", "call_id": call_id, "output": output}
    raise BadRequest(f"{where}: item type {kind!r} is not supported (message, function_call, "
                     "function_call_output)", "input")


def text_parts(content: Any, where: str) -> list[dict[str, str]]:
    if isinstance(content, str):
        return [{"type": "input_text", "text": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{where}: `content` is a string or a list of text parts", "input")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}: only text content parts are supported (input_text, output_text)", "input")
        parts.append({"type": part["type"], "text": part["text"]})
    return parts


def chat_messages(items: list[dict[str, Any]]) -> list[ChatMessage]:
    """Items -> chat messages: consecutive function calls are one assistant message with their tool calls."""
    out: list[ChatMessage] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            out.append(ChatMessage(role=role, content="".join(p["text"] for p in item["content"])))
        elif kind == "function_call_output":
            out.append(ChatMessage(role="tool", content=item["output"], tool_call_id=item["call_id"]))
        else:
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and last.tool_calls and not last.content:
                out[-1] = ChatMessage(role="assistant", content="", tool_calls=[*last.tool_calls, call])
            else:
                out.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
    return out


def as_input(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the input items of the next turn."""
    items = []
    for item in output:
        if item["type"] == "message":
            items.append({"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": p["text"]} for p in item["content"]]})
        elif item["type"] == "function_call":
            items.append({"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                          "arguments": item["arguments"]})
    return items
