"""The reply hub: one listener per API process multiplexing XREAD BLOCK over the reply streams of all
its in-flight requests, feeding one queue per request.

A request's subscription is woken into a blocked read through the shard's control stream. Reads are
sharded over several connections once one XREAD would carry more than `shard_keys` keys (XREAD's cost
grows with its key count). A subscription whose queue holds `high_water` entries is left out of reads
until its client catches up: the reply stream in Redis (capped by MAXLEN) is the buffer, so a slow
client cannot grow this process's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.exceptions import RedisError

from shared import streams
from shared.keys import Keys
from shared.redis_conn import connect_single

log = logging.getLogger(__name__)

BLOCK_MS = 2000
CONTROL_TTL_S = 3600


class HubError(Exception):
    """The reply stream cannot be read (Redis unreachable)."""


class Subscription:
    def __init__(self, hub: ReplyHub, shard: _Shard, uid: str, key: str, after: str):
        self.hub, self.shard, self.uid, self.key = hub, shard, uid, key
        self.last_id = after
        self.queue: asyncio.Queue[tuple[str, bytes] | HubError] = asyncio.Queue()
        self.paused = False
        self.failed = False

    async def get(self) -> tuple[str, bytes]:
        # Resume reading before waiting: a caller that drained the queue would otherwise wait forever on a
        # subscription that is left out of reads.
        if self.paused and self.queue.qsize() <= self.hub.high_water // 2:
            self.paused = False
            await self.shard.wake()
        item = await self.queue.get()
        if isinstance(item, HubError):
            raise item
        return item

    def drain(self) -> list[tuple[str, bytes]]:
        """Everything already queued, without waiting (lets the caller coalesce entries into one chunk)."""
        out = []
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, HubError):
                self.queue.put_nowait(item)
                break
            out.append(item)
        return out


class _Shard:
    def __init__(self, hub: ReplyHub, index: int):
        self.hub, self.index = hub, index
        self.redis = connect_single(hub.url, **hub.redis_options)
        self.control = hub.keys.control(hub.pod, index)
        self.control_id = "$"
        self.subs: dict[str, Subscription] = {}
        self.task = asyncio.create_task(self._loop(), name=f"reply-hub-{index}")

    def wake_in(self, pipe) -> None:
        """Queue the XADD that wakes this shard's blocked read (so it re-reads its key set)."""
        streams.add_fields(pipe, self.control, {"op": "wake"}, maxlen=64)
        pipe.expire(self.control, CONTROL_TTL_S)

    async def wake(self) -> None:
        async with self.hub.redis.pipeline(transaction=False) as pipe:
            self.wake_in(pipe)
            await pipe.execute()

    async def _loop(self) -> None:
        failing_since = None
        while True:
            positions = {self.control: self.control_id}
            for key, sub in self.subs.items():
                if not sub.paused:
                    positions[key] = sub.last_id
            try:
                if self.control_id == "$":  # learn the control stream's tip once, so wakes aren't missed
                    self.control_id = await self._control_tip()
                    continue
                resp = await streams.read(self.redis, positions, self.hub.high_water, BLOCK_MS)
                failing_since = None
            except (RedisError, OSError) as e:
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > self.hub.outage_s:  # rather than hang
                    self._fail_all(HubError(f"reply stream unreadable: {e}"))
                await asyncio.sleep(0.2)
                continue
            self._dispatch(resp)

    async def _control_tip(self) -> str:
        entries = await self.redis.xrevrange(self.control, count=1)
        return entries[0][0].decode() if entries else "0-0"

    def _dispatch(self, resp) -> None:
        for key, entries in resp:
            if key == self.control:
                self.control_id = entries[-1][0]
                continue
            sub = self.subs.get(key)
            if sub is None:
                continue
            sub.last_id = entries[-1][0]
            for entry_id, fields in entries:
                sub.queue.put_nowait((entry_id, streams.payload(fields)))
            if sub.queue.qsize() >= self.hub.high_water:
                sub.paused = True

    def _fail_all(self, error: HubError) -> None:
        for sub in self.subs.values():
            if not sub.failed:
                sub.failed = True
                sub.queue.put_nowait(error)

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task
        with contextlib.suppress(Exception):
            await self.redis.delete(self.control)
        await self.redis.aclose()


class ReplyHub:
    def __init__(self, url: str, redis_options: dict, redis, keys: Keys, pod: str, shard_keys: int = 256,
                 high_water: int = 256, outage_s: float = 10.0):
        self.url, self.redis_options, self.redis = url, redis_options, redis
        self.keys, self.pod = keys, pod
        self.shard_keys, self.high_water = shard_keys, high_water
        self.outage_s = outage_s  # Redis unreachable this long: fail every subscription
        self.shards: list[_Shard] = []

    @property
    def subscriptions(self) -> int:
        return sum(len(s.subs) for s in self.shards)

    def register(self, uid: str, after: str = "0-0") -> Subscription:
        """Add rsinfer:reply:<uid> to a shard's key set, reading after `after` ("0-0": from the beginning,
        so entries written before the read blocks are not missed). The caller queues `sub.shard.wake_in`
        in its own pipeline, or calls `subscribe` instead."""
        shard = min(self.shards, key=lambda s: len(s.subs), default=None)
        if shard is None or len(shard.subs) >= self.shard_keys:
            shard = _Shard(self, len(self.shards))
            self.shards.append(shard)
        key = self.keys.reply(uid)
        sub = shard.subs[key] = Subscription(self, shard, uid, key, after)
        return sub

    async def subscribe(self, uid: str, after: str = "0-0") -> Subscription:
        sub = self.register(uid, after)
        try:
            await sub.shard.wake()
        except BaseException:
            self.unsubscribe(sub)
            raise
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        sub.shard.subs.pop(sub.key, None)
        sub.queue.put_nowait(HubError("unsubscribed"))  # whoever still waits on it ends, not hangs

    async def close(self) -> None:
        for shard in reversed(self.shards):
            await shard.close()
        self.shards.clear()
