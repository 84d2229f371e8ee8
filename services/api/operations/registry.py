"""What the API knows of the stages: the models it serves (declared, or with live workers), live workers per
model (from heartbeats) and each stage's backlog (from XINFO GROUPS), refreshed in the background so
requests never wait on it.

A model is known while it is declared (the API's `--models`, or a stage worker's declaration in Redis) even
with no worker in any stage: its requests wait in its streams, within their deadlines, for workers to
appear (scale from zero)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from shared import streams
from shared.heartbeats import WorkerInfo, complete, declared_models, live_workers, model_state, servable_models
from shared.keys import STAGES, Keys
from shared.messages import DetokenizeBatch, ScheduleJob, TokenizeJob
from shared.request_store import prune_inflight
from shared.tasks import stop_task

log = logging.getLogger(__name__)

STAGE_MESSAGES = {"tokenizer": TokenizeJob, "scheduler": ScheduleJob, "detokenizer": DetokenizeBatch}


@dataclass
class StageBacklog:
    lag: int = 0  # entries not yet delivered to the group
    pending: int = 0  # delivered, not yet acknowledged


@dataclass
class Snapshot:
    at: float = 0.0
    redis_ok: bool = False
    workers: list[WorkerInfo] = field(default_factory=list)
    models: dict[str, dict[str, int]] = field(default_factory=dict)  # every known model: live workers per stage
    backlog: dict[str, dict[str, StageBacklog]] = field(default_factory=dict)
    declared: dict[str, dict] = field(default_factory=dict)  # what stages declared of each model
    counted: dict[str, int] = field(default_factory=dict)  # each model's queue count (shared/queued.py)

    def ready(self) -> bool:
        """The API can take requests: Redis answers. Workers are not needed (requests wait for them)."""
        return self.redis_ok

    def servable(self) -> list[str]:
        """Models with a live worker in every stage, sorted."""
        return sorted(m for m, counts in self.models.items() if complete(counts))

    def known(self) -> list[str]:
        """Every model requests are accepted for, with workers or not, sorted."""
        return sorted(self.models)

    def model_info(self, model: str) -> dict:
        """What the stage workers of a model report of it (schedulers first): `root`, `max_model_len`, and
        from tokenizers the answer formats `tool_call_parser` and `reasoning_parser`; what its stages
        declared when none is live."""
        info: dict = {}
        for w in sorted(self.workers, key=lambda w: w.role != "scheduler"):
            if w.model == model:
                info = {**w.load.get("model_info", {}), **info}
        return {**self.declared.get(model, {}), **info}

    def model_card(self, model: str) -> dict:
        """OpenAI's Model object, plus what vLLM and SGLang clients read: `max_model_len`, `root`, `parent`,
        and `state` (`ready`, `partial`, `scaled_to_zero`) with the live `workers` per stage."""
        info = self.model_info(model)
        counts = self.models.get(model, dict.fromkeys(STAGES, 0))
        return {"id": model, "object": "model", "created": int(self.at), "owned_by": "rsinfer",
                "root": info.get("root", model), "parent": None, "max_model_len": info.get("max_model_len"),
                "state": model_state(counts), "workers": counts}

    def queued(self, model: str) -> int:
        """Requests of a model not yet running: at or waiting for a tokenizer, or waiting for room in a
        scheduler (schedule entries stay pending while they run, so only their lag counts); or, if more, its
        queue count, which also counts the jobs fair queueing parked."""
        b = self.backlog.get(model, {})
        tok, sched = b.get("tokenizer", StageBacklog()), b.get("scheduler", StageBacklog())
        return max(tok.lag + tok.pending + sched.lag, self.counted.get(model, 0))


class StageRegistry:
    def __init__(self, redis: Redis, keys: Keys, heartbeat_ttl: float, configured: Sequence[str] = (),
                 refresh_s: float = 1.0):
        self.redis, self.keys, self.ttl, self.refresh_s = redis, keys, heartbeat_ttl, refresh_s
        self.configured = tuple(configured)  # --models: known even if no worker ever declared them
        self.snapshot = Snapshot()
        self._task: asyncio.Task | None = None

    async def refresh(self) -> Snapshot:
        try:
            workers = await live_workers(self.redis, self.keys, self.ttl)
            declared = await declared_models(self.redis, self.keys)
            live = servable_models(workers)
            models = {m: live.get(m, dict.fromkeys(STAGES, 0)) for m in {*self.configured, *declared, *live}}
            backlog = {m: await self._backlog(m) for m in models}
            counted = {m: int(await self.redis.zcard(self.keys.queued(m))) for m in models}
            await prune_inflight(self.redis, self.keys)  # once a second here, never per request
            self.snapshot = Snapshot(time.time(), True, workers, models, backlog, declared, counted)
        except (RedisError, OSError) as e:
            log.warning("stage registry refresh failed: %s", e)
            self.snapshot = Snapshot(time.time(), False)
        return self.snapshot

    async def _backlog(self, model: str) -> dict[str, StageBacklog]:
        out = {}
        for stage in STAGES:
            key = self.keys.stage_stream(stage, model)
            try:
                groups = await streams.groups(self.redis, key)
            except ResponseError:  # no such key: no request and no worker yet
                groups = []
            for g in groups:
                name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
                if name == stage:
                    out[stage] = StageBacklog(int(g.get("lag") or 0), int(g.get("pending") or 0))
            if stage not in out:
                try:
                    out[stage] = await self._make_group(key, stage)
                except ResponseError as e:  # not a stream (an operator's key?): no backlog to count
                    log.warning("cannot make group %s of %s: %s", stage, key, e)
        return out

    async def _make_group(self, key: str, stage: str) -> StageBacklog:
        """A model with no worker in a stage yet: create the stage's group at 0, as its first worker would,
        so that its lag counts the requests waiting for that worker (the 429 limit, KEDA's activation) and
        its pending list exists (KEDA's in-flight trigger). Before the group, lag is the stream's length."""
        await streams.create_group(self.redis, key, stage, mkstream=True)
        return StageBacklog(await streams.length(self.redis, key), 0)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="stage-registry")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()
            if asyncio.current_task().cancelling():  # stopped, but a Redis call of the refresh swallowed it
                return

    async def stop(self) -> None:
        if self._task:  # a refresh can swallow the cancellation (shared/worker.py stop_task): never wait for ever
            await stop_task(self._task)
