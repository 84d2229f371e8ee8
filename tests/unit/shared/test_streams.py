"""The stream wrapper against a real redis-server: backlog, dead letters, claims, trimming."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from shared import streams
from shared.keys import Keys
from shared.messages import SamplingParams, ScheduleJob
from shared.redis_conn import connect
from shared.streams import GroupConsumer

pytestmark = pytest.mark.timeout(30)


def job(uid: str) -> ScheduleJob:
    return ScheduleJob(uid=uid, model="m", pod="p", created_at=0.0, deadline=1.0, params=SamplingParams(),
                       input_ids=[1, 2])


@pytest.fixture
async def env(redis_server):
    redis = connect(redis_server.url)
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    yield redis, keys
    await redis.aclose()


def consumer(redis, keys, name):
    return GroupConsumer(redis, keys.schedule("m"), "scheduler", name, ScheduleJob, keys.dead())


async def test_backlog_written_before_the_group_is_read(env):
    redis, keys = env
    for i in range(3):
        await streams.add(redis, keys.schedule("m"), job(f"u{i}"))
    c = consumer(redis, keys, "a")
    await c.ensure_group()
    await c.ensure_group()  # idempotent
    got = await c.read(10, None)
    assert [d.msg.uid for d in got] == ["u0", "u1", "u2"]
    raw = await redis.xrange(keys.schedule("m"))
    assert b'"kind":"schedule"' in raw[0][1][b"data"]  # legible JSON for redis-cli


async def test_poison_goes_to_dead_letter_and_is_acked(env):
    redis, keys = env
    c = consumer(redis, keys, "a")
    await c.ensure_group()
    await redis.xadd(keys.schedule("m"), {"data": b"{oops"})
    await redis.xadd(keys.schedule("m"), {"data": b'{"kind": "schedule", "uid": 5}'})
    await streams.add(redis, keys.schedule("m"), job("good"))
    got = await c.read(10, None)
    assert [d.msg.uid for d in got] == ["good"]
    dead = await redis.xrange(keys.dead())
    assert len(dead) == 2 and b"DecodeError" in dead[0][1][b"error"] and dead[0][1][b"raw_data"] == b"{oops"
    assert (await redis.xpending(keys.schedule("m"), "scheduler"))["pending"] == 1  # only the good one


async def test_claim_takes_a_dead_consumers_entries(env):
    redis, keys = env
    dead, peer = consumer(redis, keys, "dead"), consumer(redis, keys, "peer")
    await dead.ensure_group()
    await streams.add(redis, keys.schedule("m"), job("x"))
    assert len(await dead.read(10, None)) == 1
    assert await peer.claim(min_idle_ms=60_000, count=10) == []
    await asyncio.sleep(0.15)
    claimed = await peer.claim(min_idle_ms=100, count=10)
    assert [d.msg.uid for d in claimed] == ["x"]
    assert await peer.pending_ids() == [claimed[0].entry_id]


async def test_hand_back_makes_entries_claimable_at_once(env):
    redis, keys = env
    leaving, peer = consumer(redis, keys, "leaving"), consumer(redis, keys, "peer")
    await leaving.ensure_group()
    await streams.add(redis, keys.schedule("m"), job("y"))
    got = await leaving.read(10, None)
    await leaving.hand_back([got[0].entry_id], "handoff")
    assert [d.msg.uid for d in await peer.claim(min_idle_ms=10_000, count=10)] == ["y"]


async def test_trim_keeps_what_is_pending(env):
    redis, keys = env
    c = consumer(redis, keys, "a")
    await c.ensure_group()
    for i in range(300):
        await streams.add(redis, keys.schedule("m"), job(f"u{i}"))
    got = await c.read(300, None)
    await c.ack([d.entry_id for d in got[:250]])
    await c.trim_acknowledged()
    remaining = [e[0].decode() for e in await redis.xrange(keys.schedule("m"))]
    assert all(d.entry_id in remaining for d in got[250:])  # pending entries survive
    assert len(remaining) < 300
