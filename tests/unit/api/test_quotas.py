"""The quota's admission script and leases (services/api/multitenancy/quotas.py) against a real redis-server: the
decision, the 429's headers, a lease that lives as long as its request, the slots of a crashed process, the token
bucket."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from services.api.errors import ApiError
from services.api.multitenancy import quotas as quotas_module
from services.api.multitenancy.quotas import Lease, Quotas
from services.api.multitenancy.tenancy import Tenancy
from services.api.multitenancy.tenants import Policy, Tenant
from shared.keys import Keys
from shared.redis_conn import connect
from shared.settings import ApiSettings

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def quotas(redis_server):
    redis = connect(redis_server.url)
    settings = ApiSettings(redis_url=redis_server.url, quota_lease_s=3, usage_flush_s=0.2)
    yield Quotas(redis, Keys(f"q{uuid.uuid4().hex[:8]}"), settings, CollectorRegistry())
    await redis.aclose()


def tenant(**limits) -> Tenant:
    return Tenant(f"t{uuid.uuid4().hex[:6]}", Policy(**limits))


async def admit(quotas: Quotas, t: Tenant, reserve: int = 0, uid: str | None = None) -> Lease:
    uid = uid or uuid.uuid4().hex
    return await quotas.admit(t, reserve, uid, time.time() + 60)


def record(quotas: Quotas, uid: str, **fields) -> Any:
    return quotas.redis.hset(quotas.keys.request(uid), mapping=fields)


async def test_past_max_concurrent_a_429_with_the_headers_until_one_is_released(quotas):
    t = tenant(max_concurrent=2, requests_per_minute=100, tokens_per_minute=1000)
    first, _ = await admit(quotas, t), await admit(quotas, t)
    with pytest.raises(ApiError) as e:
        await admit(quotas, t)
    err = e.value
    assert err.status == 429 and err.code == "rate_limit_exceeded" and err.retry_after == 1
    h = err.headers
    assert (h["x-ratelimit-limit-concurrent"], h["x-ratelimit-remaining-concurrent"]) == ("2", "0")
    assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("100", "98")
    assert (h["x-ratelimit-limit-tokens"], h["x-ratelimit-remaining-tokens"]) == ("1000", "1000")
    assert h["x-ratelimit-reset-requests"].endswith("s") and 1 <= int(h["x-ratelimit-reset-requests"][:-1]) <= 60
    assert err.response().headers["retry-after"] == "1"
    await first.release()
    await first.release()  # once only
    await admit(quotas, t)
    assert await quotas.redis.zcard(quotas.keys.quota_slots(t.name)) == 2


async def test_other_tenants_are_not_counted_against_one(quotas):
    a, b = tenant(max_concurrent=1), tenant(max_concurrent=1)
    await admit(quotas, b)
    with pytest.raises(ApiError):
        await admit(quotas, b)
    await admit(quotas, a)


async def test_requests_per_minute(quotas):
    t = tenant(requests_per_minute=3)
    for _ in range(3):
        await (await admit(quotas, t)).release()
    with pytest.raises(ApiError) as e:
        await admit(quotas, t)
    assert e.value.headers["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= e.value.retry_after <= 60 and "requests_per_minute" in e.value.message


async def test_tokens_per_minute_reserves_what_a_request_may_generate_and_refunds_the_rest(quotas):
    """Concurrent requests cannot run past the bucket: each reserves its max_tokens at admission."""
    t = tenant(tokens_per_minute=100)
    first = await admit(quotas, t, reserve=60)
    with pytest.raises(ApiError) as e:
        await admit(quotas, t, reserve=60)
    assert int(e.value.headers["x-ratelimit-remaining-tokens"]) in (40, 41)  # refilling at 100/min meanwhile
    assert "tokens_per_minute" in e.value.message and e.value.retry_after >= 1
    first.follow((uuid.uuid4().hex,), SimpleNamespace(prompt_tokens=30, cached_tokens=10, completion_tokens=10))
    await first.end(done=True)  # used 40 of its 60
    second = await admit(quotas, t, reserve=60)  # 40 + 20 back (+ a little refill)
    usage = await quotas.redis.hgetall(quotas.keys.usage())
    assert {k.decode(): int(v) for k, v in usage.items() if k.decode().startswith(t.name)} == {
        f"{t.name}:requests": 1, f"{t.name}:prompt_tokens": 30, f"{t.name}:cached_tokens": 10,
        f"{t.name}:generated_tokens": 10}
    assert quotas.usage["generated_tokens"].labels(t.name)._value.get() == 10
    await second.release()


async def test_a_request_larger_than_the_bucket_is_told_not_to_retry(quotas):
    t = tenant(tokens_per_minute=100)
    with pytest.raises(ApiError) as e:
        await admit(quotas, t, reserve=101)
    assert e.value.status == 429 and e.value.param == "max_tokens"
    assert e.value.headers["x-should-retry"] == "false" and e.value.retry_after is None


async def test_an_overshoot_is_carried_into_the_next_minutes(quotas):
    """A prompt is counted when the request ends: one far past the bucket leaves it below zero, refused until it
    refilled, not reset by a new minute."""
    t = tenant(tokens_per_minute=100)
    lease = await admit(quotas, t, reserve=10)
    lease.follow((uuid.uuid4().hex,), SimpleNamespace(prompt_tokens=500, cached_tokens=0, completion_tokens=10))
    await lease.end(done=True)
    with pytest.raises(ApiError) as e:
        await admit(quotas, t)
    assert e.value.headers["x-ratelimit-remaining-tokens"] == "0" and e.value.retry_after >= 60 * 3


async def test_a_lease_whose_client_left_lives_until_its_record_ends_and_is_charged_the_stages_counts(quotas):
    t = tenant(max_concurrent=1, tokens_per_minute=10_000)
    uid = uuid.uuid4().hex
    lease = await admit(quotas, t, reserve=1000, uid=uid)
    await record(quotas, uid, status="running")
    lease.follow((uid,), SimpleNamespace(prompt_tokens=5, cached_tokens=0, completion_tokens=3))
    await lease.end(done=False)  # its client left; the request runs on
    await quotas.watch()
    with pytest.raises(ApiError):
        await admit(quotas, t)  # still held
    await record(quotas, uid, status="finished", prompt_tokens=5, generated_tokens=700)
    await quotas.watch()
    assert lease.released and await quotas.redis.zcard(quotas.keys.quota_slots(t.name)) == 0
    used = await quotas.redis.hget(quotas.keys.usage(), f"{t.name}:generated_tokens")
    assert int(used) == 700  # what the stages produced, not the 3 its client read


async def test_a_dead_processs_slots_are_reaped_once_their_requests_ended(quotas):
    """No process follows these leases any more (its process crashed): a refused admission looks at the slots'
    records and drops those that ended."""
    t = tenant(max_concurrent=2)
    running, ended = uuid.uuid4().hex, uuid.uuid4().hex
    await admit(quotas, t, uid=running)
    await admit(quotas, t, uid=ended)
    quotas.leases.clear()
    await record(quotas, running, status="running")
    await record(quotas, ended, status="running")
    with pytest.raises(ApiError):
        await admit(quotas, t)
    await record(quotas, ended, status="aborted")
    await admit(quotas, t)  # the ended one's slot was reaped
    with pytest.raises(ApiError):
        await admit(quotas, t)  # the running one's was not


async def test_a_just_admitted_slot_is_not_reaped_before_its_record_is_written(quotas):
    t = tenant(max_concurrent=1)
    await admit(quotas, t)  # no record yet: its request is being opened
    with pytest.raises(ApiError):
        await admit(quotas, t)
    slots = quotas.keys.quota_slots(t.name)
    (member,) = [m.decode() for m in await quotas.redis.zrange(slots, 0, -1)]
    uid, _, _ = member.rpartition("@")
    await quotas.redis.zrem(slots, member)
    await quotas.redis.zadd(slots, {f"{uid}@{int(time.time()) - 60}": time.time() + 60})  # admitted a minute ago
    await admit(quotas, t)  # a minute without a record: its request is gone


async def elapse(quotas: Quotas, t: Tenant, seconds: float) -> None:
    """`seconds` pass for the tenant's slots: each slot's expiry (its score, compared with Redis's clock) moves
    back by as much, so that no test waits out a lease."""
    slots = quotas.keys.quota_slots(t.name)
    for member, expiry in await quotas.redis.zrange(slots, 0, -1, withscores=True):
        await quotas.redis.zadd(slots, {member: expiry - seconds}, xx=True)


async def test_a_handlers_slot_expires_unless_its_process_refreshes_it(quotas):
    t = tenant(max_concurrent=1)
    await quotas.admit(t)  # a handler's lease of a process that crashed
    quotas.leases.clear()
    with pytest.raises(ApiError):
        await quotas.admit(t)
    await elapse(quotas, t, 2.5)
    with pytest.raises(ApiError):
        await quotas.admit(t)  # within its lease (--quota-lease-s 3)
    await elapse(quotas, t, 0.7)
    live = await quotas.admit(t)
    for _ in range(5):  # past the lease, refreshed meanwhile
        await elapse(quotas, t, 0.8)
        await quotas.watch()
    with pytest.raises(ApiError):
        await quotas.admit(t)
    await live.release()
    await quotas.admit(t)


async def test_an_unlimited_tenant_costs_no_script_at_admission(quotas):
    t = tenant()
    lease = await admit(quotas, t)
    assert not lease.slot and await quotas.redis.exists(quotas.keys.quota_window(t.name)) == 0
    await lease.release()
    assert int(await quotas.redis.hget(quotas.keys.usage(), f"{t.name}:requests")) == 1


async def test_a_route_answered_in_its_handler_holds_its_slot_for_the_block(redis_server, tmp_path):
    """`Tenancy.admitted`: what routes without a stream (tokenize, embeddings...) take; its slot ends with the
    block however the block ends, and the tokens it was given are counted."""
    path = tmp_path / "keys.yaml"
    name = f"t{uuid.uuid4().hex[:6]}"
    path.write_text(f"- {{key: sk-route-00000000000000000000000001, tenant: {name}, max_concurrent: 1}}\n")
    redis = connect(redis_server.url)
    keys = Keys(f"q{uuid.uuid4().hex[:8]}")
    tenancy = Tenancy(ApiSettings(redis_url=redis_server.url, api_keys_file=str(path)), redis, keys,
                      CollectorRegistry())
    tenant = tenancy.ring.tenant("sk-route-00000000000000000000000001")
    try:
        with pytest.raises(RuntimeError):
            async with tenancy.admitted(tenant, SimpleNamespace(prompt_tokens=5, cached_tokens=0,
                                                                 completion_tokens=0)):
                with pytest.raises(ApiError):
                    await tenancy.quotas.admit(tenant)  # its one slot is taken
                raise RuntimeError("the handler failed")
        async with tenancy.admitted(tenant):
            pass
        assert await redis.zcard(keys.quota_slots(name)) == 0
        assert int(await redis.hget(keys.usage(), f"{name}:prompt_tokens")) == 5
        assert int(await redis.hget(keys.usage(), f"{name}:requests")) == 2
    finally:
        await redis.aclose()


def test_with_keys_a_request_the_guard_did_not_key_may_do_nothing(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("- {key: sk-route-00000000000000000000000001, tenant: a}\n")
    tenancy = Tenancy(ApiSettings(redis_url="redis://127.0.0.1:1/0", api_keys_file=str(path)), None, None,
                      CollectorRegistry())
    nobody = tenancy.tenant_of(SimpleNamespace(scope={}))
    assert not nobody.admin and not tenancy.may_use(nobody, "rsinfer-demo")
    open_mode = Tenancy(ApiSettings(redis_url="redis://127.0.0.1:1/0"), None, None, CollectorRegistry())
    assert open_mode.tenant_of(SimpleNamespace(scope={})).admin


async def test_an_admission_reads_and_writes_the_window_once(quotas):
    """Issue 34: the admission script's fixed cost. The window (requests this minute, the token bucket) is read
    in one HMGET and written in one HSET with one EXPIRE; the slots' TTL is refreshed with slack, so the next
    admission (a later deadline within it) writes none."""
    t = tenant(max_concurrent=5, requests_per_minute=100, tokens_per_minute=10_000)
    r = quotas.redis

    async def calls() -> dict[str, int]:
        stats = await r.info("commandstats")
        return {n: stats.get(f"cmdstat_{n}", {}).get("calls", 0) for n in ("hmget", "hset", "expire", "ttl")}

    first = await admit(quotas, t, reserve=10)
    before = await calls()
    second = await quotas.admit(t, 10, uuid.uuid4().hex, time.time() + 90)
    after = await calls()
    assert {k: after[k] - before[k] for k in after} == {"hmget": 1, "hset": 1, "expire": 1, "ttl": 1}
    slots_ttl = await r.ttl(quotas.keys.quota_slots(t.name))  # the first's: its slot's expiry + 60 s + the slack
    assert 90 + 30 + 60 <= slots_ttl <= 60 + 30 + 61 + quotas_module.SLOTS_TTL_SLACK_S
    window = await r.hgetall(quotas.keys.quota_window(t.name))
    assert int(window[b"req"]) == 2 and 9_979 <= float(window[b"tb"]) <= 9_981
    for lease in (first, second):
        await lease.release()
    assert 9_999 <= float(await r.hget(quotas.keys.quota_window(t.name), "tb")) <= 10_000
