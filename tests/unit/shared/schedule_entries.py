"""Schedule jobs and scheduler-group consumers that the stream and consumer-group tests build alike."""

from __future__ import annotations

from shared.consumer_group import GroupConsumer
from shared.messages import SamplingParams, ScheduleJob
from shared.streams import Member


def job(uid: str) -> ScheduleJob:
    return ScheduleJob(uid=uid, model="m", pod="p", created_at=0.0, deadline=1.0, params=SamplingParams(),
                       input_ids=[1, 2])


def consumer(redis, keys, name: str) -> GroupConsumer:
    return GroupConsumer(redis, keys.schedule("m"), Member("scheduler", name), ScheduleJob, keys.dead())


async def held_idle(redis, stream: str, name: str | None, ms: int) -> bool:
    """Every entry the scheduler-group consumer `name` (None: any) holds in `stream` has been idle `ms` by Redis's
    clock, the one XAUTOCLAIM's min-idle reads: what a test waits for instead of sleeping past a claim threshold."""
    held = await redis.xpending_range(stream, "scheduler", "-", "+", 1000, consumername=name)
    return bool(held) and all(e["time_since_delivered"] >= ms for e in held)
