"""What the tests of shared/ modules against a real redis-server share."""

from __future__ import annotations

import uuid

import pytest

from shared.keys import Keys
from shared.redis_conn import connect


@pytest.fixture
async def env(redis_server):
    """A client of the test redis-server and a namespace of its own."""
    redis = connect(redis_server.url)
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    yield redis, keys
    await redis.aclose()
