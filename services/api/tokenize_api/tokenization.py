"""`POST /tokenize` and `POST /detokenize` in vLLM's shapes (its TokenizeCompletionRequest / TokenizeChatRequest,
DetokenizeRequest), answered by the tokenizer stage, so that API processes load no tokenizer: the body becomes a
TokenizerQuery on the model's tokenize stream, and the tokenizer answers it on the request's reply stream without
a scheduler (services/tokenizer/queries.py). It has a record, a deadline and an abort flag like any request: a
client that leaves, a deadline that passes or a shutdown aborts it, and every key it leaves expires by TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from fastapi import Request as HttpRequest
from pydantic import BaseModel, ConfigDict, Field, model_validator
from redis.exceptions import RedisError

from services.api import errors
from services.api.answer.limits import too_large
from services.api.answer.reply_hub import HubError, Inbox
from services.api.answer.request.requests import until_disconnect
from services.api.answer.schemas.chat import Message, Tool, check_continuation, generation_prompt
from services.api.answer.schemas.field_checks import BadRequest
from services.api.errors import ApiError, redis_down
from shared.messages import ReplyError, TokenizerAnswer, TokenizerQuery, decode
from shared.request_states import EndReason

if TYPE_CHECKING:
    from services.api.answer.admission import Admission
    from services.api.answer.collaborators import ApiContext

log = logging.getLogger(__name__)
Answer = TokenizerAnswer | ReplyError
OPS = ("tokenize", "detokenize")  # a query's `op`, and its record's `kind`
CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")
ANSWERED = frozenset({"ok", EndReason.REJECTED, EndReason.FAILED})  # ends that leave nothing to abort


class TokenizeRequest(BaseModel):
    """vLLM's two tokenize bodies as one: `prompt` (text, special tokens added by default) or `messages` (through
    the chat template, with its options; no special tokens added by default: the template has them)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, min_length=1)
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise BadRequest("give either `prompt` or `messages`", "prompt" if self.messages is None else "messages")
        if self.messages is None:
            for name in CHAT_ONLY:
                if getattr(self, name) not in (None, False):
                    raise BadRequest(f"`{name}` applies to `messages` only", name)
            return self
        if not self.messages:
            raise BadRequest("messages must not be empty", "messages")
        check_continuation(self.add_generation_prompt, self.continue_final_message, self.messages)
        return self

    def checked(self, ctx: ApiContext) -> None:
        s = ctx.settings
        if self.messages is not None and len(self.messages) > s.max_tokenize_messages:
            raise too_large("messages", f"{len(self.messages)} messages; at most {s.max_tokenize_messages} "
                            "(--max-tokenize-messages)")
        chars = len(self.prompt or "") + sum(len(m.content) if isinstance(m.content, str) else
                                             sum(len(p.text or "") for p in m.content or ())
                                             for m in self.messages or ())
        if chars > s.max_tokenize_chars:
            raise too_large("messages" if self.messages else "prompt", f"the text to tokenize is {chars} "
                            f"characters; at most {s.max_tokenize_chars} (--max-tokenize-chars)")
        ctx.limits.chat_fields([t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None,
                               self.chat_template_kwargs)

    def fields(self) -> dict[str, Any]:
        """What the query carries for the tokenizer."""
        if self.messages is None:
            return {"prompt": self.prompt, "add_special_tokens": self.add_special_tokens,
                    "return_token_strs": bool(self.return_token_strs)}
        generation = generation_prompt(self.add_generation_prompt, self.continue_final_message)
        return {"messages": [m.flat() for m in self.messages], "add_special_tokens": self.add_special_tokens,
                "add_generation_prompt": generation, "continue_final_message": self.continue_final_message,
                "tools": [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None,
                "chat_template_kwargs": self.chat_template_kwargs or {},
                "return_token_strs": bool(self.return_token_strs)}


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, min_length=1)
    tokens: list[int]

    def checked(self, ctx: ApiContext) -> None:
        most = ctx.settings.max_detokenize_tokens
        if len(self.tokens) > most:
            raise too_large("tokens", f"{len(self.tokens)} tokens; at most {most} (--max-detokenize-tokens)")

    def fields(self) -> dict[str, Any]:
        return {"tokens": self.tokens}


def response(op: str, answer: TokenizerAnswer) -> dict:
    if op == "detokenize":
        return {"prompt": answer.prompt or ""}
    return {"count": answer.count, "max_model_len": answer.max_model_len, "tokens": answer.tokens,
            "token_strs": answer.token_strs}


class TokenizerCall:
    """One query, from its submission to its end: its record, job and reply subscription go in one transaction;
    it ends once (`close`), aborting the query everywhere unless it was answered."""

    def __init__(self, ctx: ApiContext, query: TokenizerQuery, record: dict[str, str] | None = None):
        """`record`: what else its record says (its tenant)."""
        self.ctx, self.query, self.uid, self.record = ctx, query, query.uid, record or {}
        self.sub: Inbox | None = None
        self.queued = False
        self.status: str = EndReason.CLIENT_GONE  # why it ended, until it is answered
        self.started = time.monotonic()

    async def open(self) -> None:
        ctx, q = self.ctx, self.query
        try:
            self.sub = await ctx.requests.submit(q, {"kind": q.op, **self.record})
        except (RedisError, OSError):
            self.status = EndReason.BROKER_UNAVAILABLE
            raise
        self.queued = True
        ctx.metrics.inflight.labels(q.model).inc()

    async def answer(self) -> Answer:
        """The tokenizer's reply; ApiError 504 past the deadline, 503 when Redis is unreachable."""
        assert self.sub is not None
        try:
            async with asyncio.timeout(max(0.0, self.query.deadline - time.time())):
                _, raw = await self.sub.get()
        except TimeoutError:
            self.status = EndReason.TIMEOUT
            raise ApiError(504, "the request did not finish before its deadline", code="request_timeout") from None
        except HubError:
            self.status = EndReason.BROKER_UNAVAILABLE
            raise redis_down() from None
        try:
            return decode(raw, Answer)  # type: ignore[return-value]
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.status = EndReason.FAILED
            raise ApiError(500, f"the tokenizer's answer is unreadable: {e}", type="server_error") from None

    async def close(self, status: str | None = None) -> None:
        """Leave the hub, abort the query unless it was answered (or refused), count it; shielded."""
        status = status or self.status
        metrics = self.ctx.metrics
        with anyio.CancelScope(shield=True):
            if self.sub is not None:
                self.ctx.hub.unsubscribe(self.sub)
            if self.queued:
                metrics.inflight.labels(self.query.model).dec()
            if self.queued and status not in ANSWERED:
                log.info("uid=%s ended early: %s", self.uid, status)
                try:
                    await self.ctx.store.abort_now(self.uid, status, None)  # no scheduler holds it: no notice
                except (RedisError, OSError) as e:
                    log.warning("uid=%s could not set abort flag: %s", self.uid, e)
            metrics.requests.labels(self.query.model, self.query.op, status).inc()
            metrics.duration.labels(self.query.model).observe(time.monotonic() - self.started)


async def ask(ctx: ApiContext, http: HttpRequest, query: TokenizerQuery, record: dict[str, str] | None = None
              ) -> dict | None:
    """Submit a query and answer its client (None if it left first); `record`: what else its record says."""
    call = TokenizerCall(ctx, query, record)
    try:
        await call.open()
        log.info("uid=%s queued for %s (%s)", query.uid, query.model, query.op)
        connected, answer = await until_disconnect(http, call.answer())
        if not connected:
            return None
        if isinstance(answer, ReplyError):
            call.status = EndReason.REJECTED if 400 <= answer.status < 500 else EndReason.FAILED
            raise ApiError(answer.status, answer.message, type=answer.type, param=answer.param, code=answer.code)
        call.status = "ok"
        return response(query.op, answer)
    finally:
        await call.close()


async def query(ctx: ApiContext, admission: Admission, http: HttpRequest, body: TokenizeRequest | DetokenizeRequest,
                op: str) -> dict | None:
    """A /tokenize or /detokenize body: checked, admitted like a request of one token
    (services/api/answer/admission.py `admit_query`), then asked of the model's tokenizer stage (`ask`) within its
    tenant's quota."""
    body.checked(ctx)
    tenant = ctx.tenancy.tenant_of(http)
    async with admission.admit_query(tenant, body.model) as model:
        now = time.time()
        q = TokenizerQuery(uid=ctx.hub.new_uid(), model=model, pod=ctx.pod, created_at=now,
                           deadline=now + ctx.settings.request_timeout_s, op=op, **body.fields())
        http.scope[errors.UID] = q.uid
        return await ask(ctx, http, q, ctx.tenancy.record_fields(tenant))
