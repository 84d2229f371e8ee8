"""services/api/errors.py: which errors tell clients not to retry. OpenAI's SDKs retry 408, 409, 429 and every
5xx unless the answer says `x-should-retry: false`: a request refused for what it is, or one that ran out its own
deadline (504), would only be refused or run again."""

from __future__ import annotations

import pytest

from services.api.edge.http import raw_response
from services.api.errors import ApiError


@pytest.mark.parametrize(("status", "retry"), [
    (400, False), (401, False), (403, False), (404, False), (405, False), (410, False), (413, False), (431, False),
    (504, False), (408, True), (409, True), (429, True), (500, True), (503, True)])
def test_errors_a_retry_cannot_fix_say_so(status, retry):
    headers = ApiError(status, "x").response().headers
    assert headers.get("x-should-retry") == (None if retry else "false")


def test_backpressure_stays_retryable_with_its_delay():
    headers = ApiError(503, "full", retry_after=2).response().headers
    assert headers["retry-after"] == "2" and "x-should-retry" not in headers
    assert ApiError(429, "slow down", retry_after=1).response().headers["retry-after"] == "1"


def test_errors_answered_by_the_protocol_say_so_too():
    """Those answered before the app sees a request (a head too large), on a connection that closes."""
    raw = raw_response(ApiError(431, "head too large"))
    head = raw.split(b"\r\n\r\n", 1)[0].decode().lower().split("\r\n")
    assert "x-should-retry: false" in head and head.count("connection: close") == 1
    assert "x-should-retry" not in raw_response(ApiError(408, "slow head")).decode().lower()
    assert "retry-after: 1" in raw_response(ApiError(503, "busy", retry_after=1)).decode().lower()


async def test_a_pool_run_dry_is_overload_not_an_unreachable_broker(redis_server):
    """A BlockingConnectionPool whose connections are all held answers its waiters ConnectionError("No connection
    available.") after its timeout: that is this process overloaded (503 overloaded), not Redis unreachable."""
    from redis.asyncio import BlockingConnectionPool
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import OutOfMemoryError

    from services.api.errors import broker_error

    pool = BlockingConnectionPool.from_url(redis_server.url, max_connections=1, timeout=0.05)
    held = await pool.get_connection()
    try:
        with pytest.raises(RedisConnectionError) as dry:
            await pool.get_connection()
    finally:
        await pool.release(held)
        await pool.disconnect()
    assert broker_error(dry.value).code == "overloaded"
    assert broker_error(RedisConnectionError("Error 111 connecting")).code == "broker_unavailable"
    assert broker_error(OutOfMemoryError("OOM")).code == "broker_full"
