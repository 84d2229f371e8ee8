"""The detokenize stream's length cap (issue 18 item 1): the scheduler XADDs with MAXLEN ~ the byte budget
(--detokenize-budget-mb) over the mean entry size, so however large a step's entries are, no reader being
slow can grow the stream past roughly that budget. Against a real redis-server: nothing reads the stream."""

from __future__ import annotations

import asyncio

import pytest

from services.scheduler.effects import MIN_DETOKENIZE_MAXLEN, EffectWriter, Publish
from services.scheduler.lanes import SchedulerLanes
from shared.consumer_group import GroupConsumer
from shared.keys import Keys
from shared.messages import ScheduleJob, TokenDelta
from shared.redis_conn import connect
from shared.request_store import RequestStore
from shared.streams import Member

pytestmark = pytest.mark.timeout(60)


def writer_for(redis, keys: Keys, budget_mb: float) -> EffectWriter:
    source = GroupConsumer(redis, keys.schedule("m"), Member("scheduler", "s1"), ScheduleJob, keys.dead())
    lanes = SchedulerLanes(redis, keys, "m", source, page_size=16, heartbeat_ttl_s=5)
    return EffectWriter(RequestStore(redis, keys, ttl=60, maxlen=100), source, lanes, "s1", keys.detokenize("m"),
                        detokenize_budget_mb=budget_mb)


async def publish_steps(writer: EffectWriter, redis, steps: int, ids_per_delta: int) -> None:
    deltas = [TokenDelta(uid=f"u{i}", start=0, ids=list(range(ids_per_delta)), prompt_tokens=1) for i in range(4)]
    for base in range(0, steps, 100):
        pipe = redis.pipeline(transaction=False)
        for step in range(base, min(steps, base + 100)):
            writer.publish(pipe, Publish(deltas, step))
        await pipe.execute()


def test_large_entries_are_capped_near_the_byte_budget(redis_server):
    async def run():
        keys = Keys("cap1")
        redis = connect(redis_server.url)
        try:
            # ~5 KiB entries, 16 MiB budget: MAXLEN ~ 3,300 of the 6,000 steps published
            writer = writer_for(redis, keys, budget_mb=16)
            await publish_steps(writer, redis, 6000, ids_per_delta=300)
            cap = int(16 * 2**20 / writer.entry_bytes)
            length = await redis.xlen(keys.detokenize("m"))
            assert MIN_DETOKENIZE_MAXLEN < cap < 5000
            assert cap <= length <= cap * 1.1  # MAXLEN ~ trims whole nodes only: a little more is kept
            assert (await redis.memory_usage(keys.detokenize("m"))) < 16 * 2**20 * 1.3
        finally:
            await redis.aclose()

    asyncio.run(run())


def test_a_floor_of_steps_is_kept_however_large_the_entries(redis_server):
    async def run():
        keys = Keys("cap3")
        redis = connect(redis_server.url)
        try:
            writer = writer_for(redis, keys, budget_mb=1)  # ~5 KiB entries: 1 MiB would be ~200 of them
            await publish_steps(writer, redis, 3000, ids_per_delta=300)
            length = await redis.xlen(keys.detokenize("m"))
            assert MIN_DETOKENIZE_MAXLEN <= length <= MIN_DETOKENIZE_MAXLEN * 1.1
        finally:
            await redis.aclose()

    asyncio.run(run())


def test_small_entries_get_a_longer_stream_from_the_same_budget(redis_server):
    async def run():
        keys = Keys("cap2")
        redis = connect(redis_server.url)
        try:
            # ~250 B entries, 1 MiB budget: MAXLEN ~ 4,000, four times the floor a 5 KiB entry gets
            writer = writer_for(redis, keys, budget_mb=1)
            await publish_steps(writer, redis, 8000, ids_per_delta=1)
            cap = int(2**20 / writer.entry_bytes)
            length = await redis.xlen(keys.detokenize("m"))
            assert cap > 2 * MIN_DETOKENIZE_MAXLEN
            assert cap <= length <= cap * 1.1
        finally:
            await redis.aclose()

    asyncio.run(run())
