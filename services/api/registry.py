"""What the API knows of the stages: live workers per model (from heartbeats) and each stage's backlog
(from XINFO GROUPS), refreshed in the background so requests never wait on it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from shared.keys import STAGES, Keys
from shared.registry import WorkerInfo, complete, live_workers, servable_models

log = logging.getLogger(__name__)


@dataclass
class StageBacklog:
    lag: int = 0  # entries not yet delivered to the group
    pending: int = 0  # delivered, not yet acknowledged


@dataclass
class Snapshot:
    at: float = 0.0
    redis_ok: bool = False
    workers: list[WorkerInfo] = field(default_factory=list)
    models: dict[str, dict[str, int]] = field(default_factory=dict)
    backlog: dict[str, dict[str, StageBacklog]] = field(default_factory=dict)

    def ready(self) -> bool:
        return self.redis_ok and bool(self.models) and all(complete(c) for c in self.models.values())

    def servable(self) -> list[str]:
        """Models with a live worker in every stage, sorted."""
        return sorted(m for m, counts in self.models.items() if complete(counts))

    def model_info(self, model: str) -> dict:
        """What the stage workers of a model report of it (schedulers first): `root`, `max_model_len`, and
        from tokenizers the answer formats `tool_call_parser` and `reasoning_parser`."""
        info: dict = {}
        for w in sorted(self.workers, key=lambda w: w.role != "scheduler"):
            if w.model == model:
                info = {**w.load.get("model_info", {}), **info}
        return info

    def model_card(self, model: str) -> dict:
        """OpenAI's Model object, plus what vLLM and SGLang clients read: `max_model_len`, `root`, `parent`.
        Workers report the model's context and checkpoint in their heartbeats."""
        info = self.model_info(model)
        return {"id": model, "object": "model", "created": int(self.at), "owned_by": "rsinfer",
                "root": info.get("root", model), "parent": None, "max_model_len": info.get("max_model_len")}

    def queued(self, model: str) -> int:
        """Requests of a model not yet running: at or waiting for a tokenizer, or waiting for room in a
        scheduler (schedule entries stay pending while they run, so only their lag counts)."""
        b = self.backlog.get(model, {})
        tok, sched = b.get("tokenizer", StageBacklog()), b.get("scheduler", StageBacklog())
        return tok.lag + tok.pending + sched.lag


class StageRegistry:
    def __init__(self, redis: Redis, keys: Keys, heartbeat_ttl: float, refresh_s: float = 1.0):
        self.redis, self.keys, self.ttl, self.refresh_s = redis, keys, heartbeat_ttl, refresh_s
        self.snapshot = Snapshot()
        self._task: asyncio.Task | None = None

    async def refresh(self) -> Snapshot:
        try:
            workers = await live_workers(self.redis, self.keys, self.ttl)
            models = servable_models(workers)
            backlog = {m: await self._backlog(m) for m in models}
            self.snapshot = Snapshot(time.time(), True, workers, models, backlog)
        except (RedisError, OSError) as e:
            log.warning("stage registry refresh failed: %s", e)
            self.snapshot = Snapshot(time.time(), False)
        return self.snapshot

    async def _backlog(self, model: str) -> dict[str, StageBacklog]:
        out = {}
        for stage in STAGES:
            try:
                groups = await self.redis.xinfo_groups(self.keys.stage_stream(stage, model))
            except ResponseError:
                continue
            for g in groups:
                name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
                if name == stage:
                    out[stage] = StageBacklog(int(g.get("lag") or 0), int(g.get("pending") or 0))
        return out

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="stage-registry")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
