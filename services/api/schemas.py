"""Request bodies at the HTTP edge (pydantic), and their translation into SamplingParams.

Fields follow OpenAI's CreateChatCompletionRequest / CreateCompletionRequest, plus the extensions vLLM
and SGLang accept (top_k, min_p, ignore_eos, repetition_penalty, min_tokens, stop_token_ids,
skip_special_tokens) and `timeout` (seconds, capped by the server's --request-timeout-s). Unknown fields
are ignored, as OpenAI does; fields we cannot honour are refused with a 400 rather than ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.messages import ChatMessage, SamplingParams

MAX_N = 16
MAX_STOP = 16


class BadRequest(ValueError):
    """A request that is well-formed JSON but cannot be served as asked (-> 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool | None = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def flat(self) -> ChatMessage:
        content = self.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise BadRequest("only text content parts are supported", "messages")
            content = "".join(p.text or "" for p in content)
        role = "system" if self.role == "developer" else self.role
        return ChatMessage(role=role, content=content or "", name=self.name)


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
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

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return v

    def sampling(self, max_tokens: int | None, logprobs: bool, top_logprobs: int) -> SamplingParams:
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported", "logit_bias")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        values: dict[str, Any] = dict(
            max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, n=self.n, logprobs=logprobs,
            top_logprobs=top_logprobs, skip_special_tokens=self.skip_special_tokens)
        return SamplingParams(**{k: v for k, v in values.items() if v is not None})

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.tools:
            raise BadRequest("tools are not supported", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise BadRequest("only response_format type 'text' is supported", "response_format")
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs requires logprobs to be true", "top_logprobs")
        return self

    def params(self) -> SamplingParams:
        return self.sampling(self.max_completion_tokens or self.max_tokens, bool(self.logprobs),
                             self.top_logprobs or 0)

    def chat_messages(self) -> list[ChatMessage]:
        return [m.flat() for m in self.messages]


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.echo:
            raise BadRequest("echo is not supported", "echo")
        if self.suffix:
            raise BadRequest("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise BadRequest("best_of other than n is not supported", "best_of")
        return self

    def single_prompt(self) -> tuple[str | None, list[int] | None]:
        """The one prompt of this request, as text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return p, None
        if p and all(isinstance(x, int) for x in p):
            return None, list(p)  # type: ignore[arg-type]
        if len(p) == 1:
            return (p[0], None) if isinstance(p[0], str) else (None, list(p[0]))  # type: ignore[arg-type]
        if not p:
            raise BadRequest("prompt must not be empty", "prompt")
        raise BadRequest("one prompt per request is supported; send a list of prompts as separate requests",
                         "prompt")

    def params(self) -> SamplingParams:
        lp = self.logprobs
        return self.sampling(self.max_tokens, lp is not None, lp or 0)


class GenerateRequest(BaseModel):
    """SGLang-style native request: text or input_ids, sampling_params, stream."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise BadRequest("give exactly one of text and input_ids", "text")
        return self

    def params(self) -> SamplingParams:
        sp = dict(self.sampling_params)
        if "max_new_tokens" in sp:
            sp["max_tokens"] = sp.pop("max_new_tokens")
        sp.setdefault("max_tokens", 128)
        try:
            fields = SamplingFields(model="native", **sp)
        except ValueError as e:
            raise BadRequest(f"bad sampling_params: {e}", "sampling_params") from e
        return fields.sampling(fields.max_tokens, False, 0)
