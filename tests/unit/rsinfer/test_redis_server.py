"""The embedded redis-server (`rsinfer up`'s and the tests'): a memory bound with noeviction, and a password
that never shows on its command line."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from rsinfer.redis_server import RedisServer

pytestmark = pytest.mark.timeout(30)


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_maxmemory_with_noeviction_refuses_writes_past_it():
    with RedisServer(maxmemory="8mb") as server:
        r = server.client()
        assert r.config_get("maxmemory") == {"maxmemory": str(8 << 20)}
        assert r.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            for i in range(10_000):
                r.set(f"k{i}", b"x" * 4096)
        assert r.exists("k0"), "nothing was evicted"
        r.close()


def test_no_bound_by_default():
    with RedisServer() as server:
        assert server.client().config_get("maxmemory") == {"maxmemory": "0"}


def test_password_required_and_not_on_the_command_line():
    password = 'pw-"quoted"\\and-long-0123456789'
    with RedisServer(password=password, maxmemory="64mb") as server:
        assert password not in cmdline(server.proc.pid)
        assert "requirepass" not in cmdline(server.proc.pid)
        conf = Path(server.dir) / "redis.conf"
        assert stat.S_IMODE(os.stat(conf).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(server.dir).st_mode) == 0o700
        assert redis.Redis(port=server.port, password=password).ping()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=server.port, retry=Retry(NoBackoff(), 0)).ping()  # no retries: ~4 s of backoff
        assert "@" not in server.url, "the URL carries no password"
