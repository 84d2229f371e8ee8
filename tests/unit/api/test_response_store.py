"""services/api/responses_api/response_store.py against a real redis-server: a tenant's count of stored responses
follows what Redis holds (reserved, written, ended, deleted, expired), its bounds refuse with a 400, and another
tenant's read gets the owner's name back and nothing of the document; on a standalone Redis and on a Redis Cluster."""

from __future__ import annotations

import uuid

import pytest

from services.api.errors import ApiError
from services.api.responses_api.response_store import READ, TOTAL, ResponseStore
from shared.keys import Keys
from shared.redis_conn import connect
from shared.settings import ApiSettings
from tests.support.helpers import async_wait_for

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(params=["standalone", pytest.param("cluster", marks=pytest.mark.xdist_group("redis_cluster"))])
async def store(request):
    """A store on a standalone Redis, and on a Redis Cluster (the response and its tenant's count in other slots)."""
    url = request.getfixturevalue("redis_server" if request.param == "standalone" else "redis_cluster").url
    redis = connect(url)
    settings = ApiSettings(redis_url=url, max_stored_responses_per_tenant=3, max_stored_response_bytes_per_tenant=4096)
    yield ResponseStore(redis, Keys(f"r{uuid.uuid4().hex[:8]}"), settings)
    await redis.aclose()


async def written(store: ResponseStore, tenant: str, uid: str, size: int = 100) -> None:
    """As the request that produces it does: counted, then written on the pipeline that opens the request."""
    fields = {"meta": b"{}", "input": b"x" * (size - 2)}
    await store.reserve(tenant, uid, size)
    async with store.redis.pipeline(transaction=True) as pipe:
        store.writes(tenant, uid, fields, [])(pipe)
        await pipe.execute()


async def counted(store: ResponseStore, tenant: str) -> tuple[int, int]:
    r = store.redis
    total = await r.hget(store.keys.stored_response_bytes(tenant), TOTAL)
    return await r.zcard(store.keys.stored_responses(tenant)), int(total or 0)


async def test_past_the_count_a_400_and_a_deleted_one_makes_room(store):
    for uid in ("u1", "u2", "u3"):
        await written(store, "a", uid)
    with pytest.raises(ApiError) as e:
        await store.reserve("a", "u4", 100)
    assert (e.value.status, e.value.param, e.value.code) == (400, "store", "stored_responses_limit")
    await store.reserve("b", "u4", 100)  # another tenant's count is its own
    assert await store.delete("u1", "a")
    assert await counted(store, "a") == (2, 200)
    await written(store, "a", "u5")
    assert await counted(store, "a") == (3, 300)


async def test_past_the_bytes_a_400_and_a_reservation_is_counted_once(store):
    await written(store, "a", "u1", 4000)
    await store.reserve("a", "u1", 4000)  # the same response again (a batch line run twice): not counted twice
    with pytest.raises(ApiError) as e:
        await store.reserve("a", "u2", 200)
    assert "--max-stored-response-bytes-per-tenant" in e.value.message
    assert await counted(store, "a") == (1, 4000)


async def test_the_final_object_is_counted_once_and_not_stored_for_a_deleted_response(store):
    await written(store, "a", "u1")
    final = {"status": "completed", "output": []}
    await store.finish("u1", "a", final)
    await store.finish("u1", "a", final)
    _, total = await counted(store, "a")
    assert total == 100 + len(b'{"status":"completed","output":[]}')
    await store.delete("u1", "a")
    await store.finish("u1", "a", final)  # it ended after its DELETE: nothing comes back
    assert not await store.redis.exists(store.keys.response("u1"))
    assert await counted(store, "a") == (0, 0)


async def test_expired_responses_leave_the_count(store):
    store.ttl_s = 1
    for uid in ("u1", "u2", "u3"):
        await written(store, "a", uid)
    async def expired() -> bool:  # a real TTL on a real Redis: time passes
        return not await store.redis.exists(*(store.keys.response(uid) for uid in ("u1", "u2", "u3")))

    await async_wait_for(expired, 5, 0.05)
    await written(store, "a", "u4")  # room again: the expired ones were dropped as it was counted
    assert await counted(store, "a") == (1, 100)


async def test_another_tenants_read_gets_only_the_owner(store):
    await written(store, "a", "u1", 2000)
    raw = await store.redis.eval(READ, 1, store.keys.response("u1"), 0, "b", "meta", "input")
    assert raw == [b"a"]  # the fields were never read, let alone sent
    assert await store.read("u1", "b", False, "meta", "input") is None
    assert await store.read("u1", "b", False) is None  # a DELETE's check
    mine = await store.read("u1", "a", False, "meta", "input")
    assert mine is not None and mine.owner == "a" and len(mine.fields["input"]) == 1998
    admin = await store.read("u1", "ops", True, "meta")
    assert admin is not None and admin.json("meta") == {}
    assert await store.read("nothing", "a", False, "meta") is None
