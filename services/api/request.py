"""A request this API process answers, one object from the moment it is opened to its close
(services/api/service.py answers it; `ApiRequest` is what the service needs of one):

- `Requests.open` submits a body's jobs: per job the record, the tokenize job and its inbox's registration in one
  round trip (`SingleRequest.open`); a completion's several prompts are one request each, answered as one
  (`RequestGroup`). `Requests.attach` follows a request submitted by any API process (reattach).
- `replies()` yields its reply entries in order, in batches of what arrived together: shared/reply_order.py's
  OrderedReplies delivers each choice's ranges in token order, each once, and nothing of a scheduler that was
  taken over once its successor's fence is in the stream. A reply that ends before the request finished (an
  error reply, the deadline, Redis gone) is raised as `EndedEarly`, the HTTP error, with why it ended noted in
  `end_reason`. The first batch with tokens is the request's time to first token (metrics, span).
- `close(reason)` ends it exactly once whatever happens (finish, client gone, deadline, error, server
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

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import msgspec
from fastapi import Request as HttpRequest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.api.errors import ApiError, redis_down
from services.api.formats import Counts
from services.api.metrics import Metrics
from services.api.reply_hub import HubError, Inbox, ReplyHub
from shared import queued, streams
from shared.messages import Reply, ReplyCheckpoint, ReplyError, ReplyEvent, ReplyFence, TokenizeJob, decode
from shared.redis_conn import barrier
from shared.reply_order import OrderedReplies
from shared.request_states import LEFT_RUNNING, STAGE_ENDED, TERMINAL, EndReason
from shared.request_store import RequestStore
from shared.settings import ApiSettings
from shared.tracing import NO_SPAN, Span, Tracer

if TYPE_CHECKING:
    from services.api.admission import Admitted
    from services.api.quotas import Lease

log = logging.getLogger(__name__)

Batch = list[tuple[str, ReplyEvent]]  # ordered events, each with the id of the reply entry that carried it
Writes = Callable[[Any], None]  # queues what a submission stores beside its record on the opening pipeline

UID_PREFIXES = ("chatcmpl-", "cmpl-")
TOKENLESS_KINDS = ("embedding", "score")  # prefill-only requests (services/api/prefill.py): no time to first token


def bare_uid(uid: str) -> str:
    """The request's uid from a response id (`chatcmpl-<uid>`, `cmpl-<uid>`) or the uid itself."""
    for prefix in UID_PREFIXES:
        uid = uid.removeprefix(prefix)
    return uid


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What an API process knows of a request it follows: from its job when it submits it (`of_job`), from its
    record when it attaches to one submitted anywhere (`of_record`)."""

    uid: str
    model: str
    n: int  # choices
    deadline: float  # unix s
    background: bool = False  # outlives its client

    @classmethod
    def of_job(cls, job: TokenizeJob) -> RequestInfo:
        return cls(job.uid, job.model, job.params.n, job.deadline, job.background)

    @classmethod
    def of_record(cls, uid: str, record: dict, timeout_s: float) -> RequestInfo:
        """`timeout_s` from now: the deadline of a record that names none."""
        return cls(uid, record.get("model", ""), int(record.get("n", 1)),
                   float(record.get("deadline", time.time() + timeout_s)), bool(int(record.get("background", 0))))


class ApiRequest(Protocol):
    """A request being answered: one job's (`SingleRequest`) or several prompts' as one (`RequestGroup`)."""

    uid: str
    model: str
    end_reason: str  # why it ended early, if it ends before its replies finished

    @property
    def counts(self) -> Counts: ...  # its usage so far (services/api/formats.py takes it)

    @property
    def done(self) -> bool: ...

    def replies(self, idle_s: float | None = None) -> AsyncIterator[Batch]: ...

    def hold(self, lease: Lease | None) -> None: ...

    async def close(self, reason: str | None = None) -> None: ...


class EndedEarly(ApiError):
    """The replies ended before the request finished: the HTTP error for its client, and the end `reason`."""

    def __init__(self, reason: str, error: ApiError):
        super().__init__(error.status, error.message, param=error.param, code=error.code, type=error.type,
                         retry_after=error.retry_after)
        self.reason = reason


class StageFailed(Exception):
    """A stage sent an error reply for this request."""

    def __init__(self, error: ReplyError):
        super().__init__(error.message)
        self.error = error


class DeadlineExceeded(Exception):
    pass


def ended_early(e: StageFailed | DeadlineExceeded | HubError) -> EndedEarly:
    if isinstance(e, StageFailed):
        # A stage's deadline error is the same end as our own deadline; other errors the stage already ended.
        err = e.error
        reason = (EndReason.TIMEOUT if err.code == "request_timeout" else
                  EndReason.REJECTED if 400 <= err.status < 500 else EndReason.FAILED)
        return EndedEarly(reason, ApiError(err.status, err.message, type=err.type, param=err.param, code=err.code))
    if isinstance(e, DeadlineExceeded):
        return EndedEarly(EndReason.TIMEOUT, ApiError(504, "the request did not finish before its deadline",
                                                      code="request_timeout"))
    return EndedEarly(EndReason.BROKER_UNAVAILABLE, redis_down())


async def until_disconnect(request: HttpRequest, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Run `work` unless the client goes away first: (True, result) or (False, None)."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher, task = asyncio.ensure_future(watch()), asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        gone = not task.done()
        if gone:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return (False, None) if gone else (True, task.result())


async def leased(opening: Awaitable[ApiRequest], lease: Lease | None) -> ApiRequest:
    """The opened request, holding `lease` (its tenant's quota, services/api/quotas.py) until it ends; the
    lease released if it does not open."""
    try:
        req = await opening
    except BaseException:
        if lease is not None:
            await lease.release()
        raise
    req.hold(lease)
    return req


class Requests:
    """What the requests of this process share (Redis, the reply hub, metrics, traces), and the ones it submitted
    that are still open (`inflight`: a drain waits for them)."""

    def __init__(self, settings: ApiSettings, store: RequestStore, hub: ReplyHub, pod: str, *, tracer: Tracer,
                 metrics: Metrics):
        self.settings, self.store, self.hub, self.pod = settings, store, hub, pod
        self.redis: Redis = store.redis
        self.keys = store.keys
        self.tracer, self.metrics = tracer, metrics
        self.inflight: dict[str, SingleRequest] = {}
        self.idle = asyncio.Event()  # set while `inflight` is empty
        self.idle.set()
        self.awaiting_reattach: dict[asyncio.Task, str] = {}  # delayed aborts -> uid

    async def open(self, admitted: Admitted, label: str | None = None) -> ApiRequest:
        """Submit an admitted body's jobs (services/api/admission.py); `label` names how it is answered in the
        metrics (stream, full, generate; by default the submission's). The request holds its tenant's lease."""
        sub = admitted.submission
        opening = self.open_jobs(sub.jobs, sub.record, sub.stream, label or sub.label, writes=sub.writes)
        try:
            return await leased(opening, admitted.lease)
        except BaseException:  # not opened: its jobs leave the model's queue count now, not at their deadline
            with anyio.CancelScope(shield=True), contextlib.suppress(RedisError, OSError):
                await queued.leave(self.redis, self.keys, sub.jobs[0].model, [j.uid for j in sub.jobs])
            raise

    async def open_jobs(self, jobs: list[TokenizeJob], record: dict, stream: bool, label: str, *,
                        writes: Writes | None = None) -> ApiRequest:
        """`writes`: what the submission stores beside its record, with its first job (`SingleRequest.open`)."""
        if len(jobs) == 1:
            return await SingleRequest.open(self, jobs[0], record, stream, label, writes=writes)
        return await RequestGroup.open(self, jobs, record, stream, label, writes=writes)

    async def attach(self, uid: str, record: dict, last_event_id: str | None) -> SingleRequest:
        return await SingleRequest.attach(self, uid, record, last_event_id)

    def opened(self, req: SingleRequest) -> None:
        self.inflight[req.uid] = req
        self.idle.clear()

    def ended(self, uid: str) -> None:
        self.inflight.pop(uid, None)
        if not self.inflight:
            self.idle.set()

    async def drained(self) -> None:
        """Return once none of the requests this process submitted is open."""
        await self.idle.wait()

    def abort_unless_reattached(self, uid: str, delay: float) -> None:
        task = asyncio.create_task(self._abort_unless_reattached(uid, delay))
        self.awaiting_reattach[task] = uid
        task.add_done_callback(self.awaiting_reattach.pop)

    async def _abort_unless_reattached(self, uid: str, delay: float) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(delay)
        attached, status, model = (await self.store.fields([uid], "attached", "status", "model"))[uid]
        if int(attached or 0) > 0 or status is None or status in TERMINAL:
            return
        log.info("uid=%s ended early: %s (no client reattached)", uid, EndReason.CLIENT_GONE)
        await self.store.abort_now(uid, EndReason.CLIENT_GONE, model)

    async def close(self) -> None:
        """Shutdown: every open request ends (`EndReason.SERVER_SHUTDOWN`), and those waiting for a reattach are
        decided now (nobody here will wait any longer)."""
        for req in list(self.inflight.values()):
            await req.close(EndReason.SERVER_SHUTDOWN)
        tasks = list(self.awaiting_reattach)
        for task in tasks:
            task.cancel()  # ends the wait, not the check
        for task in tasks:
            with contextlib.suppress(RedisError, OSError, asyncio.CancelledError):
                await task


class SingleRequest:
    """One job's request: its inbox of reply entries and their order, its deadline, its accounting and its end."""

    def __init__(self, ctx: Requests, info: RequestInfo, *, resume_window: float = 0.0, label: str = "",
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

    @property
    def counts(self) -> OrderedReplies:
        return self.order

    @property
    def done(self) -> bool:
        return self.order.done

    def hold(self, lease: Lease | None) -> None:
        """Hold `lease` (its tenant's quota) until this request ends: at its close if it finished, else once its
        record says it ended (services/api/quotas.py)."""
        self.lease = lease
        if lease is not None:
            lease.follow((self.uid,), self.counts)

    # -- open or attach ---------------------------------------------------------------------------------
    @classmethod
    async def open(cls, ctx: Requests, job: TokenizeJob, record: dict, stream: bool, label: str, *,
                   writes: Writes | None = None) -> SingleRequest:
        """Subscribe to the reply stream, write the record (and `writes`, what the submission stores beside it)
        and the job and wake the reply reader, all in one round trip; its trace (if tracing) starts here.
        Nothing is left behind if Redis fails."""
        span = ctx.tracer.start("request", root=True, uid=job.uid, model=job.model, kind=record.get("kind", ""),
                                stream=stream)
        if span.traceparent:
            job = msgspec.structs.replace(job, trace=span.traceparent)
        info, sub = RequestInfo.of_job(job), None
        try:
            # A transaction (on a standalone Redis; a cluster's pipeline stops at the barrier when what precedes
            # it failed): a Redis at its maxmemory refuses all of it or none, never a job without its record.
            async with ctx.redis.pipeline(transaction=True) as pipe:
                ctx.store.create(pipe, job.uid, job.deadline, model=job.model, pod=ctx.pod,
                                 created_at=f"{job.created_at:.3f}", background=int(job.background), attached=1,
                                 **record)
                if writes is not None:
                    writes(pipe)
                barrier(pipe)  # the record exists before a tokenizer can read the job (on a cluster too)
                streams.add(pipe, ctx.keys.tokenize(job.model), job)
                sub = ctx.hub.register(Inbox(job.uid, ctx.keys.reply(job.uid)), wake_in=pipe)
                await pipe.execute()
        except BaseException as e:
            if sub is not None:
                ctx.hub.unsubscribe(sub)
            span.end(error=repr(e))
            raise
        req = cls(ctx, info, label=label, span=span, resume_window=ctx.settings.resume_window_s if stream else 0.0,
                  sub=sub)
        req.times_first_token = record.get("kind") not in TOKENLESS_KINDS
        ctx.opened(req)
        ctx.metrics.inflight.labels(job.model).inc()
        log.info("uid=%s queued for %s", job.uid, job.model)
        return req

    @classmethod
    async def attach(cls, ctx: Requests, uid: str, record: dict, last_event_id: str | None) -> SingleRequest:
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
                yield batch
        except (StageFailed, DeadlineExceeded, HubError) as e:
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
        the deadline passed."""
        remaining = self.deadline - time.time()
        if remaining <= 0:
            raise DeadlineExceeded()
        wait = remaining if idle_s is None else min(remaining, idle_s)
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation that lands
        # as an entry arrives, and a request whose client left would then never be aborted.
        try:
            async with asyncio.timeout(wait):
                first = await self.sub.get()
        except TimeoutError:
            if wait < remaining:
                return None
            raise DeadlineExceeded() from None
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


class GroupCounts:
    """The usage of a whole group."""

    def __init__(self, members: list[SingleRequest]):
        self.members = members

    @property
    def prompt_tokens(self) -> int:
        return sum(m.order.prompt_tokens for m in self.members)

    @property
    def completion_tokens(self) -> int:
        return sum(m.order.completion_tokens for m in self.members)

    @property
    def cached_tokens(self) -> int:
        return sum(m.order.cached_tokens for m in self.members)


class RequestGroup:
    """A completion with a list of prompts: one request per prompt through the pipeline (each with its own uid,
    record and reply stream), answered as one. Choice `i` of prompt `k` is choice `k * per + i` of the response,
    as OpenAI numbers them; its first prompt's trace stands for the group's first token."""

    def __init__(self, members: list[SingleRequest], per: int):
        self.members, self.per = members, per
        self.counts = GroupCounts(members)
        self.uid, self.model = members[0].uid, members[0].model
        self.times_first_token = members[0].times_first_token
        self.lease: Lease | None = None
        for m in members:
            m.times_first_token = False

    def hold(self, lease: Lease | None) -> None:
        self.lease = lease
        if lease is not None:
            lease.follow(tuple(m.uid for m in self.members), self.counts)

    @classmethod
    async def open(cls, ctx: Requests, jobs: list[TokenizeJob], record: dict, stream: bool, label: str, *,
                   writes: Writes | None = None) -> RequestGroup:
        """Open every job (`writes` with the first); if one cannot be opened, those already open are ended
        (`EndReason.REJECTED`)."""
        members: list[SingleRequest] = []
        try:
            for job in jobs:
                members.append(await SingleRequest.open(ctx, job, record, stream, label,
                                                        writes=None if members else writes))
        except BaseException:
            for m in members:
                await m.close(EndReason.REJECTED)
            raise
        return cls(members, jobs[0].params.n)

    @property
    def done(self) -> bool:
        return all(m.done for m in self.members)

    @property
    def end_reason(self) -> str:
        return self.members[0].end_reason

    @end_reason.setter
    def end_reason(self, reason: str) -> None:
        for m in self.members:
            m.end_reason = reason

    async def replies(self, idle_s: float | None = None) -> AsyncIterator[Batch]:
        first = self.members[0]
        try:
            async for batch in merged([m.replies(idle_s) for m in self.members], self.per):
                if batch and first.first_token_at is None and self.times_first_token:
                    first.first_token()
                yield batch
        except EndedEarly as e:
            self.end_reason = e.reason  # the first prompt to end early ends them all
            raise

    async def close(self, reason: str | None = None) -> None:
        try:
            for m in self.members:
                await m.close(reason)
        finally:
            if self.lease is not None:
                await self.lease.end(self.done)


async def merged(sources: list[AsyncIterator[Batch]], per: int) -> AsyncIterator[Batch]:
    """Batches of every source as they come, choice indices shifted by the source's place; the first error of
    any source ends it (the others are cancelled)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, source: AsyncIterator[Batch]) -> None:
        try:
            async for batch in source:
                shifted = [(eid, msgspec.structs.replace(ev, index=ev.index + k * per)) for eid, ev in batch]
                await queue.put((shifted, None))
        except Exception as e:  # EndedEarly: the caller maps it
            await queue.put((None, e))
            return
        await queue.put((None, None))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(sources)]
    try:
        live = len(tasks)
        while live:
            batch, error = await queue.get()
            if error is not None:
                raise error
            if batch is None:
                live -= 1
                continue
            yield batch
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
