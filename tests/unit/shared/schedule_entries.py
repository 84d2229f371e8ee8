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
