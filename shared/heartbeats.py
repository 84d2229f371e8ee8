"""Worker heartbeats (`rsinfer:worker:<role>:<id>`, a hash with a TTL), who is alive, and which models
are declared.

A sorted set (`rsinfer:workers`, member `role:id`, score = last beat) indexes the heartbeats so that
listing the live workers needs no SCAN over the whole keyspace. Stage workers also declare their model
(`rsinfer:models`, no TTL) with every beat: the declaration outlives them, so a model scaled to zero is
still known, and comes back by itself after Redis restarted empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared.keys import STAGES, Keys
from shared.tasks import stop_task

log = logging.getLogger(__name__)


@dataclass
class WorkerInfo:
    role: str
    id: str  # <name>@<process start>
    model: str
    updated_at: float
    load: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.id.split("@", 1)[0]


@dataclass(frozen=True)
class Beating:
    """Who a heartbeat is of (a stage's role, its worker id, the model it serves: "" for an API process) and
    how often it beats (`interval_s`) for how long each beat lives (`ttl_s`)."""

    role: str
    worker_id: str
    model: str
    interval_s: float
    ttl_s: float


RETRY_S = 0.1  # the first retry of a failed beat


class Heartbeat:
    """Refreshes this process's heartbeat every `interval` seconds until stopped; deletes it on close."""

    def __init__(self, redis: Redis, keys: Keys, who: Beating, load: Callable[[], dict], *,
                 card: Callable[[], dict] | None = None):
        self.redis, self.keys, self.role, self.id, self.model = redis, keys, who.role, who.worker_id, who.model
        self.interval, self.ttl, self.load = who.interval_s, who.ttl_s, load
        self.card = card  # what this stage knows of its model (`root`, `max_model_len`, ...): declares it
        # Queues more commands on each beat's pipeline (keys whose life follows the heartbeat) and returns what to
        # do with their replies, if anything.
        self.extra: Callable[[Any], Callable[[list], None] | None] | None = None
        self.started_at = time.time()
        self._task: asyncio.Task | None = None

    @property
    def key(self) -> str:
        return self.keys.worker(self.role, self.id)

    async def beat(self) -> None:
        now = time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(self.key, mapping={"role": self.role, "id": self.id, "model": self.model,
                                         "started_at": f"{self.started_at:.3f}", "updated_at": f"{now:.3f}",
                                         "load": json.dumps(self.load(), separators=(",", ":"))})
            pipe.pexpire(self.key, int(self.ttl * 1000))
            pipe.zadd(self.keys.workers(), {f"{self.role}:{self.id}": now})
            pipe.zremrangebyscore(self.keys.workers(), "-inf", now - 10 * self.ttl)
            if self.card is not None and self.model:
                pipe.hset(self.keys.models(), f"{self.role}:{self.model}",
                          json.dumps(self.card(), separators=(",", ":"), sort_keys=True))
            own = len(pipe)
            then = self.extra(pipe) if self.extra is not None else None
            replies = await pipe.execute()
        if then is not None:
            then(replies[own:])

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"heartbeat-{self.role}")

    async def _run(self) -> None:
        retry = RETRY_S
        while True:
            wait = self.interval
            try:
                await self.beat()
                retry = RETRY_S
            except (RedisError, OSError) as e:
                log.warning("heartbeat failed: %s", e)
                # Beat again as soon as Redis is back (retries doubling up to the interval): a restart that
                # outlasts the heartbeat's TTL leaves this worker looking dead until its next beat
                wait, retry = min(retry, self.interval), retry * 2
            except Exception:  # a heartbeat that dies makes a live worker look dead: never let it
                log.exception("heartbeat failed")
            if asyncio.current_task().cancelling():  # stopped, but the beat's Redis call swallowed it (`stop`)
                return
            await asyncio.sleep(wait)

    async def stop(self) -> None:
        if self._task:  # again if a beat's Redis call swallowed the cancellation
            await stop_task(self._task)
        with contextlib.suppress(RedisError, OSError):
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.delete(self.key)
                pipe.zrem(self.keys.workers(), f"{self.role}:{self.id}")
                await pipe.execute()


async def live_workers(redis: Redis, keys: Keys, ttl: float, role: str | None = None) -> list[WorkerInfo]:
    """Workers whose heartbeat is younger than `ttl` (of one role, if given)."""
    members = await redis.zrangebyscore(keys.workers(), time.time() - ttl, "+inf")
    pairs = [m.decode().split(":", 1) for m in members]
    if role is not None:
        pairs = [p for p in pairs if p[0] == role]
    async with redis.pipeline(transaction=False) as pipe:
        for member_role, wid in pairs:
            pipe.hgetall(keys.worker(member_role, wid))
        rows = await pipe.execute()
    out = []
    for row in rows:
        if not row:
            continue  # heartbeat expired: the worker is dead
        f = {k.decode(): v.decode() for k, v in row.items()}
        out.append(WorkerInfo(role=f.get("role", ""), id=f.get("id", ""), model=f.get("model", ""),
                              updated_at=float(f.get("updated_at", 0)), load=json.loads(f.get("load", "{}"))))
    return out


def servable_models(workers: list[WorkerInfo]) -> dict[str, dict[str, int]]:
    """model -> {stage: live worker count}, for every model that has at least one live stage worker."""
    models: dict[str, dict[str, int]] = {}
    for w in workers:
        if w.role in STAGES:
            counts = models.setdefault(w.model, dict.fromkeys(STAGES, 0))
            counts[w.role] += 1
    return models


def complete(counts: dict[str, int]) -> bool:
    return all(counts.get(stage, 0) > 0 for stage in STAGES)


def model_state(counts: dict[str, int]) -> str:
    """`ready` (a live worker in every stage), `scaled_to_zero` (none in any) or `partial` (some stages
    have workers: starting up, or scaling down)."""
    if complete(counts):
        return "ready"
    return "partial" if any(counts.get(stage, 0) for stage in STAGES) else "scaled_to_zero"


async def declared_models(redis: Redis, keys: Keys) -> dict[str, dict]:
    """model -> what its stages declared of it, merged (a scheduler's word first, as for live workers)."""
    raw = await redis.hgetall(keys.models())
    by_model: dict[str, list[tuple[str, dict]]] = {}
    for field_, value in raw.items():
        role, _, model = (field_.decode() if isinstance(field_, bytes) else field_).partition(":")
        try:
            card = json.loads(value)
        except ValueError:
            card = {}  # a hand-written declaration: the model is known, its card empty
        by_model.setdefault(model, []).append((role, card if isinstance(card, dict) else {}))
    out: dict[str, dict] = {}
    for model, cards in by_model.items():
        info: dict = {}
        for _, card in sorted(cards, key=lambda rc: rc[0] != "scheduler"):
            info = {**card, **info}
        out[model] = info
    return out
