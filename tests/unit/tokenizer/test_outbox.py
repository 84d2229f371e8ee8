"""services/tokenizer/outbox.py against a real redis-server: the one writer turns a read's effects into its
records, schedule and parked entries and acknowledgement, in one pipeline; ends drained parked streams; and makes
no round trip when nothing is to be written."""

from __future__ import annotations

import time
import uuid

import pytest

from services.tokenizer.main import TokenizerWorker
from services.tokenizer.outbox import (
    Ack,
    Answered,
    Barrier,
    EndParked,
    EndTimedOut,
    Forward,
    LeaveQueue,
    Park,
    QueryAborted,
    Tokenized,
)
from shared.messages import ReplyError, SamplingParams, ScheduleJob, TokenizeJob, TokenizerAnswer, decode, encode
from shared.settings import TokenizerSettings
from shared.streams import FIELD

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def worker(redis_server, random_model_dir):
    settings = TokenizerSettings(redis_url=redis_server.url, namespace=f"t{uuid.uuid4().hex[:8]}", worker_id="t1")
    w = TokenizerWorker(settings, str(random_model_dir), "demo")
    await w.source.ensure_group()
    yield w
    await w.close()


def scheduled(uid: str, tenant: str = "") -> ScheduleJob:
    return ScheduleJob(uid=uid, model="demo", pod="p", created_at=time.time(), deadline=time.time() + 60,
                       params=SamplingParams(max_tokens=4), input_ids=[1, 2], tenant=tenant)


async def uids(w: TokenizerWorker, key: str) -> list[str]:
    return [decode(f[FIELD], ScheduleJob).uid for _, f in await w.redis.xrange(key)]


async def test_a_read_s_effects_are_written_and_its_entries_acknowledged_in_one_pipeline(worker):
    w = worker
    for u in ("shared", "routed", "parked"):
        await w.redis.xadd(w.source.key, {FIELD: encode(TokenizeJob(
            uid=u, model="demo", pod="p", created_at=0, deadline=time.time() + 60, params=SamplingParams()))})
    read = await w.redis.xreadgroup(w.group, w.id, {w.source.key: ">"}, count=3)
    entries = [eid.decode() for eid, _ in read[0][1]]
    results = await w.outbox.send([
        Tokenized("shared", 2, None), Tokenized("routed", 2, 4), Barrier(), Forward(scheduled("shared"), None),
        Forward(scheduled("routed"), "s1"), Park(scheduled("parked", tenant="a")), LeaveQueue(["x a"]), Ack(entries)])
    assert results and not any(isinstance(r, Exception) for r in results)
    assert await w.redis.hget(w.keys.request("routed"), "status") == b"tokenized"
    assert await w.redis.hget(w.keys.request("routed"), "max_tokens") == b"4"
    assert not await w.redis.hexists(w.keys.request("shared"), "max_tokens")  # omitted: the scheduler's to resolve
    assert await uids(w, w.keys.schedule("demo")) == ["shared"]
    assert await uids(w, w.keys.scheduler_stream("demo", "s1")) == ["routed"]
    assert await w.redis.smembers(w.keys.routed("demo")) == {b"s1"}
    assert await uids(w, w.keys.parked("demo", "a")) == ["parked"]
    assert await w.redis.smembers(w.keys.parked_tenants("demo")) == {b"a"}
    assert (await w.redis.xpending(w.source.key, w.group))["pending"] == 0


async def test_a_query_s_end_is_its_reply_and_its_record(worker):
    w = worker
    await w.outbox.send([Answered("q", TokenizerAnswer(tokens=[1, 2], count=2), 2), QueryAborted("gone", "client"),
                         EndTimedOut("late")])
    (answer,) = [decode(f[FIELD], TokenizerAnswer) for _, f in await w.redis.xrange(w.keys.reply("q"))]
    assert answer.count == 2 and await w.redis.hget(w.keys.request("q"), "status") == b"finished"
    assert await w.redis.hget(w.keys.request("gone"), "error") == b"aborted: client"
    assert not await w.redis.exists(w.keys.reply("gone"))  # nobody reads it
    (late,) = [decode(f[FIELD], ReplyError) for _, f in await w.redis.xrange(w.keys.reply("late"))]
    assert late.status == 504


async def test_nothing_to_write_makes_no_round_trip(worker):
    w = worker
    await w.redis.aclose()  # a command now would fail
    assert await w.outbox.send([Ack([]), LeaveQueue([])]) == []


async def test_a_parked_stream_ends_only_once_drained(worker):
    w = worker
    await w.outbox.send([Park(scheduled("p1", tenant="a")), Park(scheduled("p2", tenant="b"))])
    await w.redis.xgroup_create(w.keys.parked("demo", "a"), w.group, id="$")  # a's entry already read back
    await w.redis.xgroup_create(w.keys.parked("demo", "b"), w.group, id="0")  # b's still undelivered
    assert await w.outbox.send([EndParked("a"), EndParked("b")]) == [1, 0]
    assert not await w.redis.exists(w.keys.parked("demo", "a"))
    assert await w.redis.smembers(w.keys.parked_tenants("demo")) == {b"b"}
