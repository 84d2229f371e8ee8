"""Redis clients. Pools block (with a timeout) instead of failing when all connections are busy."""

from __future__ import annotations

from redis.asyncio import BlockingConnectionPool, Redis

# A blocked XREAD/XREADGROUP must return before the socket times out; every block in rsinfer is <= 5 s.
SOCKET_TIMEOUT_S = 15.0
CONNECT_TIMEOUT_S = 1.0


def connect(url: str, max_connections: int = 32, **options) -> Redis:
    """A pooled client for commands and pipelines; options: password, ssl_ca_certs."""
    pool = BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=5, socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=CONNECT_TIMEOUT_S, health_check_interval=30, **options)
    return Redis(connection_pool=pool)


def connect_single(url: str, **options) -> Redis:
    """A client on one dedicated connection, for a loop that blocks in XREAD."""
    return Redis.from_url(url, single_connection_client=True, socket_timeout=SOCKET_TIMEOUT_S,
                          socket_connect_timeout=CONNECT_TIMEOUT_S, **options)
