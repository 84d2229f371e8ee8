"""The end-to-end tests' process stack: rsinfer/launcher.py's Launcher on the test redis-server, in a namespace
of its own, each process in a process group of its own with a log file in the test's tmp dir; and the ways the
tests start one (a pipeline of one process per stage, or several replicas of each)."""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import redis

from rsinfer.launcher import Launcher, ProcessDied, api_ready, serving
from rsinfer.redis_server import RedisServer, free_port
from shared.keys import Keys

MODEL = "rsinfer-demo"
STARTED: list[subprocess.Popen] = []  # every process a Stack started, whoever stops it (or forgets to)
# Short timings so that crash and shutdown tests finish in seconds; each process can override them.
LIFECYCLE_ENV = dict(RSINFER_CLAIM_IDLE_MS="1500", RSINFER_HEARTBEAT_INTERVAL_S="0.5", RSINFER_HEARTBEAT_TTL_S="2",
                     RSINFER_GRACE_PERIOD_S="5", RSINFER_SLOW_CLIENT_TIMEOUT_S="2")


class Stack(Launcher):
    """A set of rsinfer processes sharing one namespace on the test redis-server (`cluster`: a node of a Redis
    Cluster). Only what the test says configures them: no RSINFER_* variable of the test run's own."""

    def __init__(self, redis_url: str, model_dir: Path, namespace: str, log_dir: Path, cluster: bool = False):
        super().__init__({
            "RSINFER_REDIS_URL": redis_url, "RSINFER_NAMESPACE": namespace, "RSINFER_MODEL": str(model_dir),
            "RSINFER_SERVED_MODEL_NAME": MODEL, "RSINFER_HEARTBEAT_TTL_S": "3", "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", "RSINFER_THREADS": "1",
            # Disconnects abort at once (tests/e2e/test_resume.py covers the resume window), and keep-alive
            # pings come often enough that every stream longer than 2 s carries some.
            "RSINFER_RESUME_WINDOW_S": "0", "RSINFER_SSE_PING_S": "2",
        }, inherit_rsinfer=False, log_dir=log_dir, own_groups=True, die_with_parent=False)
        self.redis_url, self.model_dir, self.namespace, self.cluster = redis_url, model_dir, namespace, cluster
        self.port = 0  # the API's (the first one's, where a test starts several)

    @property
    def keys(self) -> Keys:
        return Keys(self.namespace)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, name: str, role: str, module: str = "rsinfer.cli", **extra: str | None) -> subprocess.Popen:
        """Start `rsinfer <role>` as process `name` (worker id = name; `up` names its own children); `module`:
        a test's own entry point instead of the CLI's (e.g. tests/support/poison_scheduler.py)."""
        serves_http = role in ("api", "up")
        if serves_http and not self.port:
            self.port = free_port()
        if role != "up":
            extra.setdefault("RSINFER_WORKER_ID", name)
        if serves_http:
            extra = {"RSINFER_PORT": str(self.port), **extra}
        proc = super().start(name, role, module, **extra)
        STARTED.append(proc)
        return proc

    def wait_until(self, check, timeout: float, what: str = "the stack") -> None:
        """rsinfer/launcher.py's, with the last lines of every process's log in the error: a fixture that fails to
        start says why in the one report pytest prints for it."""
        try:
            super().wait_until(check, timeout, what)
        except (ProcessDied, TimeoutError) as err:
            raise type(err)(f"{err}\n{self.log_tails()}") from None

    def log_tails(self, lines: int = 12) -> str:
        """The last `lines` lines of each process's log, under its name."""
        parts = []
        for name in self.procs:
            path = self.log_dir / f"{name}.log"
            text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else ["(no log)"]
            parts.append(f"--- {name} ---\n" + "\n".join(text))
        return "\n".join(parts)

    def wait_ready(self, timeout: float = 120.0, model: str | None = MODEL, api_key: str | None = None) -> None:
        """Until the API takes requests and `model` has a live worker in every stage. `/ready` alone says
        only the former (a request would wait for the workers); `model=None` waits for the API alone.
        `api_key`: a key the API takes (it lists the models)."""
        url = self.base_url
        self.wait_until((lambda: serving(url, model, api_key)) if model else (lambda: api_ready(url)), timeout,
                        "stack")

    def redis(self) -> redis.Redis:
        if self.cluster:
            return redis.RedisCluster.from_url(self.redis_url, decode_responses=True)
        return redis.Redis.from_url(self.redis_url, decode_responses=True)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, **kw)


def new_stack(redis_server: RedisServer, model_dir: Path, tmp_path_factory, prefix: str) -> Stack:
    ns = f"{prefix}{uuid.uuid4().hex[:6]}"
    return Stack(redis_server.url, model_dir, ns, tmp_path_factory.mktemp(f"logs-{ns}"))


def start_pipeline(s: Stack, suffix: str = "1", **env: str) -> Stack:
    """One tokenizer, scheduler, detokenizer and API as separate processes, named e.g. `scheduler1`."""
    for role in ("tokenizer", "scheduler", "detokenizer", "api"):
        s.start(f"{role}{suffix}", role, **{**LIFECYCLE_ENV, **env})
    s.wait_ready()
    return s


def start_replicas(s: Stack, replicas: dict[str, int], apis: int, timeout: float = 180.0, api_key: str | None = None,
                   **env: str) -> list[int]:
    """`replicas[role]` processes of each stage (named `<role>1`, `<role>2`...) and `apis` API processes
    (`api1`...) on ports of their own, the first one the stack's; their ports, once every API serves (`api_key`:
    a key they take)."""
    ports = [free_port() for _ in range(apis)]
    s.port = ports[0]
    for role in ("tokenizer", "scheduler", "detokenizer"):
        for k in range(1, replicas.get(role, 1) + 1):
            s.start(f"{role}{k}", role, **env)
    for k, port in enumerate(ports, start=1):
        s.start(f"api{k}", "api", RSINFER_PORT=str(port), **env)
    s.wait_ready(timeout, api_key=api_key)
    for port in ports[1:]:
        s.wait_until(lambda port=port: api_ready(f"http://127.0.0.1:{port}"), timeout, f"api on {port}")
    return ports


@contextlib.contextmanager
def running_pipeline(redis_server: RedisServer, model_dir: Path, tmp_path_factory, prefix: str,
                     **env: str) -> Iterator[Stack]:
    """start_pipeline on a new stack of its own namespace, stopped (whole process groups) however it ends."""
    s = new_stack(redis_server, model_dir, tmp_path_factory, prefix)
    try:
        yield start_pipeline(s, **env)
    finally:
        s.stop()


@contextlib.contextmanager
def running_up(redis_server: RedisServer, model_dir: Path, tmp_path_factory, prefix: str) -> Iterator[Stack]:
    """`rsinfer up` on a free port and a namespace of its own, serving once every stage is live; stopped however
    it ends."""
    s = new_stack(redis_server, model_dir, tmp_path_factory, prefix)
    try:
        s.start("up", "up")
        s.wait_ready()
        yield s
    finally:
        s.stop()
