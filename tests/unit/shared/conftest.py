"""What the tests of shared/ modules against a real redis-server share."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from redis.asyncio import Redis

from rsinfer.redis_server import RedisServer
from shared.keys import Keys
from shared.redis_conn import Cluster, connect


@asynccontextmanager
async def client_and_keys(url: str) -> AsyncIterator[tuple[Redis | Cluster, Keys]]:
    """A client of the redis-server at `url` and a namespace of its own, the client closed after."""
    redis = connect(url)
    try:
        yield redis, Keys(f"t{uuid.uuid4().hex[:8]}")
    finally:
        await redis.aclose()


@pytest.fixture
async def env(redis_server):
    """A client of the test redis-server and a namespace of its own."""
    async with client_and_keys(redis_server.url) as pair:
        yield pair


@pytest.fixture
def own_redis_url():
    """A redis-server of this test's own: for a test that counts the commands Redis ran (INFO commandstats is the
    whole server's, and the session's server also serves what other tests left running)."""
    with RedisServer() as server:
        yield server.url


@pytest.fixture
async def own_env(own_redis_url):
    """`env` on a redis-server of its own (`own_redis_url`)."""
    async with client_and_keys(own_redis_url) as pair:
        yield pair
