"""The scheduler's side of prefix-aware routing (docs/design.md, "Prefix-aware routing"; the tokenizer's side,
which chooses where a job goes, is services/tokenizer/router.py).

Once a routing tokenizer's flag (`Keys.prefix_routing`, set with its heartbeat) tells it to, each scheduler keeps
the hex digests of the pages its cache holds in a set of its own (`Keys.cached_pages`), changed with its engine
steps (SADD/SREM queued on the step's pipeline, no round trip of their own) and expiring with its heartbeat; it
reads a stream of its own (`Keys.scheduler_stream`) before the shared one, and drains the streams of departed
peers, then ends them. Without the flag (the default) a scheduler does none of this.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from shared import streams
from shared.consumer_group import GroupConsumer
from shared.keys import Keys

log = logging.getLogger(__name__)

PUBLISH_CHUNK = 4096  # digests per SADD when a scheduler publishes its whole cache again


@dataclass(frozen=True)
class PageChanges:
    """What a scheduler's prefix cache named and evicted since the last step (hex digests), for its page set."""

    added: list[str]
    removed: list[str]


class SchedulerLanes:
    """A scheduler's side: its own stream (a lane of its consumer, read before the shared stream), the set of
    the pages its prefix cache holds, and the streams of departed peers it drains and ends.

    Off the default path: a scheduler joins routing (opens its own stream, publishes its pages, and says its page
    size in its heartbeat, which is what makes tokenizers route to it) only once it sees the model's routing flag,
    which every tokenizer with --prefix-routing sets with its heartbeat (`Router.on_beat`); and it drains
    departed peers' streams only while the model has any (`Keys.routed` not empty). Both are read on its
    heartbeat's pipeline (`on_beat`): no round trip of their own. Joined, it stays so for its life. A plain
    deployment's scheduler reads with one XREADGROUP and publishes nothing.

    Every resource has an end: the set expires with the heartbeat (PEXPIREd with every beat and every change) and
    is deleted on close; an own stream is ended (deleted, and its id removed from `Keys.routed`) by its owner on
    close once nothing is left in it, else by a live peer once its owner is gone and the peer has drained it."""

    def __init__(self, redis: Redis, keys: Keys, model: str, consumer: GroupConsumer, *, page_size: int,
                 heartbeat_ttl_s: float):
        """`consumer`: the scheduler's own reader of the shared stream; its consumer name is the scheduler's id."""
        self.redis, self.keys, self.model, self.id = redis, keys, model, consumer.consumer
        self.consumer, self.page_size = consumer, page_size
        self.ttl_ms = int(heartbeat_ttl_s * 1000)
        self.pages_key = keys.cached_pages(model, self.id)
        self.routed_key = keys.routed(model)
        self.flag_key = keys.prefix_routing(model)
        self.joined = False  # own stream open, pages published
        self.asked = False  # a tokenizer routes (its flag was seen): join at the next `adopt`
        self.others = False  # the model has schedulers' own streams (live, or departed ones to drain)
        self.resync = False  # the set vanished (Redis lost it), or was never written: publish the whole cache

    @property
    def advertised_page_size(self) -> int:
        """The page size for the heartbeat: 0 (tokenizers route nothing here) until joined."""
        return self.page_size if self.joined else 0

    async def start(self) -> None:
        """Before the first heartbeat: join at once if a tokenizer routes already (one round trip)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.exists(self.flag_key)
            pipe.scard(self.routed_key)
            self._seen(await pipe.execute())
        if self.asked:
            await self.join()

    async def join(self) -> None:
        """Open the own stream (its group at 0) and name it in `Keys.routed`, before a heartbeat says our page
        size; the next step publishes the whole cache."""
        if self.joined or self.page_size <= 0:
            return
        await self.consumer.add_lane(self.id, create=True)
        await self.redis.sadd(self.routed_key, self.id)
        self.joined = self.resync = True
        log.info("joined prefix routing: reading %s, publishing the pages cached",
                 self.keys.scheduler_stream(self.model, self.id))

    def on_beat(self, pipe: Any) -> Callable[[list], None]:
        """Heartbeat hook: joined, keep the own stream named and the set alive as long as the heartbeat; else
        look whether a tokenizer routes and whether streams of other schedulers exist."""
        if not self.joined:
            pipe.exists(self.flag_key)
            pipe.scard(self.routed_key)
            return self._seen
        pipe.sadd(self.routed_key, self.id)
        pipe.pexpire(self.pages_key, self.ttl_ms)

        def seen(replies: list) -> None:
            self.resync = self.resync or not replies[-1]  # PEXPIRE 0: the set is gone (or was never written)

        return seen

    def _seen(self, replies: list) -> None:
        flag, routed = replies[-2:]
        self.asked = self.asked or bool(flag)
        self.others = bool(routed)

    def pages_due(self, changes: Callable[[], tuple[list[bytes], list[bytes]]],
                  everything: Callable[[], list[bytes]]) -> PageChanges | None:
        """What the cache named and evicted since the last step (all of it after the set was lost), once joined;
        None when there is nothing to tell. `changes` is asked only when joined."""
        if not self.joined:
            return None
        cached, evicted = changes()
        if self.resync:
            self.resync = False
            cached = everything()
        if not (cached or evicted):
            return None
        return PageChanges([d.hex() for d in cached], [d.hex() for d in evicted])

    def write_pages(self, pipe: Any, changes: PageChanges) -> None:
        if changes.removed:
            pipe.srem(self.pages_key, *changes.removed)
        for i in range(0, len(changes.added), PUBLISH_CHUNK):
            pipe.sadd(self.pages_key, *changes.added[i:i + PUBLISH_CHUNK])
        pipe.pexpire(self.pages_key, self.ttl_ms)  # a set SADD just made has no TTL yet

    async def adopt(self) -> None:
        """Join if a tokenizer asked; then drain the streams of departed schedulers as lanes (read and claimed
        before the shared stream) and end those that are drained: one round trip, plus one per stream found or
        ended. Nothing while the model has no such streams."""
        if self.asked and not self.joined:
            await self.join()
        draining = [lane for lane in self.consumer.lanes if lane != self.id]
        if not (self.joined or self.others or draining):
            return
        now = time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            for lane in draining:
                self.end_if_drained(pipe, lane)
            pipe.smembers(self.routed_key)
            pipe.zrangebyscore(self.keys.workers(), now - self.ttl_ms / 1000, "+inf")
            *ended, members, alive = await pipe.execute()
        for lane, done in zip(draining, ended, strict=True):
            if done:
                log.info("ended the stream of departed scheduler %s: drained", lane)
        live = {m.decode().partition(":")[2] for m in alive if m.startswith(b"scheduler:")}
        departed = {m.decode() for m in members} - live - {self.id}
        for lane in draining:
            if lane not in departed:  # ended, or its owner is back
                self.consumer.drop_lane(lane)
        for lane in sorted(departed - set(self.consumer.lanes)):
            if await self.consumer.add_lane(lane, create=False):
                log.info("draining the stream of departed scheduler %s", lane)
            else:  # named but gone: only its name is left to end
                await self.end_if_drained(self.redis, lane)

    def end_if_drained(self, target: Any, lane: str) -> Any:
        return streams.end_if_drained(target, self.keys.scheduler_stream(self.model, lane), self.consumer.group,
                                      companion=self.keys.cached_pages(self.model, lane), registry=self.routed_key,
                                      member=lane)

    async def release(self) -> None:
        """On close: the cache dies with the process, so its set goes; the own stream ends if nothing is left in
        it (entries handed back stay for peers, which end it once drained)."""
        if not self.joined:
            return
        await self.redis.delete(self.pages_key)
        await self.end_if_drained(self.redis, self.id)
