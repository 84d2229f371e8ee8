"""Step 1 of a request's path (services/api/service.py `ApiService.answer`): submitting requests, or
following one submitted elsewhere (`Gateway.attach`, reattach), and owning them until they end.

`Gateway.open` writes the request record and the tokenize job in one round trip and subscribes to the
reply stream first (so no entry is missed). The returned `Inflight` is closed exactly once whatever
happens (finish, client gone, deadline, error, server shutdown): it leaves the hub, and unless the
request ended it decides whether to abort it everywhere (`Gateway.left`):

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

import anyio
from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.api.errors import ApiError
from services.api.flow import ordered_entries, ordered_events
from services.api.replies import ReplyHub, Subscription
from shared import records, streams
from shared.keys import Keys
from shared.messages import TokenizeJob
from shared.redis_conn import barrier
from shared.replies import OrderedReplies
from shared.settings import ApiSettings
from shared.tracing import NO_SPAN

log = logging.getLogger(__name__)

CLIENT_GONE = "client_disconnected"
STAGE_ENDED = ("rejected", "failed")  # end reasons of requests a stage already ended with an error
LEFT_RUNNING = (CLIENT_GONE, "slow_client", "server_shutdown", "broker_unavailable")  # kept by background
UID_PREFIXES = ("chatcmpl-", "cmpl-")


def bare_uid(uid: str) -> str:
    """The request's uid from a response id (`chatcmpl-<uid>`, `cmpl-<uid>`) or the uid itself."""
    for prefix in UID_PREFIXES:
        uid = uid.removeprefix(prefix)
    return uid


class Inflight:
    def __init__(self, gateway: Gateway, uid: str, sub: Subscription, n: int, deadline: float, model: str,
                 owner: bool = True, resume_window: float = 0.0, background: bool = False):
        self.gateway, self.uid, self.sub, self.deadline, self.model = gateway, uid, sub, deadline, model
        self.owner = owner  # the process that submitted it (metrics, in-flight count, drain)
        self.resume_window = resume_window  # seconds a disconnected stream waits for a reattach
        self.background = background
        self.order = OrderedReplies(n)
        self.closed = False
        self.end_reason = CLIENT_GONE  # why it ended early, if it ends before the reply finished
        self.started = time.monotonic()
        self.first_token_at: float | None = None
        self.span = NO_SPAN  # the request's root span, when tracing

    def events(self):
        return ordered_events(self.sub, self.order, self.deadline)

    def entries(self, idle_s: float | None = None):
        return ordered_entries(self.sub, self.order, self.deadline, idle_s)

    @property
    def done(self) -> bool:
        return self.order.done

    @property
    def flights(self) -> tuple[Inflight]:
        """The requests it answers: itself (services/api/fanout.py FlightGroup has several)."""
        return (self,)

    async def close(self) -> None:
        """Idempotent; shielded so it completes even while the caller is being cancelled."""
        if self.closed:
            return
        self.closed = True
        with anyio.CancelScope(shield=True):
            self.gateway.hub.unsubscribe(self.sub)
            if self.owner:
                self.gateway.inflight.pop(self.uid, None)
            if not self.done:
                try:
                    await self.gateway.left(self)
                except (RedisError, OSError) as e:
                    log.warning("uid=%s could not set abort flag: %s", self.uid, e)


class Gateway:
    def __init__(self, settings: ApiSettings, redis: Redis, hub: ReplyHub, keys: Keys, pod: str):
        self.settings, self.redis, self.hub, self.keys, self.pod = settings, redis, hub, keys, pod
        self.inflight: dict[str, Inflight] = {}
        self.awaiting_reattach: dict[asyncio.Task, str] = {}  # delayed aborts -> uid

    def deadline(self, timeout: float | None) -> float:
        limit = self.settings.request_timeout_s
        return time.time() + (min(timeout, limit) if timeout else limit)

    async def open(self, job: TokenizeJob, record: dict, stream: bool) -> Inflight:
        """Subscribe to the reply stream, write the record and the job and wake the reply reader, all in
        one round trip; the caller must close() the result. Nothing is left behind if Redis fails."""
        sub = self.hub.register(job.uid)
        try:
            # A transaction (on a standalone Redis; a cluster's pipeline stops at the barrier when what precedes
            # it failed): a Redis at its maxmemory refuses all of it or none, never a job without its record.
            async with self.redis.pipeline(transaction=True) as pipe:
                records.set_status(pipe, self.keys, job.uid, self.settings.request_ttl_s, "queued",
                                   model=job.model, pod=self.pod, created_at=f"{job.created_at:.3f}",
                                   deadline=f"{job.deadline:.3f}", background=int(job.background),
                                   attached=1, **record)
                barrier(pipe)  # the record exists before a tokenizer can read the job (on a cluster too)
                streams.add(pipe, self.keys.tokenize(job.model), job)
                sub.shard.wake_in(pipe)
                await pipe.execute()
        except BaseException:
            self.hub.unsubscribe(sub)
            raise
        window = self.settings.resume_window_s if stream else 0.0
        flight = self.inflight[job.uid] = Inflight(self, job.uid, sub, job.params.n, job.deadline, job.model,
                                                   resume_window=window, background=job.background)
        log.info("uid=%s queued for %s", job.uid, job.model)
        return flight

    async def attach(self, uid: str, record: dict, last_event_id: str | None) -> Inflight:
        """Follow an existing request's reply stream (resumable streams), given its record. It counts as a
        client of the request: one that leaves is treated like the submitter's stream leaving (resume window).
        A 410 if the stream was trimmed past what the client has; else, if its head was trimmed, the reply
        is read headless (shared/replies.py)."""
        bare = bare_uid(uid)
        kept_from = await streams.trimmed_head(self.redis, self.keys.reply(bare))
        if kept_from is not None and (last_event_id is None or streams.id_after(kept_from, last_event_id)):
            raise ApiError(410, f"the reply stream of `{uid}` was trimmed past {last_event_id or 'its start'} (it "
                           f"keeps the last --reply-maxlen entries); what came before {kept_from} is gone",
                           param="Last-Event-ID", code="reply_trimmed")
        deadline = float(record.get("deadline", time.time() + self.settings.request_timeout_s))
        sub = self.hub.register(bare)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                records.attach(pipe, self.keys, bare, +1)
                sub.shard.wake_in(pipe)
                await pipe.execute()
        except BaseException:
            self.hub.unsubscribe(sub)
            raise
        flight = Inflight(self, bare, sub, int(record.get("n", 1)), deadline, record.get("model", ""), owner=False,
                          resume_window=self.settings.resume_window_s,
                          background=bool(int(record.get("background", 0))))
        if kept_from is not None:
            flight.order.start_headless()
        else:
            flight.order.head_unsure = True  # MAXLEN may still trim it before the hub's first read (flow.py)
        return flight

    async def left(self, flight: Inflight) -> None:
        """A client stopped following an unfinished request: abort it now, later, or never (module doc)."""
        uid, reason = flight.uid, flight.end_reason
        if reason in STAGE_ENDED:
            return
        if flight.background and reason in LEFT_RUNNING:
            log.info("uid=%s left running in the background (%s)", uid, reason)
            return
        if reason == CLIENT_GONE and flight.resume_window > 0:
            await records.attach(self.redis, self.keys, uid, -1)
            task = asyncio.create_task(self._abort_unless_reattached(uid, flight.resume_window))
            self.awaiting_reattach[task] = uid
            task.add_done_callback(self.awaiting_reattach.pop)
            log.info("uid=%s client left; aborting unless a client reattaches within %.1fs", uid,
                     flight.resume_window)
            return
        if not flight.owner:
            return  # a follower's deadline or shutdown: the submitter's process or the stages decide
        log.info("uid=%s ended early: %s", uid, reason)
        await records.abort_now(self.redis, self.keys, uid, reason, self.settings.request_ttl_s, flight.model)

    async def _abort_unless_reattached(self, uid: str, delay: float) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(delay)
        attached, status, model = await self.redis.hmget(self.keys.request(uid), ["attached", "status", "model"])
        if int(attached or 0) > 0 or status is None or status.decode() in records.TERMINAL:
            return
        log.info("uid=%s ended early: %s (no client reattached)", uid, CLIENT_GONE)
        await records.abort_now(self.redis, self.keys, uid, CLIENT_GONE, self.settings.request_ttl_s,
                                model.decode() if model else None)

    async def close(self) -> None:
        """Shutdown: requests waiting for a reattach are decided now (nobody here will wait any longer)."""
        tasks = list(self.awaiting_reattach)
        for task in tasks:
            task.cancel()  # ends the wait, not the check
        for task in tasks:
            with contextlib.suppress(RedisError, OSError, asyncio.CancelledError):
                await task
