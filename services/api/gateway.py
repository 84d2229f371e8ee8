"""Submitting requests and owning them until they end.

`Gateway.open` writes the request record and the tokenize job in one round trip and subscribes to the
reply stream first (so no entry is missed). The returned `Inflight` is closed exactly once whatever
happens (finish, client gone, deadline, error, server shutdown): it leaves the hub, and unless the
request ended it sets the abort flag so every stage drops it.
"""

from __future__ import annotations

import logging
import time
import uuid

import anyio
from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.api.flow import OrderedReplies, ordered_entries, ordered_events
from services.api.replies import ReplyHub, Subscription
from shared import records, streams
from shared.keys import Keys
from shared.messages import TokenizeJob
from shared.settings import ApiSettings

log = logging.getLogger(__name__)


def new_uid() -> str:
    return uuid.uuid4().hex


class Inflight:
    def __init__(self, gateway: Gateway, uid: str, sub: Subscription, n: int, deadline: float,
                 owner: bool = True):
        self.gateway, self.uid, self.sub, self.deadline = gateway, uid, sub, deadline
        self.owner = owner  # a reattached follower never aborts the request it follows
        self.order = OrderedReplies(n)
        self.closed = False
        self.end_reason = "client_disconnected"  # why we abort if closed before the reply finished
        self.started = time.monotonic()
        self.first_token_at: float | None = None

    def events(self):
        return ordered_events(self.sub, self.order, self.deadline)

    def entries(self):
        return ordered_entries(self.sub, self.order, self.deadline)

    @property
    def done(self) -> bool:
        return self.order.done

    async def close(self) -> None:
        """Idempotent; shielded so it completes even while the caller is being cancelled."""
        if self.closed:
            return
        self.closed = True
        with anyio.CancelScope(shield=True):
            self.gateway.hub.unsubscribe(self.sub)
            if self.owner:
                self.gateway.inflight.pop(self.uid, None)
            if self.owner and not self.done:
                log.info("uid=%s ended early: %s", self.uid, self.end_reason)
                try:
                    await records.abort(self.gateway.redis, self.gateway.keys, self.uid, self.end_reason,
                                        self.gateway.settings.request_ttl_s)
                except (RedisError, OSError) as e:
                    log.warning("uid=%s could not set abort flag: %s", self.uid, e)


class Gateway:
    def __init__(self, settings: ApiSettings, redis: Redis, hub: ReplyHub, keys: Keys, pod: str):
        self.settings, self.redis, self.hub, self.keys, self.pod = settings, redis, hub, keys, pod
        self.inflight: dict[str, Inflight] = {}

    def deadline(self, timeout: float | None) -> float:
        limit = self.settings.request_timeout_s
        return time.time() + (min(timeout, limit) if timeout else limit)

    async def open(self, job: TokenizeJob, record: dict) -> Inflight:
        """Subscribe to the reply stream, write the record and the job and wake the reply reader, all in
        one round trip; the caller must close() the result. Nothing is left behind if Redis fails."""
        sub = self.hub.register(job.uid)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                records.set_status(pipe, self.keys, job.uid, self.settings.request_ttl_s, "queued",
                                   model=job.model, pod=self.pod, created_at=f"{job.created_at:.3f}",
                                   deadline=f"{job.deadline:.3f}", **record)
                streams.add(pipe, self.keys.tokenize(job.model), job)
                sub.shard.wake_in(pipe)
                await pipe.execute()
        except BaseException:
            self.hub.unsubscribe(sub)
            raise
        flight = self.inflight[job.uid] = Inflight(self, job.uid, sub, job.params.n, job.deadline)
        log.info("uid=%s queued for %s", job.uid, job.model)
        return flight

    async def attach(self, uid: str, n: int, deadline: float) -> Inflight:
        """Follow an existing request's reply stream (resumable streams); closing never aborts it."""
        return Inflight(self, uid, await self.hub.subscribe(uid), n, deadline, owner=False)
