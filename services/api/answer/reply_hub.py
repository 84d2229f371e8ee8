"""The reply hub: one listener per API process multiplexing XREAD BLOCK over the reply streams of all
its in-flight requests, feeding each request's inbox (`Inbox`).

A request's inbox is woken into a blocked read through the shard's control stream. Reads are
sharded over several connections once one XREAD would carry more than `shard_keys` keys (XREAD's cost
grows with its key count). An inbox that holds `high_water` entries is left out of reads until its client
catches up: the reply stream in Redis (capped by MAXLEN) is the buffer, so a slow client cannot grow this
process's memory.

Each shard owns one hash slot: its control stream's tag is in it, and `new_uid` gives the requests it will
read uids in it, so on a Redis Cluster its one XREAD names keys of one slot (docs/design.md, "Redis Cluster").
On a cluster there are at least as many shards as primaries, their slots on different primaries, and a
request submitted elsewhere (a reattach) is read by a guest shard of its own slot, closed when it is empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from shared import slots, streams
from shared.keys import Keys
from shared.redis_conn import connect_single, is_cluster_client
from shared.tasks import stop_task

log = logging.getLogger(__name__)

BLOCK_MS = 2000
CONTROL_TTL_S = 3600
CONTROL_REFRESH_S = 60  # a control stream XADD recreated (Redis lost it) goes at most this long without a TTL
OUTAGE_S = 10.0  # Redis unreachable this long: fail every subscription rather than hang
CLUSTER_OUTAGE_S = 30.0  # a cluster failover: cluster-node-timeout (15 s by default) plus the election


@dataclass(frozen=True, slots=True)
class HubLimits:
    """How far a hub goes: keys per shard's read, entries queued per subscription before it is left out of
    reads, and how long Redis may be unreachable before subscriptions fail (None: the default of the kind of
    Redis, OUTAGE_S or CLUSTER_OUTAGE_S)."""

    shard_keys: int = 256
    high_water: int = 256
    outage_s: float | None = None


class HubError(Exception):
    """The reply stream cannot be read (Redis unreachable)."""


class Inbox:
    """A request's reply entries, queued here as the hub reads them off its stream (services/api/answer/request/ reads
    them). Once `resume_at * 2` are queued the hub leaves the stream out of its reads until the request caught
    up: the reply stream in Redis (capped by MAXLEN) is the buffer, so a slow client cannot grow this process's
    memory. The hub's shard that reads it (`shard`) is set when the hub registers it."""

    def __init__(self, uid: str, key: str, after: str = "0-0"):
        self.uid, self.key = uid, key
        self.last_id = after  # "0-0": from the beginning, so entries written before the read blocks are not missed
        self.queue: asyncio.Queue[tuple[str, bytes] | HubError | None] = asyncio.Queue()
        self.paused = False
        self.failed = False
        self.shard: Any = None
        self.resume_at = 0
        self.due: float | None = None  # a timed `get` is waiting until then (the loop's clock)
        # uvloop's call_at answers a plain Handle (no `when()`) for a time already past: the alarm's time is kept
        self.alarm: asyncio.Handle | None = None
        self.alarm_at = 0.0

    async def get(self, wait_s: float | None = None) -> tuple[str, bytes] | None:
        """The next entry; None once `wait_s` seconds passed without one."""
        # Resume reading before waiting: a caller that drained the queue would otherwise wait forever on a
        # stream that is left out of reads.
        if self.paused and self.queue.qsize() <= self.resume_at:
            self.paused = False
            await self.shard.wake()
        if wait_s is not None and self.queue.empty():
            self._wait_until(asyncio.get_running_loop().time() + wait_s)
        try:
            item = await self.queue.get()
            while item is None and wait_s is None:  # a timed wait's end that came too late for it
                item = await self.queue.get()
        finally:
            self.due = None
        if isinstance(item, HubError):
            raise item
        return item

    def _wait_until(self, due: float) -> None:
        """One timer per inbox, not one per wait (asyncio.timeout's cost on every entry): the alarm rings at the
        due time of the wait that set it, and a later wait finds it set early enough and leaves it; when it
        rings, `_ring` sets it again for the wait under way, or ends that wait if it is due."""
        self.due = due
        if self.alarm is None or self.alarm_at > due:
            if self.alarm is not None:
                self.alarm.cancel()
            self.alarm, self.alarm_at = asyncio.get_running_loop().call_at(due, self._ring), due

    def _ring(self) -> None:
        self.alarm = None
        if self.due is None:
            return  # nothing waits now: the next timed wait sets the alarm
        loop = asyncio.get_running_loop()
        if loop.time() < self.due:
            self.alarm, self.alarm_at = loop.call_at(self.due, self._ring), self.due
        elif self.queue.empty():
            self.queue.put_nowait(None)  # the waiting `get` returns None

    def close(self) -> None:
        """No alarm left behind once its request is done with it."""
        if self.alarm is not None:
            self.alarm.cancel()
            self.alarm = None

    def drain(self) -> list[tuple[str, bytes]]:
        """Everything already queued, without waiting (lets the caller coalesce entries into one chunk)."""
        out = []
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if item is None:
                continue  # a timed wait's end that came as an entry did (`_ring`)
            if isinstance(item, HubError):
                self.queue.put_nowait(item)
                break
            out.append(item)
        return out


class _Shard:
    def __init__(self, hub: ReplyHub, index: int, slot: int, guest: bool = False):
        self.hub, self.index, self.slot, self.guest = hub, index, slot, guest
        self.redis = connect_single(hub.url, **hub.redis_options)
        streams.lean_reads(self.redis)
        self.control = hub.keys.control(hub.pod, index, slots.uid_in_slot(slot))
        self.control_id = "$"
        self.refreshed_at = -CONTROL_REFRESH_S  # when `wake_in` last queued the control stream's EXPIRE
        # reply stream -> the inboxes reading it: a request's own, and in the same process a reattach to it or
        # the read that rebuilds its final object (each gets every entry after its own position)
        self.subs: dict[str, list[Inbox]] = {}
        self.task = asyncio.create_task(self._loop(), name=f"reply-hub-{index}")

    def wake_in(self, pipe) -> None:
        """Queue the XADD that wakes this shard's blocked read (so it re-reads its key set), and an EXPIRE of the
        control stream once CONTROL_REFRESH_S passed since the last: not one per request."""
        streams.add_fields(pipe, self.control, {"op": "wake"}, maxlen=64)
        now = time.monotonic()
        if now - self.refreshed_at >= CONTROL_REFRESH_S:
            self.refreshed_at = now
            pipe.expire(self.control, CONTROL_TTL_S)

    async def wake(self) -> None:
        async with self.hub.redis.pipeline(transaction=False) as pipe:
            self.wake_in(pipe)
            await pipe.execute()

    async def _loop(self) -> None:
        failing_since = None
        while True:
            positions = self._positions()
            try:
                if self.control_id == "$":  # learn the control stream's tip once, so wakes aren't missed
                    self.control_id = await self._control_tip()
                    continue
                resp = await streams.read(self.redis, positions, self.hub.high_water, BLOCK_MS)
                failing_since = None
            except (RedisError, OSError) as e:
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > self.hub.outage_s:
                    self._fail_all(HubError(f"reply stream unreadable: {e}"))
                await asyncio.sleep(0.2)
                continue
            self._dispatch(resp, positions)

    def _positions(self) -> dict[str, str]:
        """Where the next read starts in each stream: the earliest position of its inboxes not paused."""
        positions = {self.control: self.control_id}
        for key, inboxes in self.subs.items():
            if len(inboxes) == 1:  # as nearly every stream is read: by its request's own inbox alone
                if not inboxes[0].paused:
                    positions[key] = inboxes[0].last_id
                continue
            reading = [sub.last_id for sub in inboxes if not sub.paused]
            if reading:
                positions[key] = min(reading, key=streams.id_tuple)
        return positions

    async def _control_tip(self) -> str:
        return await streams.last_id(self.redis, self.control) or "0-0"

    def _dispatch(self, resp, positions: dict[str, str]) -> None:
        """Each read's entries to the inboxes it read for: those whose position the read started at or before. An
        inbox registered (or resumed) while the read was blocked past its position would otherwise take the
        entries after that point as its first and never see those before: the next read starts from it."""
        for key, entries in resp:
            if key == self.control:
                self.control_id = entries[-1][0]
                continue
            read_from = positions.get(key)
            for sub in self.subs.get(key, ()):
                if read_from is not None and not sub.paused and (
                        read_from == sub.last_id or not streams.id_after(read_from, sub.last_id)):
                    self._deliver(sub, entries, read_from)

    def _deliver(self, sub: Inbox, entries: list[tuple[str, bytes]], read_from: str | None) -> None:
        """The entries past the inbox's position (all of them when the read started there, as it does unless
        another inbox of its stream read from further back: entries are in order, so the first one past it
        starts what is new)."""
        start = 0 if read_from == sub.last_id else next(
            (k for k, (entry_id, _) in enumerate(entries) if streams.id_after(entry_id, sub.last_id)), len(entries))
        if start == len(entries):
            return
        sub.last_id = entries[-1][0]
        put = sub.queue.put_nowait
        for entry in entries[start:] if start else entries:
            put(entry)
        if sub.queue.qsize() >= self.hub.high_water:
            sub.paused = True

    def _fail_all(self, error: HubError) -> None:
        for sub in (sub for inboxes in self.subs.values() for sub in inboxes):
            if not sub.failed:
                sub.failed = True
                sub.queue.put_nowait(error)

    async def close(self) -> None:
        await stop_task(self.task)  # a cluster client's read can swallow the first cancellation
        with contextlib.suppress(Exception):
            await self.redis.delete(self.control)
        await self.redis.aclose()


class ReplyHub:
    def __init__(self, url: str, redis_options: dict, redis, keys: Keys, pod: str, *,
                 limits: HubLimits = HubLimits()):
        """`url` and `redis_options`: how each shard opens its own connection; `redis`: the process's client."""
        self.url, self.redis_options, self.redis = url, redis_options, redis
        self.keys, self.pod = keys, pod
        self.shard_keys, self.high_water = limits.shard_keys, limits.high_water
        self.cluster = is_cluster_client(redis)
        # How long a shard's Redis may be unreachable before its subscriptions fail: on a cluster, long enough
        # for a replica to take over a failed primary.
        default_outage_s = CLUSTER_OUTAGE_S if self.cluster else OUTAGE_S
        self.outage_s = limits.outage_s if limits.outage_s is not None else default_outage_s
        self.shards: list[_Shard] = []
        self.created = 0
        self.turn = 0
        self.closing: set[asyncio.Task] = set()

    @property
    def subscriptions(self) -> int:
        return sum(len(inboxes) for s in self.shards for inboxes in s.subs.values())

    def new_uid(self) -> str:
        """The uid of a request this process submits: in the slot of the shard that will read its replies."""
        return slots.uid_in_slot(self._own_shard().slot)

    def register(self, inbox: Inbox, wake_in=None) -> Inbox:
        """Add the inbox's reply stream to a shard's key set, read after its `last_id`. The caller queues the
        shard's wake in its own pipeline (`wake_in`, or `inbox.shard.wake_in` later), or calls `subscribe`
        instead. On a cluster the shard is the one of the uid's slot (a guest shard for a request submitted
        elsewhere); a standalone Redis takes any key in any read."""
        if self.cluster:
            slot = slots.key_slot(inbox.key)
            shard = next((s for s in self.shards if s.slot == slot), None) or self._add_shard(slot, guest=True)
        else:
            shard = self._own_shard()
        inbox.shard, inbox.resume_at = shard, self.high_water // 2
        shard.subs.setdefault(inbox.key, []).append(inbox)
        if wake_in is not None:
            shard.wake_in(wake_in)
        return inbox

    def _own_shard(self) -> _Shard:
        """The least loaded of this process's own shards, taking turns among equals (so that short requests
        spread over every primary too), or a new one."""
        own = [s for s in self.shards if not s.guest]
        self.turn += 1
        turn = self.turn % len(own) if own else 0
        shard = min(own[turn:] + own[:turn], key=lambda s: len(s.subs), default=None)
        if shard is None or len(shard.subs) >= self.shard_keys or len(own) < self._least_shards():
            shard = self._add_shard(self._free_slot(own))
        return shard

    def _least_shards(self) -> int:
        """One shard per primary on a cluster, so this process's replies spread over every primary."""
        return max(1, len(self.redis.get_primaries())) if self.cluster else 1

    def _free_slot(self, own: list[_Shard]) -> int:
        """A slot no shard has; on a cluster, one held by the primary that holds the fewest of our shards (the
        topology is the client's, loaded by its first command; before that any slot)."""
        taken = {s.slot for s in self.shards}
        load: dict[str, int] = {}
        if self.cluster and self.redis.get_primaries():
            load = {p.name: 0 for p in self.redis.get_primaries()}
            for s in own:
                node = self._primary_of(s.slot)
                if node in load:
                    load[node] += 1
        target = min(load, key=load.__getitem__) if load else None
        for _ in range(10_000):
            slot = secrets.randbelow(slots.SLOTS)
            if slot not in taken and (target is None or self._primary_of(slot) == target):
                return slot
        return next(s for s in range(slots.SLOTS) if s not in taken)

    def _primary_of(self, slot: int) -> str | None:
        try:
            return self.redis.nodes_manager.get_node_from_slot(slot).name
        except RedisError:  # the slot is not covered now (a failover in progress)
            return None

    def _add_shard(self, slot: int, guest: bool = False) -> _Shard:
        shard = _Shard(self, self.created, slot, guest)
        self.created += 1
        self.shards.append(shard)
        return shard

    async def subscribe(self, inbox: Inbox) -> Inbox:
        self.register(inbox)
        try:
            await inbox.shard.wake()
        except BaseException:
            self.unsubscribe(inbox)
            raise
        return inbox

    def unsubscribe(self, sub: Inbox) -> None:
        shard = sub.shard
        inboxes = shard.subs.get(sub.key, [])
        if sub in inboxes:
            inboxes.remove(sub)
        if not inboxes:
            shard.subs.pop(sub.key, None)
        sub.queue.put_nowait(HubError("unsubscribed"))  # whoever still waits on it ends, not hangs
        sub.close()
        if shard.guest and not shard.subs and shard in self.shards:
            self.shards.remove(shard)
            task = asyncio.create_task(shard.close(), name=f"reply-hub-close-{shard.index}")
            self.closing.add(task)
            task.add_done_callback(self.closing.discard)

    async def close(self) -> None:
        for shard in reversed(self.shards):
            await shard.close()
        self.shards.clear()
        if self.closing:
            await asyncio.gather(*self.closing, return_exceptions=True)
