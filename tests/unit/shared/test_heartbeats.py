"""A worker's heartbeat (shared/heartbeats.py) against a real redis-server: its stop."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

from redis.exceptions import ConnectionError as RedisConnectionError

from shared.heartbeats import Beating, Heartbeat
from shared.keys import Keys
from shared.redis_conn import connect
from tests.support.helpers import async_wait_for


async def test_a_heartbeat_stopped_during_a_beat_that_swallowed_the_cancellation_ends_at_once(redis_server):
    """Python 3.11's asyncio.wait_for (redis-py's send, under a socket timeout) returns its result when it is
    cancelled as its command completes. A heartbeat stopped during such a beat (its first one is under way when
    an API whose start failed closes at once) ends there, rather than sleeping until `stop` cancels it again
    2 s later."""
    redis, keys, swallowed = connect(redis_server.url), Keys(f"hb{uuid.uuid4().hex[:6]}"), asyncio.Event()
    beat = Heartbeat(redis, keys, Beating("api", "api@1", "", 60.0, 120.0), lambda: {})
    real, beating = beat.beat, asyncio.Event()

    async def swallowing_beat():
        if swallowed.is_set():
            return await real()
        beating.set()
        with contextlib.suppress(asyncio.CancelledError):  # as Python 3.11's wait_for can
            await asyncio.Event().wait()  # a command in flight until cancelled
        swallowed.set()
        await real()

    beat.beat = swallowing_beat
    beat.start()
    await asyncio.wait_for(beating.wait(), 10)
    try:
        await beat.stop()
        assert swallowed.is_set() and beat._task.done() and not beat._task.cancelled(), "ended by the 2nd cancel"
        assert not await redis.exists(beat.key), "its key goes with it"
    finally:
        await redis.aclose()


async def test_a_failed_beat_is_retried_at_once_not_an_interval_later(redis_server):
    """A Redis restart can outlast a heartbeat's TTL; the worker must look alive again as soon as Redis is back,
    not up to an interval later (schedulers would end its requests meanwhile). Beats every 60 s here: after three
    failed beats, the fourth lands within the retries' 0.1 + 0.2 + 0.4 s."""
    redis, keys = connect(redis_server.url), Keys(f"hb{uuid.uuid4().hex[:6]}")
    beat = Heartbeat(redis, keys, Beating("api", "api@1", "", 60.0, 120.0), lambda: {})
    real, failures = beat.beat, []

    async def failing_beat():
        if len(failures) < 3:
            failures.append(asyncio.get_running_loop().time())
            raise RedisConnectionError("Connection refused")
        await real()

    beat.beat = failing_beat
    beat.start()
    try:
        await async_wait_for(lambda: redis.exists(beat.key), timeout=10)
        assert len(failures) == 3
    finally:
        await beat.stop()
        await redis.aclose()
