"""The bodies of `POST /v1/messages` and `POST /v1/messages/count_tokens` (Anthropic's MessageCreateParams and
MessageCountTokensParams) at the HTTP edge, and their translation into what a chat request submits.

A message is a chat request underneath: `system` and `messages` become chat messages (text blocks joined with a
newline; `tool_use` blocks an assistant's tool calls, `tool_result` blocks tool messages, `thinking` blocks an
assistant's reasoning), `tools` chat tools whose parameters are their `input_schema`, `tool_choice` the chat
request's (`any` is "required", `tool` a named function: both constrained by a grammar built from the schema, as
chat's are), `thinking` the chat template's `enable_thinking`.

Unknown fields are refused by name, as Anthropic's API refuses them ("Extra inputs are not permitted"). Known
fields that cannot be honoured (server tools, images and documents, MCP servers, containers, structured
`output_format`, another service tier, thinking shown as `omitted`) are refused by name too; `cache_control` and
`citations` are accepted and ignored (every prompt's pages go into the prefix cache anyway; nothing is cited).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

import orjson
from pydantic import BaseModel, Field, model_validator

from services.api.answer.schemas.field_checks import FORBID, BadRequest, one_of, refuse_unless
from services.api.answer.schemas.sampling_fields import MAX_STOP, CacheSalt, SloTargets
from services.api.answer.schemas.submission import Budget, FieldLimits, Stamp, Submission, submission
from services.api.errors import ApiError
from services.api.messages_api.message_format import MessageFormat
from shared.messages import ChatMessage, SamplingParams, ToolChoice

MIN_THINKING_BUDGET = 1024  # Anthropic's: budget_tokens is at least 1024 and below max_tokens
# Keys each block type may carry (beside `type`); `cache_control` and `citations` are accepted and ignored.
BLOCK_KEYS = {"text": {"text", "cache_control", "citations"},
              "tool_use": {"id", "name", "input", "cache_control"},
              "tool_result": {"tool_use_id", "content", "is_error", "cache_control"},
              "thinking": {"thinking", "signature"}, "redacted_thinking": {"data"}}
USER_BLOCKS = ("text", "tool_result")
ASSISTANT_BLOCKS = ("text", "tool_use", "thinking", "redacted_thinking")
REFUSED_BLOCKS = {"image": "images are not supported (text only)", "document": "documents are not supported",
                  "search_result": "search results are not supported",
                  "server_tool_use": "server tools are not supported",
                  "web_search_tool_result": "server tools are not supported",
                  "container_upload": "containers are not supported"}
BLOCKS = "a string or a list of content blocks (objects)"
OUR_NAMES = {"user": "metadata.user_id", "stop": "stop_sequences"}  # the limits' names of this body's fields
UNSUPPORTED_FIELDS = {"container": "containers are not supported", "mcp_servers": "MCP servers are not supported",
                      "context_management": "context management is not supported",
                      "inference_geo": "there is one inference region",
                      "output_format": "structured output is not supported on /v1/messages",
                      "output_config": "output configuration is not supported on /v1/messages"}


class Metadata(BaseModel):
    model_config = FORBID
    user_id: str | None = None


class ToolDef(BaseModel):
    """A client tool: the model may call it with arguments valid against `input_schema`."""

    model_config = FORBID
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    input_schema: dict[str, Any]
    description: str | None = None
    type: str | None = None  # "custom", or omitted; Anthropic's server tools are refused by type
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None  # a required call is always constrained to its schema

    @model_validator(mode="after")
    def _client_tool(self) -> ToolDef:
        if self.type not in (None, "custom"):
            raise BadRequest(f"tools: tool type {self.type[:60]!r} (a server tool) is not supported; give client "
                             "tools (`name`, `input_schema`)", "tools.type")
        if self.input_schema.get("type", "object") != "object":
            raise BadRequest(f"tools: `{self.name}`'s input_schema must describe an object", "tools.input_schema")
        return self

    def chat_tool(self) -> dict[str, Any]:
        fn = {"name": self.name, "description": self.description, "parameters": self.input_schema}
        return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


class ToolChoiceSpec(BaseModel):
    model_config = FORBID
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(BaseModel):
    model_config = FORBID
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: str | None = None

    @property
    def on(self) -> bool:
        return self.type != "disabled"


class MessageParam(BaseModel):
    model_config = FORBID
    role: Literal["user", "assistant"]
    content: Annotated[str | list[dict[str, Any]], one_of(BLOCKS)]


class MessagesInput(BaseModel):
    """What a message request and its token count share: the model, the conversation, the tools, thinking."""

    model_config = FORBID
    model: str = Field(min_length=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: Annotated[str | list[dict[str, Any]] | None, one_of(BLOCKS)] = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoiceSpec | None = None
    thinking: Thinking | None = None
    lora_path: ClassVar[None] = None  # (services/api/answer/admission.py's Body) an adapter is named as `model`
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None
    inference_geo: Any = None
    output_format: Any = None
    output_config: Any = None

    @model_validator(mode="after")
    def _input(self) -> MessagesInput:
        for name, why in UNSUPPORTED_FIELDS.items():
            refuse_unless(getattr(self, name), (None,), name, why)
        choice = self.tool_choice
        if choice is not None and choice.type == "tool":
            if not choice.name:
                raise BadRequest("tool_choice of type `tool` names the tool (`name`)", "tool_choice.name")
            if choice.name not in {t.name for t in self.tools or []}:
                raise BadRequest(f"tool_choice names `{choice.name}`, which is not among the tools", "tool_choice.name")
        if choice is not None and choice.type == "any" and not self.tools:
            raise BadRequest("tool_choice `any` needs `tools`", "tool_choice")
        if self.thinking is not None:
            refuse_unless(self.thinking.display, (None, "summarized"), "thinking.display",
                          "thinking is shown as it is generated")
        self.chat_messages()  # every block checked now: a 400 naming it before anything is admitted
        return self

    # -- the chat request it stands for ----------------------------------------------------------------------
    def chat_messages(self) -> list[ChatMessage]:
        head = [ChatMessage(role="system", content=system_text(self.system))] if self.system else []
        out = list(head)
        for k, message in enumerate(self.messages):
            out += chat_turn(message, f"messages.{k}")
        return out

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.chat_tool() for t in self.tools] if self.tools else None

    def tool_choice_struct(self) -> ToolChoice | None:
        if not self.tools:
            return None
        choice = self.tool_choice or ToolChoiceSpec(type="auto")
        parallel = not choice.disable_parallel_tool_use
        if choice.type == "tool":
            return ToolChoice("function", choice.name, parallel)
        return ToolChoice({"any": "required"}.get(choice.type, choice.type), None, parallel)

    def template_kwargs(self) -> dict[str, Any]:
        """Hybrid reasoners' switch (Qwen3's templates read it; others ignore it): thinking only when asked, as
        Anthropic's models think only when asked."""
        return {"enable_thinking": bool(self.thinking and self.thinking.on)}

    def answer_parsing(self, model_info: dict) -> dict:
        """As chat's (services/api/answer/schemas/chat.py): reasoning where the model's tokenizer detected a
        reasoning format, tool calls when the request offers tools the model may call."""
        out: dict = {}
        if model_info.get("reasoning_parser", "none") != "none":
            out["reasoning"] = model_info["reasoning_parser"]
        elif self.thinking is not None and self.thinking.on:
            raise BadRequest(f"`thinking` is not supported by model `{self.model}` (its template does not reason)",
                             "thinking")
        if self.tools and (self.tool_choice is None or self.tool_choice.type != "none") and \
                model_info.get("tool_call_parser", "none") != "none":
            out["tools"] = model_info["tool_call_parser"]
        return out


class MessagesRequest(MessagesInput):
    """Anthropic's MessageCreateParams, what rsinfer honours of it (module doc)."""

    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP)
    stream: bool | None = False
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: Metadata | None = None
    service_tier: str | None = None
    # rsinfer's on every generating endpoint: vLLM's prefix-cache salt, and latency targets (as x-slo-* headers)
    cache_salt: CacheSalt | None = None
    slo: SloTargets | None = None

    @model_validator(mode="after")
    def _sampling(self) -> MessagesRequest:
        refuse_unless(self.service_tier, (None, "auto", "standard_only"), "service_tier", "there is one tier")
        if any(not s for s in self.stop_sequences or ()):
            raise BadRequest("stop_sequences must be non-empty strings", "stop_sequences")
        thinking = self.thinking
        if thinking is not None and thinking.type == "enabled":
            budget = thinking.budget_tokens
            if budget is None or not MIN_THINKING_BUDGET <= budget < self.max_tokens:
                raise BadRequest(f"`thinking.budget_tokens` must be at least {MIN_THINKING_BUDGET} and less than "
                                 f"max_tokens ({self.max_tokens}); got {budget}", "thinking.budget_tokens")
        return self

    def checked(self, limits: FieldLimits) -> SamplingParams:
        """The sampling parameters, once every field is within the server's limits (a 400 naming the field, as
        this body names it)."""
        values: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature,
                                  "top_p": self.top_p, "top_k": self.top_k, "stop": list(self.stop_sequences or [])}
        params = SamplingParams(**{k: v for k, v in values.items() if v is not None})
        try:
            limits.record_fields(self.metadata.user_id if self.metadata else None)
            limits.sampling(params)
        except ApiError as e:
            name = OUR_NAMES.get(e.param or "", e.param)
            raise ApiError(e.status, e.message.replace(f"`{e.param}`", f"`{name}`"), param=name,
                           code=e.code) from None
        limits.chat_fields(self.tool_dicts(), None)
        return params

    def budget(self, params: SamplingParams) -> Budget:
        return Budget(1, 1, params.max_tokens, prompts_param="messages")

    def submission(self, params: SamplingParams, stamp: Stamp) -> Submission:
        job = stamp.job(None, False, params=params, messages=self.chat_messages(), tools=self.tool_dicts(),
                        tool_choice=self.tool_choice_struct(), chat_template_kwargs=self.template_kwargs())
        parse = self.answer_parsing(stamp.model_info)
        shows = bool(self.thinking and self.thinking.on)
        fmt = MessageFormat(job.uid, self.model, int(job.created_at), parse, shows)
        user = self.metadata.user_id if self.metadata else None
        annotations = {"parse": orjson.dumps(parse).decode(), **({"user": user} if user else {})}
        return submission([job], fmt, "message", self.stream, annotations=annotations)


class CountTokensRequest(MessagesInput):
    """Anthropic's MessageCountTokensParams: the input of a message, counted as its request would tokenize it."""


# -- blocks -> chat messages ---------------------------------------------------------------------------------
def blocks_of(content: str | list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """Content as blocks, each a checked object: its type known and allowed, its keys its type's."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    out = []
    for k, block in enumerate(content):
        kind, at = block.get("type"), f"{where}.{k}"
        if kind in REFUSED_BLOCKS:
            raise BadRequest(f"{at}: `{kind}` blocks are not supported: {REFUSED_BLOCKS[kind]}", f"{at}.type")
        if kind not in BLOCK_KEYS:
            raise BadRequest(f"{at}: block type {str(kind)[:60]!r} is not supported (text, tool_use, tool_result, "
                             "thinking)", f"{at}.type")
        extra = sorted(set(block) - BLOCK_KEYS[kind] - {"type"})
        if extra:
            raise BadRequest(f"{at}.{extra[0]}: Extra inputs are not permitted", f"{at}.{extra[0]}")
        out.append(block)
    return out


def text_of(block: dict[str, Any], at: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise BadRequest(f"{at}.text: a text block's `text` is a string", f"{at}.text")
    return text


def system_text(system: str | list[dict[str, Any]]) -> str:
    blocks = blocks_of(system, "system")
    for k, block in enumerate(blocks):
        if block["type"] != "text":
            raise BadRequest(f"system.{k}: the system prompt takes text blocks only", f"system.{k}.type")
    return "\n".join(text_of(b, f"system.{k}") for k, b in enumerate(blocks))


def chat_turn(message: MessageParam, where: str) -> list[ChatMessage]:
    """One Anthropic message as chat messages: a user's tool results are tool messages (before its text, as
    Anthropic has them first); an assistant's tool uses its tool calls, its thinking its reasoning."""
    blocks = blocks_of(message.content, f"{where}.content")
    allowed = USER_BLOCKS if message.role == "user" else ASSISTANT_BLOCKS
    for k, block in enumerate(blocks):
        if block["type"] not in allowed:
            raise BadRequest(f"{where}.content.{k}: `{block['type']}` blocks are not allowed in a "
                             f"{message.role} message", f"{where}.content.{k}.type")
    texts = [text_of(b, f"{where}.content.{k}") for k, b in enumerate(blocks) if b["type"] == "text"]
    if message.role == "user":
        results = [tool_message(b, f"{where}.content.{k}") for k, b in enumerate(blocks)
                   if b["type"] == "tool_result"]
        return results + ([ChatMessage(role="user", content="\n".join(texts))] if texts or not results else [])
    calls = [tool_call(b, f"{where}.content.{k}") for k, b in enumerate(blocks) if b["type"] == "tool_use"]
    thought = "".join(str(b.get("thinking") or "") for b in blocks if b["type"] == "thinking")
    return [ChatMessage(role="assistant", content="\n".join(texts), tool_calls=calls or None,
                        reasoning_content=thought or None)]


def tool_message(block: dict[str, Any], at: str) -> ChatMessage:
    tool_use_id, content = block.get("tool_use_id"), block.get("content", "")
    if not isinstance(tool_use_id, str) or not tool_use_id:
        raise BadRequest(f"{at}.tool_use_id: a tool_result names the tool_use it answers", f"{at}.tool_use_id")
    if isinstance(content, list):
        parts = blocks_of(content, f"{at}.content")
        if any(p["type"] != "text" for p in parts):
            raise BadRequest(f"{at}.content: a tool_result's content takes text blocks only", f"{at}.content")
        content = "\n".join(text_of(p, f"{at}.content.{k}") for k, p in enumerate(parts))
    if not isinstance(content, str):
        raise BadRequest(f"{at}.content: a tool_result's content is a string or a list of text blocks",
                         f"{at}.content")
    return ChatMessage(role="tool", content=content, tool_call_id=tool_use_id)


def tool_call(block: dict[str, Any], at: str) -> dict[str, Any]:
    name, call_id, args = block.get("name"), block.get("id"), block.get("input")
    if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(args, dict):
        raise BadRequest(f"{at}: a tool_use block has a string `id` and `name` and an object `input`", at)
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
