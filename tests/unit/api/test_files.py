"""services/api/batch_api/files.py against a real redis-server and a local object store: contents outlive no
metadata."""

from __future__ import annotations

import uuid

from prometheus_client import CollectorRegistry

from services.api.batch_api.files import Files, content_key
from services.api.multitenancy.tenancy import Tenancy
from services.api.multitenancy.tenants import OPEN
from shared.keys import Keys
from shared.redis_conn import connect
from shared.settings import ApiSettings


async def test_an_expired_files_contents_are_swept_at_the_second_look(redis_server, tmp_path):
    redis = connect(redis_server.url)
    keys = Keys(f"f{uuid.uuid4().hex[:8]}")
    settings = ApiSettings(redis_url=redis_server.url, storage_url=f"file://{tmp_path}")
    files = Files(settings, redis, keys, Tenancy(settings, redis, keys, CollectorRegistry()))
    try:
        kept = (await files.create(b"kept\n", "a.jsonl", "batch"))["id"]
        expired = (await files.create(b"gone\n", "b.jsonl", "batch"))["id"]
        await redis.delete(keys.file(expired))  # as its TTL would
        assert await files.sweep_orphans() == 0  # first look: maybe an upload between its two writes
        assert await files.store().exists(content_key(expired))
        assert await files.sweep_orphans() == 1
        assert not await files.store().exists(content_key(expired))
        assert await files.content(kept, OPEN) == b"kept\n"
    finally:
        await files.close()
        await redis.aclose()


async def test_a_tenants_files_and_bytes_are_counted_released_and_expire(redis_server, tmp_path):
    """FileQuota: the bounds refuse with a 403 naming the setting; a delete releases at once, an expired file at
    the next count; a file written again (a batch's output, by a second run) counts once."""
    import time

    import pytest

    from services.api.batch_api.files import FileQuota
    from services.api.errors import ApiError

    redis = connect(redis_server.url)
    keys = Keys(f"q{uuid.uuid4().hex[:8]}")
    quota = FileQuota(ApiSettings(max_files_per_tenant=2, max_file_bytes_per_tenant=100), redis, keys)
    later = time.time() + 3600
    try:
        await quota.reserve("t", "f1", 60, later)
        await quota.reserve("t", "f1", 60, later)  # the same file again
        await quota.reserve("u", "g1", 100, later)  # another tenant's bounds are its own
        with pytest.raises(ApiError) as e:
            await quota.reserve("t", "f2", 41, later)
        assert e.value.status == 403 and "--max-file-bytes-per-tenant" in e.value.message
        await quota.reserve("t", "f2", 40, later)
        with pytest.raises(ApiError) as e:
            await quota.reserve("t", "f3", 0, later)
        assert e.value.status == 403 and "--max-files-per-tenant" in e.value.message
        await quota.release("t", "f1")
        await quota.reserve("t", "f3", 60, later)
        assert sorted(await quota.ids("t")) == ["f2", "f3"]
        await redis.zadd(keys.tenant_files("t"), {"f2": int(time.time()) - 1}, xx=True)  # f2's expiry passes
        await quota.reserve("t", "f4", 40, later)
        assert sorted(await quota.ids("t")) == ["f3", "f4"]
        assert int(await redis.hget(keys.tenant_file_bytes("t"), "_total")) == 100
    finally:
        await redis.aclose()
