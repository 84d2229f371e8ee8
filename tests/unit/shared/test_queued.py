"""shared/queued.py against a real redis-server: a model's queue counted per tenant, each within its share of
--max-queued, in one script per admission; jobs leave it when a stage takes or ends them, or at their deadline."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace

import pytest
from redis.asyncio import Redis

from shared import queued
from shared.keys import Keys
from shared.messages import SamplingParams, TokenizeJob

pytestmark = pytest.mark.timeout(30)
MODEL = "m"


@asynccontextmanager
async def queue_env(url: str) -> AsyncIterator[tuple[Redis, Keys]]:
    """A plain client of the redis-server at `url` and a namespace of its own, the client closed after."""
    r = Redis.from_url(url)
    try:
        yield r, Keys(f"q{uuid.uuid4().hex[:8]}")
    finally:
        await r.aclose()


@pytest.fixture
async def q(redis_server):
    async with queue_env(redis_server.url) as pair:
        yield pair


@pytest.fixture
async def q_alone(own_redis_url):
    """`q` on a redis-server of its own, for the tests that count the commands it ran."""
    async with queue_env(own_redis_url) as pair:
        yield pair


def jobs(tenant: str, n: int = 1, weight: int = 1, timeout: float = 60.0) -> list[TokenizeJob]:
    now = time.time()
    return [TokenizeJob(uid=uuid.uuid4().hex, model=MODEL, pod="p", created_at=now, deadline=now + timeout,
                        params=SamplingParams(), tenant=tenant, weight=weight) for _ in range(n)]


async def admitted(q, tenant: str, times: int, most: int, weight: int = 1) -> list[list[str]]:
    """The members (shared/queued.py `member`) of each request admitted."""
    r, keys = q
    out = []
    for _ in range(times):
        js = jobs(tenant, weight=weight)
        if (await queued.enter(r, keys, js, most)).admitted:
            out.append(queued.members(js))
    return out


async def counts(r: Redis, keys: Keys) -> dict[str, int]:
    return (await queued.figures(r, keys, MODEL)).counts


async def test_one_tenant_alone_may_fill_the_queue_and_no_more(q):
    assert len(await admitted(q, "a", 40, most=30)) == 30
    assert await counts(*q) == {"a": 30}


async def test_a_tenant_arriving_at_a_full_queue_gets_its_share_and_the_flooder_no_more(q):
    a = await admitted(q, "a", 40, most=30)
    assert len(a) == 30
    assert len(await admitted(q, "b", 20, most=30)) == 15  # half of 30: two tenants queue
    assert len(await admitted(q, "a", 5, most=30)) == 0  # over its share, and the queue is past --max-queued
    r, keys = q
    await queued.leave(r, keys, MODEL, [u for uids in a[:20] for u in uids])  # 20 of A's taken by a scheduler
    assert await counts(r, keys) == {"a": 10, "b": 15}
    assert len(await admitted(q, "a", 10, most=30)) == 5  # within the queue's room again


async def test_concurrent_admissions_never_pass_the_limit(q):
    r, keys = q
    results = await asyncio.gather(*(queued.enter(r, keys, jobs("a"), 30) for _ in range(60)))
    assert sum(x.admitted for x in results) == 30


async def test_shares_follow_weights_and_requests_of_several_jobs_count_each(q):
    r, keys = q
    assert len(await admitted(q, "a", 40, most=40)) == 40
    assert len(await admitted(q, "b", 40, most=40, weight=3)) == 30  # 3 / (1 + 3) of 40
    assert not (await queued.enter(r, keys, jobs("c", n=11), 40)).admitted  # past its share (8) and the queue full
    got = await queued.enter(r, keys, jobs("c", n=8), 40)
    assert got.admitted and got.share == 8 and got.mine == 8  # 40 × 1 / (1 + 3 + 1)
    assert await queued.figures(r, keys, MODEL) == queued.Figures({"a": 40, "b": 30, "c": 8}, {"a": 1, "b": 3, "c": 1})


async def test_everything_leaves_the_count_and_its_keys(q):
    r, keys = q
    uids = [u for batch in await admitted(q, "a", 3, most=10) + await admitted(q, "b", 2, most=10) for u in batch]
    await queued.leave(r, keys, MODEL, [*uids, "never-queued a", uids[0]])  # one that is gone already, too
    assert await queued.figures(r, keys, MODEL) == queued.Figures({}, {})
    assert not await r.exists(keys.queued(MODEL))
    # the tenants' hash keeps only when the two keys expire, and expires then (module doc)
    assert [k.decode() for k in await r.hkeys(keys.queued_tenants(MODEL))] == ["~exp"]
    assert 0 < await r.ttl(keys.queued_tenants(MODEL)) <= 121 + queued.TTL_SLACK_S


async def test_a_job_whose_process_died_leaves_at_its_deadline(q, monkeypatch):
    r, keys = q
    assert (await queued.enter(r, keys, jobs("a", n=3, timeout=0.2), 3)).admitted
    assert not (await queued.enter(r, keys, jobs("a"), 3)).admitted
    # the clock enter() reads (and hands its script) moves past the first jobs' deadline
    monkeypatch.setattr(queued, "time", SimpleNamespace(time=lambda: time.time() + 0.3))
    got = await queued.enter(r, keys, jobs("a"), 3)
    assert got.admitted and got.total == 1 and await counts(r, keys) == {"a": 1}
    assert 60 < await r.ttl(keys.queued(MODEL)) <= 121 + queued.TTL_SLACK_S
    assert (await queued.enter(r, keys, jobs("b", timeout=0.1), 3)).admitted
    assert await r.ttl(keys.queued(MODEL)) > 60  # a shorter deadline does not shorten the keys' life


async def calls(r: Redis, *names: str) -> dict[str, int]:
    stats = await r.info("commandstats")
    return {n: stats.get(f"cmdstat_{n}", {}).get("calls", 0) for n in names}


async def test_a_request_entering_and_leaving_runs_few_commands_and_writes_a_ttl_only_when_short(q_alone):
    """Issue 34 (item 5): the fair queue's fixed cost per request. A job names its tenant (no lookup when it
    leaves), the counts and weights are one hash read once, and the keys' expiry is a field of that hash kept
    across an empty queue: an enter within it writes no EXPIRE but the jobs' key's when it was gone."""
    r, keys = q_alone
    first = jobs("a", timeout=60)
    assert (await queued.enter(r, keys, first, 10)).admitted
    await queued.leave(r, keys, MODEL, queued.members(first))  # the queue empties: the jobs' key is gone
    before = await commands(r)
    later = jobs("a", timeout=90)
    assert (await queued.enter(r, keys, later, 10)).admitted
    await queued.leave(r, keys, MODEL, queued.members(later))
    ran = {k: v - before.get(k, 0) for k, v in (await commands(r)).items() if v != before.get(k, 0)}
    assert ran == {"eval": 2, "zrangebyscore": 1, "hgetall": 1, "zadd": 1, "hset": 1, "expire": 1, "zrem": 1,
                   "hincrby": 1, "hdel": 1}
    assert 90 + 60 <= await r.ttl(keys.queued_tenants(MODEL)) <= 121 + queued.TTL_SLACK_S
    assert (await queued.enter(r, keys, jobs("a", timeout=60 + queued.TTL_SLACK_S + 30), 10)).admitted
    ttls = [await r.ttl(k) for k in queued._keys(keys, MODEL)]
    assert min(ttls) > queued.TTL_SLACK_S + 60 + 30 and max(ttls) - min(ttls) <= 1  # past it: both refreshed


async def test_a_tenant_s_own_jobs_and_weight_alone_are_written_while_it_queues(q_alone):
    """A second request of a queued tenant adds to its count; a changed weight is written, an unchanged one not."""
    r, keys = q_alone
    assert (await queued.enter(r, keys, jobs("a", weight=2), 10)).admitted
    before = await commands(r)
    assert (await queued.enter(r, keys, jobs("a", n=2, weight=2), 10)).admitted
    ran = {k: v - before.get(k, 0) for k, v in (await commands(r)).items() if v != before.get(k, 0)}
    assert ran == {"eval": 1, "zrangebyscore": 1, "hgetall": 1, "zadd": 1, "hincrby": 1}
    assert (await queued.enter(r, keys, jobs("a", weight=5), 10)).admitted
    assert await queued.figures(r, keys, MODEL) == queued.Figures({"a": 4}, {"a": 5})


async def commands(r: Redis) -> dict[str, int]:
    """The commands Redis ran so far, by name (those a script runs included; INFO itself not)."""
    stats = await r.info("commandstats")
    return {n: v["calls"] for k, v in stats.items() if (n := k.removeprefix("cmdstat_")) != "info"}
