"""A Redis Cluster of real redis-server processes on 127.0.0.1, for the tests and benchmarks: test-only code,
which the package does not ship (one server: rsinfer/redis_server.py `RedisServer`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import redis
import redis.cluster

from rsinfer import children
from rsinfer.redis_server import find_redis_server, free_port, wait_until_up


class LocalCluster:
    """A Redis Cluster on 127.0.0.1 for the tests and benchmarks: `primaries` primaries with one replica each
    (`redis-server --cluster-enabled yes`, then `redis-cli --cluster create --cluster-replicas 1`). A small
    `node_timeout_ms` makes a replica take over a dead primary within seconds. Every server runs in its own
    process group and is stopped (SIGKILL) by `stop`, also after a failed start."""

    def __init__(self, primaries: int = 3, node_timeout_ms: int = 2000, binary: str | None = None):
        self.binary = binary or find_redis_server()
        self.cli = shutil.which("redis-cli") or str(Path(self.binary).with_name("redis-cli"))
        self.ports = _cluster_ports(2 * primaries)
        self.primaries, self.node_timeout_ms = primaries, node_timeout_ms
        self.dir = tempfile.mkdtemp(prefix="rsinfer-cluster-")
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start_node(self, port: int) -> subprocess.Popen:
        node_dir = Path(self.dir) / str(port)
        node_dir.mkdir(exist_ok=True)
        log = open(node_dir / "redis.log", "ab")  # noqa: SIM115  (owned by the child)
        proc = children.spawn(
            [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(node_dir), "--protected-mode", "no", "--cluster-enabled", "yes",
             "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(self.node_timeout_ms),
             "--repl-diskless-sync-delay", "0"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[port] = proc
        client = redis.Redis(port=port, socket_connect_timeout=0.5)
        try:
            wait_until_up(client, proc)
        finally:
            client.close()
        return proc

    def start(self, timeout: float = 30.0) -> LocalCluster:
        try:
            for port in self.ports:
                self.start_node(port)
            subprocess.run([self.cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                            "--cluster-replicas", "1", "--cluster-yes"], check=True, capture_output=True,
                           timeout=timeout)
            self.wait_healthy(timeout, replicated=True)
        except BaseException:
            self.stop()
            raise
        return self

    def nodes(self) -> list[dict]:
        """CLUSTER NODES as seen by a live node: [{port, role ('master'/'slave'), ok, slots}]."""
        for port, proc in self.procs.items():
            if proc.poll() is not None:
                continue
            try:
                with redis.Redis(port=port, socket_connect_timeout=0.5, socket_timeout=2) as c:
                    raw = c.execute_command("CLUSTER", "NODES")
            except redis.RedisError:
                continue
            text = raw.decode() if isinstance(raw, bytes) else raw
            return [_parse_node(line) for line in text.splitlines() if line.strip()]
        return []

    def healthy(self, replicated: bool = False) -> bool:
        """Every live node says `cluster_state:ok`, each of the slots' owners is a live primary, and (with
        `replicated`) each of them has a replica in sync, so that it can fail over."""
        for port, proc in self.procs.items():
            if proc.poll() is not None:
                continue
            try:
                with redis.Redis(port=port, socket_connect_timeout=0.5, socket_timeout=2) as c:
                    if c.cluster("info").get("cluster_state") != "ok":
                        return False
            except redis.RedisError:
                return False
        owners = [n for n in self.nodes() if n["slots"]]
        if not owners or not all(n["role"] == "master" and n["ok"] for n in owners):
            return False
        return not replicated or all(self._replica_online(n["port"]) for n in owners)

    def _replica_online(self, port: int) -> bool:
        try:
            with redis.Redis(port=port, socket_connect_timeout=0.5, socket_timeout=2) as c:
                info = c.info("replication")
        except redis.RedisError:
            return False
        return any(isinstance(v, dict) and v.get("state") == "online" for k, v in info.items()
                   if k.startswith("slave"))

    def wait_healthy(self, timeout: float = 30.0, replicated: bool = False) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy(replicated):
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not healthy after {timeout}s; logs in {self.dir}")
            time.sleep(0.1)

    def primary_of(self, key: str) -> int:
        """The port of the primary that holds `key`'s slot now."""
        slot = redis.cluster.key_slot(key.encode())
        for n in self.nodes():
            if n["role"] == "master" and n["ok"] and any(a <= slot <= b for a, b in n["slots"]):
                return n["port"]
        raise LookupError(f"no live primary holds slot {slot}")

    def kill(self, port: int) -> None:
        """kill -9 one node (a primary failing: its replica is promoted after the node timeout)."""
        proc = self.procs[port]
        proc.kill()
        proc.wait()

    def fail_over(self, port: int) -> Failover:
        """kill -9 the primary on `port` and time, in a thread, until the cluster is healthy again."""
        return Failover(self, port)

    def stop(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _cluster_ports(count: int) -> list[int]:
    """Free ports whose cluster bus ports (port + 10000) are free too."""
    found: list[int] = []
    while len(found) < count:
        port = free_port()
        if port + 10_000 > 65_535 or port in found:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10_000))
            except OSError:
                continue
        found.append(port)
    return found


def _parse_node(line: str) -> dict:
    """One line of CLUSTER NODES: id addr flags primary ping pong epoch link slot...; slots as [(a, b)]."""
    parts = line.split()
    flags = parts[2].split(",")
    slots = []
    for s in parts[8:]:
        if s.startswith("["):
            continue  # a slot being migrated
        a, _, b = s.partition("-")
        slots.append((int(a), int(b or a)))
    return {"port": int(parts[1].split("@")[0].rsplit(":", 1)[1]),
            "role": "master" if "master" in flags else "slave",
            "ok": "myself" in flags or ("fail" not in flags and "fail?" not in flags and parts[7] == "connected"),
            "slots": slots}


class Failover:
    """A primary killed now (`killed`, monotonic) and the time until its replica took over (`seconds`)."""

    def __init__(self, cluster: LocalCluster, port: int):
        self.killed = time.monotonic()
        cluster.kill(port)
        self.healthy_at: float | None = None
        self.watcher = threading.Thread(target=self._watch, args=(cluster,), daemon=True)
        self.watcher.start()

    def _watch(self, cluster: LocalCluster) -> None:
        time.sleep(0.5)  # the cluster has not noticed yet
        while not cluster.healthy():
            time.sleep(0.05)
        self.healthy_at = time.monotonic()

    def seconds(self, timeout: float) -> float | None:
        """Seconds from the kill to a healthy cluster, waiting up to `timeout`; None if it never got there."""
        self.watcher.join(timeout)
        return None if self.healthy_at is None else self.healthy_at - self.killed
