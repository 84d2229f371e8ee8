"""A Redis Cluster's pipeline in phases (shared/redis_conn.py `OrderedPipeline`), against a real cluster: what is
queued after a barrier is not sent once a command before it failed, whether `execute` raises or reports."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.exceptions import ResponseError

from shared.redis_conn import barrier, connect

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("raise_on_error", [True, False])
def test_a_failed_phase_stops_the_phases_after_it(redis_cluster, raise_on_error):
    async def run():
        redis, tag = connect(redis_cluster.url), uuid.uuid4().hex
        try:
            await redis.set(f"{tag}:text", "x")
            async with redis.pipeline(transaction=False) as pipe:
                pipe.set(f"{tag}:before", "1")
                pipe.xadd(f"{tag}:text", {"a": "1"})  # WRONGTYPE: the key holds a string
                barrier(pipe)
                pipe.set(f"{tag}:after", "1")  # as an XACK after the writes it acknowledges
                if raise_on_error:
                    with pytest.raises(ResponseError):
                        await pipe.execute()
                else:
                    results = await pipe.execute(raise_on_error=False)
                    assert results[0] is True and all(isinstance(r, ResponseError) for r in results[1:])
            assert await redis.get(f"{tag}:before") == b"1" and await redis.get(f"{tag}:after") is None
        finally:
            await redis.aclose()

    asyncio.run(run())
