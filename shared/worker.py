"""What every stage worker shares: build, report ready, loop, drain, close in `finally` in reverse order.

A worker consumes one stream through one consumer group. Its loop survives Redis outages (backoff and
retry; groups are recreated when Redis comes back empty), claims entries a dead or hung peer left
pending, and trims entries every group member has acknowledged. On SIGTERM it stops taking new
entries, lets in-flight work finish within the grace period, and hands what is left back to the group
so a peer takes it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from redis.exceptions import RedisError

from shared.keys import Keys
from shared.redis_conn import connect
from shared.registry import Heartbeat
from shared.settings import StageSettings
from shared.streams import Delivery, GroupConsumer

log = logging.getLogger(__name__)
M = TypeVar("M")

TRIM_EVERY_S = 10.0
MAX_BACKOFF_S = 2.0
CLAIM_EVERY_S = 0.5  # claims are cheap; polling often is what makes a hand-back "at once"
HANDOFF_CONSUMER = "handoff"  # entries handed back on shutdown wait here, idle, for any peer to claim


class StageWorker(Generic[M]):
    role: str = ""
    group: str = ""
    message_type: type

    def __init__(self, settings: StageSettings, model_name: str):
        self.settings = settings
        self.keys = Keys(settings.namespace)
        self.id = settings.identity()
        self.model_name = model_name
        self.redis = connect(settings.redis_url, **settings.redis_options())
        self.source = GroupConsumer[M](self.redis, self.keys.stage_stream(self.role, model_name), self.group,
                                       self.id, self.message_type, self.keys.dead())
        self.heartbeat = Heartbeat(self.redis, self.keys, self.role, self.id, model_name,
                                   settings.heartbeat_interval_s, settings.heartbeat_ttl_s, self.load)
        self.ttl, self.maxlen = settings.request_ttl_s, settings.reply_maxlen
        self.stopping = asyncio.Event()
        self.forced = asyncio.Event()
        self.steps = 0
        self.last_step_at = time.time()
        self._last: dict[str, float] = {}
        self.model_info: dict = {}  # in the heartbeat: `root` (checkpoint) and `max_model_len`, for /v1/models

    # -- hooks for subclasses -------------------------------------------------------------------------
    async def handle(self, batch: list[Delivery[M]], claimed: bool) -> None:
        raise NotImplementedError

    def load(self) -> dict:
        return {"steps": self.steps, "last_step_at": round(self.last_step_at, 3), "model_info": self.model_info}

    def read_count(self) -> int:
        return self.settings.batch_size

    def held_entries(self) -> list[str]:
        """Entries this worker holds on purpose across iterations (kept alive against claims)."""
        return []

    async def finish_in_flight(self, deadline: float) -> None:
        """On shutdown, until `deadline` (time.monotonic()): finish what can be finished. Default: nothing
        is held across iterations, so nothing to finish."""

    # -- the shape every worker has -------------------------------------------------------------------
    async def start(self) -> None:
        await self.source.ensure_group()
        await self.heartbeat.beat()
        self.heartbeat.start()
        log.info("%s ready: model=%s stream=%s", self.role, self.model_name, self.source.key)

    async def loop(self) -> None:
        await self.retrying(self.iteration, until=self.stopping)

    async def retrying(self, step: Callable[[], Awaitable[None]], until: asyncio.Event) -> None:
        """Run `step` until `until` is set; a Redis outage means backoff and retry, never exit."""
        backoff = 0.1
        while not until.is_set():
            try:
                await step()
                backoff = 0.1
            except (RedisError, OSError) as e:
                log.warning("redis unavailable (%s); retrying in %.1fs", e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)

    async def iteration(self) -> None:
        """Receive, do, send, acknowledge: one read (claims first when due) handled as one batch."""
        batch, claimed = await self.receive()
        if batch:
            await self.handle(batch, claimed)
            self.steps += 1
        self.last_step_at = time.time()  # the loop moved (liveness), busy or idle
        await self.housekeeping()

    def due(self, what: str, every_s: float) -> bool:
        now = time.monotonic()
        if now - self._last.get(what, 0.0) < every_s:
            return False
        self._last[what] = now
        return True

    async def receive(self, block_ms: int | None = 1000) -> tuple[list[Delivery[M]], bool]:
        count = self.read_count()
        if count <= 0:
            return [], False
        if self.due("claim", min(CLAIM_EVERY_S, self.settings.claim_idle_ms / 2000)):
            claimed = await self.source.claim(self.settings.claim_idle_ms, count)
            if claimed:
                log.info("claimed %d entries a dead, hung or departing peer left pending", len(claimed))
                return claimed, True
        return await self.source.read(count, block_ms), False

    async def housekeeping(self) -> None:
        if self.due("touch", self.settings.claim_idle_ms / 3000):
            await self.source.touch(self.held_entries())
        if self.due("trim", TRIM_EVERY_S):
            await self.source.trim_acknowledged()

    async def drain(self) -> None:
        """After SIGTERM: finish in-flight work within the grace period, then hand back the rest.
        The deadline is checked between steps, never by cancelling one: a step runs in a thread that a
        cancellation would not stop."""
        await self.finish_in_flight(time.monotonic() + self.settings.grace_period_s)
        with contextlib.suppress(RedisError, OSError):
            left = await self.source.pending_ids()
            await self.source.hand_back(left, HANDOFF_CONSUMER)
            if left:
                log.info("handed %d entries back to the group", len(left))

    async def close(self) -> None:
        await self.heartbeat.stop()
        await self.redis.aclose()

    def request_stop(self) -> None:
        if self.stopping.is_set():
            self.forced.set()
        self.stopping.set()


def run_stage(settings: StageSettings, build: Callable[[str, str], Awaitable[StageWorker]]) -> int:
    """Entry point of a stage process: resolve the model, then serve the worker `build` makes."""
    from shared.models import resolve_model

    model_path, model_name = resolve_model(settings)
    asyncio.run(serve(lambda: build(model_path, model_name)))
    return 0


async def serve(build: Callable[[], Awaitable[StageWorker]]) -> None:
    """Build a worker, report it ready, run its loop until SIGTERM/SIGINT, drain it, then close it.
    A second signal cuts the drain short."""
    worker = await build()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.request_stop)
    try:
        await worker.start()
        await worker.loop()
        await worker.drain()
    finally:
        with contextlib.suppress(Exception):
            await worker.close()
        log.info("%s stopped", worker.role)
