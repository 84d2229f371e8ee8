"""What the requests of this API process share, and which of them are open (services/api/answer/request/requests.py
`Requests` opens them on it)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.api.answer.reply_hub import Inbox, ReplyHub
from services.api.answer.request.api_request import ApiRequest, Writes
from services.api.operations.metrics import Metrics
from shared import streams
from shared.messages import TokenizeJob, TokenizerQuery
from shared.redis_conn import barrier
from shared.request_states import TERMINAL, EndReason
from shared.request_store import RequestStore
from shared.settings import ApiSettings
from shared.tracing import Tracer

log = logging.getLogger(__name__)


class RequestContext:
    """What the requests of this process share (Redis, the reply hub, metrics, traces), and the ones it submitted
    that are still open (`inflight`: a drain waits for them)."""

    def __init__(self, settings: ApiSettings, store: RequestStore, hub: ReplyHub, pod: str, *, tracer: Tracer,
                 metrics: Metrics):
        self.settings, self.store, self.hub, self.pod = settings, store, hub, pod
        self.redis: Redis = store.redis
        self.keys = store.keys
        self.tracer, self.metrics = tracer, metrics
        self.inflight: dict[str, ApiRequest] = {}
        self.idle = asyncio.Event()  # set while `inflight` is empty
        self.idle.set()
        self.awaiting_reattach: dict[asyncio.Task, str] = {}  # delayed aborts -> uid

    async def submit(self, msg: TokenizeJob | TokenizerQuery, record: dict, writes: Writes | None = None) -> Inbox:
        """Write a request's record (`record`: its fields beside its model, pod and creation time), `writes` (what
        its submission stores beside the record), its message on its model's tokenize stream, and subscribe to its
        reply stream, waking the reply reader: one transaction, one round trip. Nothing is left behind (nor
        subscribed) if Redis fails: the error is raised."""
        sub = None
        try:
            # A transaction (on a standalone Redis; a cluster's pipeline stops at the barrier when what precedes
            # it failed): a Redis at its maxmemory refuses all of it or none, never a job without its record.
            async with self.redis.pipeline(transaction=True) as pipe:
                self.store.create(pipe, msg.uid, msg.deadline, model=msg.model, pod=self.pod,
                                  created_at=f"{msg.created_at:.3f}", **record)
                if writes is not None:
                    writes(pipe)
                barrier(pipe)  # the record exists before a tokenizer can read the message (on a cluster too)
                streams.add(pipe, self.keys.tokenize(msg.model), msg)
                sub = self.hub.register(Inbox(msg.uid, self.keys.reply(msg.uid)), wake_in=pipe)
                await pipe.execute()
        except BaseException:
            if sub is not None:
                self.hub.unsubscribe(sub)
            raise
        return sub

    def opened(self, req: ApiRequest) -> None:
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
