"""services/api/files.py against a real redis-server and a local object store: contents outlive no metadata."""

from __future__ import annotations

import uuid

from prometheus_client import CollectorRegistry

from services.api.files import Files, content_key
from services.api.tenancy import Tenancy
from services.api.tenants import OPEN
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
