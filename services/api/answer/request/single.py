"""One job's request (`SingleRequest`): its inbox of reply entries and their order, its deadline, its accounting,
and its end. `close(reason)` ends it exactly once whatever happens (finish, client gone, deadline, error, server
shutdown), shielded from the caller's cancellation: it leaves the hub, is counted (metrics, span) on the
process that submitted it, and unless it finished decides whether to abort it everywhere (`_leave`):

- a stage already ended it (an error reply): nothing to do;
- a `background` request is never aborted by its client going away, only by DELETE, an operator's abort
  key, its deadline (which every stage enforces) or an error;
- a stream whose client disconnected is aborted only if no client has reattached (from any API process,
  counted in the record's `attached` field) within `resume_window_s`; 0 aborts at once;
- anything else (a non-stream client gone, a deadline, a slow client, shutdown) is aborted at once.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio
import msgspec
from redis.exceptions import RedisError

from services.api.answer.reply_hub import HubError, Inbox
from services.api.answer.request.api_request import Batch, RequestInfo, Writes, bare_uid
from services.api.answer.request.context import RequestContext
from services.api.answer.request.early_end import DeadlineExceeded, SloMissed, StageFailed, ended_early
from services.api.answer.slo import slo_met
from services.api.errors import ApiError
from shared import streams
from shared.messages import Reply, ReplyCheckpoint, ReplyError, ReplyEvent, ReplyFence, TokenizeJob, decode
from shared.reply_order import OrderedReplies
from shared.request_states import LEFT_RUNNING, STAGE_ENDED, EndReason
from shared.tracing import NO_SPAN, Span

if TYPE_CHECKING:
    from services.api.multitenancy.quotas import Lease

log = logging.getLogger(__name__)

TOKENLESS_KINDS = ("embedding", "score")  # prefill-only requests (services/api/pooling_api/prefill.py): no time to
# first token


class SingleRequest:
    """One job's request: its inbox of reply entries and their order, its deadline, its accounting and its end."""

    def __init__(self, ctx: RequestContext, info: RequestInfo, *, resume_window: float = 0.0, label: str = "",
                 span: Span = NO_SPAN, sub: Inbox | None = None):
        """`sub`: its inbox, if registered with the hub already (`open`, `attach`); else registered here."""
        self.ctx, self.uid, self.deadline, self.model = ctx, info.uid, info.deadline, info.model
        self.owner = True  # the process that submitted it (metrics, in-flight count, drain); `attach` is not
        self.resume_window = resume_window  # seconds a disconnected stream waits for a reattach
        self.background, self.label, self.span = info.background, label, span
        self.order = OrderedReplies(info.n)
        self.sub: Inbox = sub if sub is not None else ctx.hub.register(Inbox(info.uid, ctx.keys.reply(info.uid)))
        self.lease: Lease | None = None  # its tenant's quota (`hold`)
        self.closed = False
        self.end_reason: str = EndReason.CLIENT_GONE
        self.started = time.monotonic()
        self.first_token_at: float | None = None
        self.times_first_token = True  # a group's members leave it to the group
        # Its TTFT target (services/api/answer/slo.py): no reply by then (unix s) ends it (`SloMissed`), not served
        # late; infinite without a target, and once its first reply came.
        self.slo = (info.slo_ttft_ms, info.slo_tpot_ms)
        self.slo_due = (info.created_at + info.slo_ttft_ms / 1000 + ctx.settings.slo_tolerance_ms / 1000
                        if info.slo_ttft_ms else math.inf)

    @property
    def counts(self) -> OrderedReplies:
        return self.order

    @property
    def done(self) -> bool:
        return self.order.done

    def hold(self, lease: Lease | None) -> None:
        """Hold `lease` (its tenant's quota) until this request ends: at its close if it finished, else once its
        record says it ended (services/api/multitenancy/quotas.py)."""
        self.lease = lease
        if lease is not None:
            lease.follow((self.uid,), self.counts)

    # -- open or attach ---------------------------------------------------------------------------------
    @classmethod
    async def open(cls, ctx: RequestContext, job: TokenizeJob, record: dict, stream: bool, label: str, *,
                   writes: Writes | None = None) -> SingleRequest:
        """Subscribe to the reply stream, write the record (and `writes`, what the submission stores beside it)
        and the job and wake the reply reader, all in one round trip; its trace (if tracing) starts here.
        Nothing is left behind if Redis fails."""
        span = ctx.tracer.start("request", root=True, uid=job.uid, model=job.model, kind=record.get("kind", ""),
                                stream=stream)
        if span.traceparent:
            job = msgspec.structs.replace(job, trace=span.traceparent)
        try:
            sub = await ctx.submit(job, {"background": int(job.background), "attached": 1, **record}, writes)
        except BaseException as e:
            span.end(error=repr(e))
            raise
        resume_window = ctx.settings.resume_window_s if stream else 0.0
        req = cls(ctx, RequestInfo.of_job(job), label=label, span=span, resume_window=resume_window, sub=sub)
        req.times_first_token = record.get("kind") not in TOKENLESS_KINDS
        ctx.opened(req)
        ctx.metrics.inflight.labels(job.model).inc()
        log.info("uid=%s queued for %s", job.uid, job.model)
        return req

    @classmethod
    async def attach(cls, ctx: RequestContext, uid: str, record: dict, last_event_id: str | None) -> SingleRequest:
        """Follow an existing request's reply stream (resumable streams), given its record. It counts as a
        client of the request: one that leaves is treated like the submitter's stream leaving (resume window).
        A 410 if the stream was trimmed past what the client has; else, if its head was trimmed, the reply
        is read headless (shared/reply_order.py)."""
        bare = bare_uid(uid)
        kept_from = await streams.trimmed_head(ctx.redis, ctx.keys.reply(bare))
        if kept_from is not None and (last_event_id is None or streams.id_after(kept_from, last_event_id)):
            raise ApiError(410, f"the reply stream of `{uid}` was trimmed past {last_event_id or 'its start'} (it "
                           f"keeps the last --reply-maxlen entries); what came before {kept_from} is gone",
                           param="Last-Event-ID", code="reply_trimmed")
        info, sub = RequestInfo.of_record(bare, record, ctx.settings.request_timeout_s), None
        try:
            async with ctx.redis.pipeline(transaction=False) as pipe:
                ctx.store.attach(pipe, bare, +1)
                sub = ctx.hub.register(Inbox(bare, ctx.keys.reply(bare)), wake_in=pipe)
                await pipe.execute()
        except BaseException:
            if sub is not None:
                ctx.hub.unsubscribe(sub)
            raise
        req = cls(ctx, info, resume_window=ctx.settings.resume_window_s, label="reattach", sub=sub)
        req.owner = False
        if kept_from is not None:
            req.order.start_headless()
        else:
            req.order.head_unsure = True  # MAXLEN may still trim it before the hub's first read (`_ordered`)
        return req

    # -- its replies ------------------------------------------------------------------------------------
    async def replies(self, idle_s: float | None = None) -> AsyncIterator[Batch]:
        """Every batch of ordered events until each choice finished. With `idle_s`, an empty batch whenever
        nothing arrived for that long (the caller may start its response). Raises EndedEarly."""
        try:
            async for batch in self._ordered(idle_s):
                if batch and self.first_token_at is None and self.times_first_token:
                    self.first_token()
                if batch and self.slo_due != math.inf:
                    self.slo_due = math.inf
                yield batch
        except (StageFailed, DeadlineExceeded, SloMissed, HubError) as e:
            error = ended_early(e)
            self.end_reason = error.reason
            raise error from None

    async def _ordered(self, idle_s: float | None) -> AsyncIterator[Batch]:
        """What `replies` yields, before its accounting: each read's events in order, an empty batch when idle."""
        while not self.order.done:
            entries = await self._next_entries(idle_s)
            if entries is None:
                yield []
                continue
            batch: Batch = []
            for entry_id, raw in entries:
                msg = self._decoded(entry_id, raw)
                if isinstance(msg, ReplyError):
                    if batch:
                        yield batch
                    raise StageFailed(msg)
                if msg is not None:
                    batch.extend(await self._accepted(entry_id, msg))
            if batch:
                yield batch

    async def _next_entries(self, idle_s: float | None) -> list[tuple[str, bytes]] | None:
        """The reply entries that arrived, once one did; None after `idle_s` without any. DeadlineExceeded once
        the deadline passed, SloMissed once its TTFT target did with no reply."""
        now = time.time()
        remaining, slo_left = self.deadline - now, self.slo_due - now
        if remaining <= 0:
            raise DeadlineExceeded()
        if slo_left <= 0:
            raise SloMissed()
        wait = min(remaining, slo_left, math.inf if idle_s is None else idle_s)
        # The inbox's own timer, not asyncio.timeout (one timer handle per entry) nor wait_for (on Python 3.11
        # it can swallow a cancellation that lands as an entry arrives, and a request whose client left would
        # then never be aborted).
        first = await self.sub.get(wait)
        if first is None:
            if wait == slo_left:
                raise SloMissed()
            if wait < remaining:
                return None
            raise DeadlineExceeded()
        return [first, *self.sub.drain()]

    def _decoded(self, entry_id: str, raw: bytes) -> Reply | None:
        try:
            return decode(raw, Reply)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.error("uid=%s unreadable reply entry %s: %s", self.uid, entry_id, e)
            return None

    async def _accepted(self, entry_id: str, msg: Reply) -> Batch:
        """The events a reply entry (not an error) lets through in order, with its id: a fence refuses what an
        older epoch sends after it, a checkpoint is for a resuming scheduler."""
        order = self.order
        if isinstance(msg, ReplyFence):
            order.fence(msg.epoch)
            return []
        if isinstance(msg, ReplyCheckpoint):
            return []
        if order.head_unsure and await self._head_trimmed_since(msg):
            order.start_headless()
        return [(entry_id, ev) for ev in order.accept(msg)]

    async def _head_trimmed_since(self, ev: ReplyEvent) -> bool:
        """A reattach found the stream whole (`attach`), but MAXLEN may trim its head before the first read: then
        a choice's first range starts past 0. Only that (or a range redone out of order) explains such a first
        range, so ask Redis once, then."""
        order = self.order
        if not 0 <= ev.index < len(order.next) or order.next[ev.index] or ev.start == 0:
            return False
        order.head_unsure = False
        try:
            return await streams.trimmed_head(self.ctx.redis, self.sub.key) is not None
        except (RedisError, OSError):
            return False  # read on as a whole stream; a Redis outage shows in the next read

    def first_token(self) -> None:
        self.first_token_at = time.monotonic()
        self.span.event("first_token")
        self.ctx.metrics.ttft.labels(self.model).observe(self.first_token_at - self.started)

    # -- its end ----------------------------------------------------------------------------------------
    async def close(self, reason: str | None = None) -> None:
        """Idempotent; `reason` overrides the end reason noted so far. Shielded, so it completes even while the
        caller is being cancelled; counted after."""
        if self.closed:
            return
        self.closed = True
        if reason:
            self.end_reason = reason
        with anyio.CancelScope(shield=True):
            self.ctx.hub.unsubscribe(self.sub)
            if self.owner:
                self.ctx.ended(self.uid)
            if not self.done:
                try:
                    await self._leave()
                except (RedisError, OSError) as e:
                    log.warning("uid=%s could not set abort flag: %s", self.uid, e)
        try:
            if self.owner:
                self._count()
        finally:
            if self.lease is not None:
                await self.lease.end(self.done)

    async def _leave(self) -> None:
        """A client stopped following this unfinished request: abort it now, later, or never (module doc)."""
        ctx, uid, reason = self.ctx, self.uid, self.end_reason
        if reason in STAGE_ENDED:
            return
        if self.background and reason in LEFT_RUNNING:
            log.info("uid=%s left running in the background (%s)", uid, reason)
            return
        if reason == EndReason.CLIENT_GONE and self.resume_window > 0:
            await ctx.store.attach(ctx.redis, uid, -1)
            ctx.abort_unless_reattached(uid, self.resume_window)
            log.info("uid=%s client left; aborting unless a client reattaches within %.1fs", uid,
                     self.resume_window)
            return
        if not self.owner:
            return  # a follower's deadline or shutdown: the submitter's process or the stages decide
        log.info("uid=%s ended early: %s", uid, reason)
        await ctx.store.abort_now(uid, reason, self.model)

    def _count(self) -> None:
        metrics, model, order = self.ctx.metrics, self.model, self.order
        status = "ok" if self.done else self.end_reason
        self.span.set(status=status, completion_tokens=order.completion_tokens)
        self.span.end(error=None if self.done else status)  # after the last byte was sent
        metrics.inflight.labels(model).dec()
        metrics.requests.labels(model, self.label, status).inc()
        metrics.duration.labels(model).observe(time.monotonic() - self.started)
        metrics.prompt_tokens.labels(model).inc(order.prompt_tokens)
        metrics.generated_tokens.labels(model).inc(order.completion_tokens)
        if self.first_token_at is not None and self.done:
            metrics.served(model, time.monotonic() - self.first_token_at)
        if any(self.slo) and self.times_first_token:
            met = self.done and slo_met(self.slo, self.started, self.first_token_at, order.completion_tokens)
            metrics.slo.labels(model, "met" if met else "missed").inc()
