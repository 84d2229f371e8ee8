"""services/tokenizer/holding.py against a real redis-server: past --fair-max-held a tenant's excess is parked in
Redis (its tokenize entries acknowledged) and read back in its turns, and another tenant is never queued behind
it; parked jobs read back by a tokenizer that dies are claimed by a peer, and none is lost or sent twice."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from services.tokenizer.main import TokenizerWorker
from shared import queued
from shared.messages import SamplingParams, ScheduleJob, TokenizeJob, decode, encode
from shared.settings import TokenizerSettings
from shared.streams import FIELD

pytestmark = pytest.mark.timeout(60)


def tokenizer(url: str, namespace: str, name: str, model_dir) -> TokenizerWorker:
    settings = TokenizerSettings(redis_url=url, namespace=namespace, worker_id=name, claim_idle_ms=100,
                                 fair_watermark=2, fair_max_held=3)
    return TokenizerWorker(settings, str(model_dir), "demo")


@pytest.fixture
async def pair(redis_server, random_model_dir):
    ns = f"t{uuid.uuid4().hex[:8]}"
    ws = [tokenizer(redis_server.url, ns, name, random_model_dir) for name in ("t1", "t2")]
    await ws[0].source.ensure_group()
    await ws[0].redis.xgroup_create(ws[0].keys.schedule("demo"), "scheduler", id="0", mkstream=True)
    yield ws
    for w in ws:
        await w.close()


def of(tenant: str, uid: str) -> TokenizeJob:
    return TokenizeJob(uid=uid, model="demo", pod="p", created_at=time.time(), deadline=time.time() + 60,
                       params=SamplingParams(max_tokens=4), prompt="hello", tenant=tenant)


async def deliver(w: TokenizerWorker, *jobs: TokenizeJob) -> None:
    for j in jobs:
        await w.redis.xadd(w.source.key, {FIELD: encode(j)})
    resp = await w.redis.xreadgroup(w.group, w.id, {w.source.key: ">"}, count=len(jobs))
    await w._deliver([(eid.decode(), f) for eid, f in resp[0][1]], claimed=False)


async def scheduled(w: TokenizerWorker) -> list[str]:
    """What a scheduler takes now from the schedule stream (read: no longer backlog)."""
    resp = await w.redis.xreadgroup("scheduler", "s1", {w.keys.schedule("demo"): ">"}, count=100)
    return [decode(f[FIELD], ScheduleJob).uid for _, f in (resp[0][1] if resp else [])]


async def run_until(w: TokenizerWorker, count: int) -> list[str]:
    """The releaser's steps, every periodic part due at each, and a scheduler taking what they send, until `count`
    jobs were taken and a few steps more (the drained streams end)."""
    out: list[str] = []
    deadline, extra = time.monotonic() + 10, 3
    while extra:
        assert time.monotonic() < deadline, f"only {out} taken"
        w.fair._last.clear()
        await w.fair.step()
        out += await scheduled(w)
        extra -= len(out) >= count
        await asyncio.sleep(0.02)
    return out


async def test_a_flood_past_the_cap_is_parked_and_the_other_tenant_goes_in_its_turn(pair):
    w = pair[0]
    await deliver(w, *(of("a", f"a{i}") for i in range(8)))
    await deliver(w, of("b", "b0"))
    assert w.fair.queue.tenants() == {"a": 3, "b": 1}  # a's share past the cap: the rest parked, b still held
    assert (await w.redis.xpending(w.source.key, w.group))["pending"] == 4  # parked ones acknowledged
    assert await w.redis.xlen(w.keys.parked("demo", "a")) == 5
    assert await w.redis.smembers(w.keys.parked_tenants("demo")) == {b"a"}
    order = await run_until(w, 9)
    assert order.index("b0") <= 1  # its turn: after one of a's at most, not after a's 8
    assert [u for u in order if u != "b0"] == [f"a{i}" for i in range(8)]  # a's first in, first out
    assert not await w.redis.exists(w.keys.parked("demo", "a"), w.keys.parked_tenants("demo"))  # drained: ended
    assert (await w.redis.xpending(w.source.key, w.group))["pending"] == 0 and len(w.fair.queue) == 0


async def test_a_tenant_with_jobs_parked_parks_its_next_ones_behind_them(pair):
    w = pair[0]
    await deliver(w, *(of("a", f"a{i}") for i in range(4)))
    w.fair._last.clear()
    await w.fair.step()  # two released: room in the hold
    await deliver(w, of("a", "a4"))  # yet a's parked job goes first
    assert await w.redis.xlen(w.keys.parked("demo", "a")) == 2
    assert await scheduled(w) + await run_until(w, 3) == [f"a{i}" for i in range(5)]


async def test_parked_jobs_a_dead_tokenizer_read_back_are_released_once_by_a_peer(pair):
    dead, peer = pair
    await deliver(dead, *(of("a", f"a{i}") for i in range(7)))
    first: list[str] = []
    for taken in (True, False, False):  # the schedulers stop taking: the last step only reads parked jobs back
        dead.fair._last.clear()
        await dead.fair.step()
        first += await scheduled(dead) if taken else []
    read_back = [h.job.uid for h in dead.fair.queue.items() if "/" in h.entry_id]
    assert first == ["a0", "a1"] and read_back == ["a4", "a5"]  # pending to it: then it dies
    rest = await run_until(peer, 5)  # claimed once idle past --claim-idle-ms
    assert sorted(first + rest) == [f"a{i}" for i in range(7)]  # every one, once (a6 may overtake those claimed)
    assert not await peer.redis.exists(peer.keys.parked("demo", "a"), peer.keys.parked_tenants("demo"))
    assert (await peer.redis.xpending(peer.source.key, peer.group))["pending"] == 0


async def test_on_a_redis_cluster_parking_reading_back_and_the_queue_count_name_keys_of_one_slot(redis_cluster,
                                                                                                  random_model_dir):
    """Every multi-key command of parking (the read's pipeline, the reads back, the end script) and the queue's
    scripts work on a real cluster: their keys share the slot of the model's tokenize stream."""
    w = tokenizer(redis_cluster.url, f"c{uuid.uuid4().hex[:6]}", "t1", random_model_dir)
    try:
        await w.source.ensure_group()
        await w.redis.xgroup_create(w.keys.schedule("demo"), "scheduler", id="0", mkstream=True)
        jobs = [of("a", f"a{i}") for i in range(5)]
        assert (await queued.enter(w.redis, w.keys, jobs, 30)).admitted
        await deliver(w, *jobs)
        assert w.fair.queue.tenants() == {"a": 3} and await w.redis.xlen(w.keys.parked("demo", "a")) == 2
        assert await run_until(w, 5) == [f"a{i}" for i in range(5)]
        assert not await w.redis.exists(w.keys.parked("demo", "a"))
        await queued.leave(w.redis, w.keys, "demo", queued.members(jobs))  # as the scheduler's admission does
        assert await queued.figures(w.redis, w.keys, "demo") == queued.Figures({}, {})
    finally:
        await w.close()
