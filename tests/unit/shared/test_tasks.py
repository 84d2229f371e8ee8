"""shared/tasks.py: `unless_set` around a real blocked read (a redis-server), `stop_task`."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from shared.redis_conn import connect
from shared.tasks import stop_task, unless_set


async def test_a_blocked_read_ends_with_the_default_once_the_event_is_set(redis_server):
    redis, key, stopping = connect(redis_server.url), f"t{uuid.uuid4().hex[:6]}", asyncio.Event()
    try:
        asyncio.get_running_loop().call_later(0.05, stopping.set)
        began = time.monotonic()
        got = await unless_set(redis.xread({key: "$"}, block=30_000), stopping, default=[])
        assert got == [] and time.monotonic() - began < 10  # not the block's 30 s
        await redis.xadd(key, {"a": "1"})  # the client reads and writes on as before
        assert len(await redis.xread({key: "0-0"}, block=1000)) == 1
    finally:
        await redis.aclose()


async def test_the_works_result_or_its_error_when_it_ends_first():
    event = asyncio.Event()

    async def value() -> int:
        return 7

    async def failing() -> int:
        raise ValueError("boom")

    assert await unless_set(value(), event, default=0) == 7
    with pytest.raises(ValueError, match="boom"):
        await unless_set(failing(), event, default=0)
    event.set()
    assert await unless_set(asyncio.Event().wait(), event, default="stopped") == "stopped"


async def test_stop_task_cancels_again_a_task_that_swallowed_the_first_cancellation():
    started, swallowed = asyncio.Event(), asyncio.Event()

    async def stubborn() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            swallowed.set()  # as Python 3.11's wait_for can
        await asyncio.Event().wait()

    task = asyncio.ensure_future(stubborn())
    await started.wait()
    await stop_task(task, patience_s=0.05)
    assert swallowed.is_set() and task.cancelled()
