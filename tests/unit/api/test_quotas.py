"""The quota's admission script and leases (services/api/tenancy.py `Quotas`) against a real redis-server: the
decision, the 429's headers, the release, the expiry of a crashed process's slots, tokens counted per minute."""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from services.api.errors import ApiError
from services.api.tenancy import Quotas, Tenancy
from services.api.tenants import Policy, Tenant
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


async def test_past_max_concurrent_a_429_with_the_headers_until_one_is_released(quotas):
    t = tenant(max_concurrent=2, requests_per_minute=100, tokens_per_minute=1000)
    first, _ = await quotas.admit(t), await quotas.admit(t)
    with pytest.raises(ApiError) as e:
        await quotas.admit(t)
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
    await quotas.admit(t)
    assert await quotas.redis.zcard(quotas.keys.quota_slots(t.name)) == 2


async def test_other_tenants_are_not_counted_against_one(quotas):
    a, b = tenant(max_concurrent=1), tenant(max_concurrent=1)
    await quotas.admit(b)
    with pytest.raises(ApiError):
        await quotas.admit(b)
    await quotas.admit(a)


async def test_requests_per_minute(quotas):
    t = tenant(requests_per_minute=3)
    for _ in range(3):
        await (await quotas.admit(t)).release()
    with pytest.raises(ApiError) as e:
        await quotas.admit(t)
    assert e.value.headers["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= e.value.retry_after <= 60 and "requests_per_minute" in e.value.message


async def test_tokens_are_counted_as_they_come_and_past_the_minutes_budget_refuse(quotas):
    t = tenant(tokens_per_minute=100)
    lease = await quotas.admit(t)
    lease.counts = SimpleNamespace(prompt_tokens=30, cached_tokens=10, completion_tokens=0)
    await quotas.flush()  # the periodic flush: while it runs
    window = quotas.keys.quota_window(t.name)
    assert int(await quotas.redis.hget(window, "tok")) == 30
    lease.counts.completion_tokens = 75
    await lease.release()
    assert int(await quotas.redis.hget(window, "tok")) == 105
    with pytest.raises(ApiError) as e:
        await quotas.admit(t)
    assert e.value.headers["x-ratelimit-remaining-tokens"] == "0" and "tokens_per_minute" in e.value.message
    usage = await quotas.redis.hgetall(quotas.keys.usage())
    assert {k.decode(): int(v) for k, v in usage.items() if k.decode().startswith(t.name)} == {
        f"{t.name}:requests": 1, f"{t.name}:prompt_tokens": 30, f"{t.name}:cached_tokens": 10,
        f"{t.name}:generated_tokens": 75}
    assert quotas.usage["generated_tokens"].labels(t.name)._value.get() == 75


async def test_a_crashed_processs_slots_expire_and_a_live_ones_are_refreshed(quotas):
    t = tenant(max_concurrent=1)
    await quotas.admit(t)  # this "process" will not refresh it: it crashed
    quotas.leases.clear()
    with pytest.raises(ApiError):
        await quotas.admit(t)
    await asyncio.sleep(3.2)  # --quota-lease-s 3
    live = await quotas.admit(t)
    for _ in range(5):  # past the lease, refreshed meanwhile
        await asyncio.sleep(0.8)
        await quotas.flush()
    with pytest.raises(ApiError):
        await quotas.admit(t)
    await live.release()
    await quotas.admit(t)


async def test_an_unlimited_tenant_costs_no_script_at_admission(quotas):
    t = tenant()
    lease = await quotas.admit(t)
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
