"""What the tests of shared/ modules against a real redis-server share."""

from __future__ import annotations

import uuid

import pytest

from rsinfer.redis_server import RedisServer
from shared.keys import Keys
from shared.redis_conn import connect


@pytest.fixture
async def env(redis_server):
    """A client of the test redis-server and a namespace of its own."""
    redis = connect(redis_server.url)
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    yield redis, keys
    await redis.aclose()


@pytest.fixture
def own_redis_url():
    """A redis-server of this test's own: for a test that counts the commands Redis ran (INFO commandstats is the
    whole server's, and the session's server also serves what other tests left running)."""
    with RedisServer() as server:
        yield server.url


@pytest.fixture
async def own_env(own_redis_url):
    """`env` on a redis-server of its own (`own_redis_url`)."""
    redis = connect(own_redis_url)
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    yield redis, keys
    await redis.aclose()
