"""End-to-end fixtures: a real redis-server on a free port and real rsinfer processes, started once per
session (each process imports torch). Tests that kill or restart processes start their own stack in
their own namespace on the same redis-server."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
import redis

from rsinfer.up import serving
from shared.keys import Keys
from shared.redis_server import RedisServer, free_port
from tests.e2e.helpers import api_ready

MODEL = "rsinfer-demo"


@dataclass
class Stack:
    """A set of rsinfer processes sharing one namespace on the test redis-server."""

    redis_url: str
    model_dir: Path
    namespace: str
    log_dir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    port: int = 0
    cluster: bool = False  # redis_url is a node of a Redis Cluster

    @property
    def keys(self) -> Keys:
        return Keys(self.namespace)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RSINFER_")}
        env.update({"RSINFER_REDIS_URL": self.redis_url, "RSINFER_NAMESPACE": self.namespace,
                    "RSINFER_MODEL": str(self.model_dir), "RSINFER_SERVED_MODEL_NAME": MODEL,
                    "RSINFER_HEARTBEAT_TTL_S": "3", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                    "RSINFER_THREADS": "1",
                    # Disconnects abort at once (tests/e2e/test_resume.py covers the resume window), and
                    # keep-alive pings come often enough that every stream longer than 2 s carries some.
                    "RSINFER_RESUME_WINDOW_S": "0", "RSINFER_SSE_PING_S": "2", **extra})
        return env

    def start(self, name: str, role: str, module: str = "rsinfer.cli", **extra: str) -> subprocess.Popen:
        """Start `rsinfer <role>` as process `name` (worker id = name; `up` names its own children); `module`:
        a test's own entry point instead of the CLI's (e.g. tests/e2e/poison_scheduler.py)."""
        serves_http = role in ("api", "up")
        if serves_http and not self.port:
            self.port = free_port()
        if role != "up":
            extra.setdefault("RSINFER_WORKER_ID", name)
        env = self.env(**{**({"RSINFER_PORT": str(self.port)} if serves_http else {}), **extra})
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115  (owned by the child)
        # Its own process group, so stop() reaches whatever it started too (`up`'s children).
        proc = subprocess.Popen([sys.executable, "-m", module, role], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        STARTED.append(proc)
        self.procs[name] = proc
        return proc

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(sig)
        proc.wait(30)
        if sig == signal.SIGKILL:
            stop_group(proc, grace=0)

    def wait_ready(self, timeout: float = 120.0, model: str | None = MODEL) -> None:
        """Until the API takes requests and `model` has a live worker in every stage. `/ready` alone says
        only the former (a request would wait for the workers); `model=None` waits for the API alone."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"processes died: {dead}; logs in {self.log_dir}")
            if serving(self.base_url, model) if model else api_ready(self.base_url):
                return
            time.sleep(0.2)
        raise TimeoutError(f"stack not ready; logs in {self.log_dir}")

    def stop(self) -> None:
        """Stop every process this stack started, whole process groups, however the test ended."""
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            stop_group(proc, grace=max(0.0, deadline - time.monotonic()))
        self.procs.clear()

    def redis(self) -> redis.Redis:
        if self.cluster:
            return redis.RedisCluster.from_url(self.redis_url, decode_responses=True)
        return redis.Redis.from_url(self.redis_url, decode_responses=True)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, **kw)


STARTED: list[subprocess.Popen] = []  # every process a Stack started, whoever stops it (or forgets to)


@pytest.fixture(scope="session", autouse=True)
def no_process_outlives_the_run() -> Iterator[None]:
    """A test that takes a process out of its Stack (to stop it itself) and fails before it does leaves it
    running: at the end of the run every process group a Stack started is killed."""
    yield
    for proc in STARTED:
        _signal_group(proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def stop_group(proc: subprocess.Popen, grace: float) -> None:
    """Wait up to `grace` seconds for the group leader, then SIGKILL its whole group (children included)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace)
    _signal_group(proc, signal.SIGKILL)
    proc.wait()


def new_stack(redis_server: RedisServer, model_dir: Path, tmp_path_factory, prefix: str) -> Stack:
    ns = f"{prefix}{uuid.uuid4().hex[:6]}"
    return Stack(redis_server.url, model_dir, ns, tmp_path_factory.mktemp(f"logs-{ns}"))


@pytest.fixture(scope="session")
def stack(redis_server, demo_model_dir, tmp_path_factory) -> Iterator[Stack]:
    """`rsinfer up` on a free port against the test redis-server, for the whole session."""
    s = new_stack(redis_server, demo_model_dir, tmp_path_factory, "e2e")
    try:
        s.start("up", "up")
        s.wait_ready()
        yield s
    finally:
        s.stop()


# Short timings so that crash and shutdown tests finish in seconds; each process can override them.
LIFECYCLE_ENV = dict(RSINFER_CLAIM_IDLE_MS="1500", RSINFER_HEARTBEAT_INTERVAL_S="0.5", RSINFER_HEARTBEAT_TTL_S="2",
                     RSINFER_GRACE_PERIOD_S="5", RSINFER_SLOW_CLIENT_TIMEOUT_S="2")


def start_pipeline(s: Stack, suffix: str = "1", **env: str) -> Stack:
    """One tokenizer, scheduler, detokenizer and API as separate processes, named e.g. `scheduler1`."""
    for role in ("tokenizer", "scheduler", "detokenizer", "api"):
        s.start(f"{role}{suffix}", role, **{**LIFECYCLE_ENV, **env})
    s.wait_ready()
    return s


@contextlib.contextmanager
def running_pipeline(redis_server: RedisServer, model_dir: Path, tmp_path_factory, prefix: str,
                     **env: str) -> Iterator[Stack]:
    """start_pipeline on a new stack of its own namespace, stopped (whole process groups) however it ends."""
    s = new_stack(redis_server, model_dir, tmp_path_factory, prefix)
    try:
        yield start_pipeline(s, **env)
    finally:
        s.stop()


@pytest.fixture(scope="module")
def pipeline(redis_server, demo_model_dir, tmp_path_factory) -> Iterator[Stack]:
    """Separate processes of each stage, for tests that kill, stop and restart them (module-scoped)."""
    with running_pipeline(redis_server, demo_model_dir, tmp_path_factory, "life") as s:
        yield s
