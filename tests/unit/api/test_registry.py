"""The API's registry against a real redis-server: a model declared by its stage workers (or by `--models`)
stays known with its card when no worker is left, its groups exist before any worker, and its backlog
counts the requests waiting for one."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

from services.api.operations.registry import StageRegistry
from shared import streams
from shared.heartbeats import Beating, Heartbeat
from shared.keys import STAGES, Keys
from shared.redis_conn import connect

NONE = dict.fromkeys(STAGES, 0)


async def test_a_declared_model_outlives_its_workers(redis_server):
    redis, keys = connect(redis_server.url), Keys(f"reg{uuid.uuid4().hex[:6]}")
    card = {"root": "/models/m", "max_model_len": 4096, "reasoning_parser": "qwen3", "tool_call_parser": "hermes"}
    beat = Heartbeat(redis, keys, Beating("tokenizer", "tok@1", "m", 1.0, 5.0), lambda: {}, card=lambda: card)
    try:
        await beat.beat()
        registry = StageRegistry(redis, keys, heartbeat_ttl=5.0)
        snap = await registry.refresh()
        assert snap.models == {"m": {**NONE, "tokenizer": 1}}
        assert snap.model_card("m")["state"] == "partial" and snap.servable() == []

        await beat.stop()  # the worker is gone: its heartbeat with it, not its declaration
        snap = await registry.refresh()
        assert snap.workers == [] and snap.models == {"m": NONE} and snap.ready()
        model = snap.model_card("m")
        assert (model["state"], model["workers"], model["root"], model["max_model_len"]) == (
            "scaled_to_zero", NONE, "/models/m", 4096)
        assert snap.model_info("m")["reasoning_parser"] == "qwen3", "chat answers are split as the tokenizer said"

        groups = {stage: await redis.xinfo_groups(keys.stage_stream(stage, "m")) for stage in STAGES}
        assert {s: [g["name"].decode() for g in gs] for s, gs in groups.items()} == {s: [s] for s in STAGES}
        for _ in range(3):
            await streams.add_fields(redis, keys.tokenize("m"), {"data": "{}"})
        assert (await registry.refresh()).queued("m") == 3, "waiting for a tokenizer that is not there yet"
    finally:
        await redis.delete(keys.models(), *(keys.stage_stream(s, "m") for s in STAGES))
        await redis.aclose()


async def test_models_the_api_is_told_of_are_known_without_any_declaration(redis_server):
    redis, keys = connect(redis_server.url), Keys(f"reg{uuid.uuid4().hex[:6]}")
    try:
        snap = await StageRegistry(redis, keys, 5.0, configured=("a", "b")).refresh()
        assert snap.known() == ["a", "b"] and snap.models == {"a": NONE, "b": NONE}
        assert snap.model_card("a") | {"created": 0} == {
            "id": "a", "object": "model", "created": 0, "owned_by": "rsinfer", "root": "a", "parent": None,
            "max_model_len": None, "state": "scaled_to_zero", "workers": NONE}
        assert "c" not in snap.models
    finally:
        await redis.delete(*(keys.stage_stream(s, m) for s in STAGES for m in "ab"))
        await redis.aclose()


async def test_stop_ends_the_refresh_loop_whose_refresh_swallowed_the_cancellation():
    """Python 3.11's asyncio.wait_for (redis-py's send, under a socket timeout) returns its result when it is
    cancelled as its command completes: the refresh goes on and the loop sleeps again. Stopping must still end
    it: the API's close waited for it for ever, and a start that failed never exited (a worker of
    tests/e2e/test_api_workers.py whose control socket was refused hung after `api ready`)."""
    registry, refreshing, swallowed = StageRegistry(None, Keys("reg"), 5.0, refresh_s=60), asyncio.Event(), []

    async def refresh():
        if not swallowed:  # the first one swallows the cancellation, as wait_for can
            refreshing.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()  # a command in flight until cancelled
            swallowed.append(True)
        return registry.snapshot

    registry.refresh, registry.refresh_s = refresh, 0
    registry.start()
    await asyncio.wait_for(refreshing.wait(), 10)
    registry.refresh_s = 60
    stopping = asyncio.create_task(registry.stop())
    done, _ = await asyncio.wait({stopping}, timeout=20)  # not a timeout around it: stop() ate that too
    registry._task.cancel()
    assert swallowed and done == {stopping} and registry._task.done()

