"""What bench/run_all.py drives: a stack of rsinfer processes (the ones `rsinfer up` starts, with as many API
processes as asked, through rsinfer/launcher.py), per-process CPU and Redis command snapshots, and load
generators that hold thousands of streams (rsinfer/sse_client.py's raw-socket client in several processes) or
use the official openai client.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import resource
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

import orjson

from bench.report import Span, command_calls, error_counts, percentile, proc_cpu_ticks, proc_status_kb
from rsinfer import sse_client
from rsinfer.launcher import SINGLE_THREAD, Launcher
from rsinfer.redis_server import RedisServer, free_port
from rsinfer.sse_client import Reply, Request

ROOT = Path(__file__).resolve().parent.parent


class RedisLike(Protocol):
    """A redis-server or a Redis Cluster the caller started: its URL is all the stack needs."""

    url: str


# ---- the stack


class BenchStack(Launcher):
    """redis-server, one tokenizer, `schedulers` schedulers (one by default) and one detokenizer, and `apis` API
    processes, each its own process (as `rsinfer up` runs them: one torch thread each but the scheduler's default);
    stopped in reverse order. `redis`: a server (or cluster) the caller owns and stops, instead of one of its own.
    `env`: per role, what its processes get over the stack's environment. Set `api_key` before
    starting it when keys are configured: a key the API takes, to see it serving."""

    api_key: str | None = None

    def __init__(self, model_dir: str, name: str, *, apis: int = 1, env: dict[str, dict[str, str]] | None = None,
                 schedulers: int = 1, redis: RedisLike | None = None):
        shared = {"RSINFER_MODEL": model_dir, "RSINFER_SERVED_MODEL_NAME": name, "RSINFER_LOG_LEVEL": "WARNING"}
        logs = Path(tempfile.mkdtemp(prefix="rsinfer-bench-"))
        super().__init__(shared, inherit_rsinfer=False, log_dir=logs, cwd=ROOT)
        self.model_dir, self.name, self.apis, self.schedulers = model_dir, name, apis, schedulers
        self.role_env = env or {}
        self.given_redis = redis
        self.redis_server: RedisLike | None = None
        self.ports: list[int] = []

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def pids(self) -> dict[str, int]:
        out = super().pids()
        if isinstance(self.redis_server, RedisServer) and self.redis_server.proc:
            out["redis"] = self.redis_server.proc.pid
        return out

    def _spawn(self, name: str, role: str, **extra: str) -> None:
        self.start(name, role, **{**({} if role == "scheduler" else SINGLE_THREAD), **self.role_env.get(role, {}),
                                  **extra})

    def start_stack(self, timeout: float = 300.0) -> BenchStack:
        self.redis_server = self.given_redis or RedisServer().start()
        self.base_env["RSINFER_REDIS_URL"] = self.redis_server.url
        for role in ("tokenizer", "scheduler", "detokenizer"):
            copies = self.schedulers if role == "scheduler" else 1
            for i in range(copies):
                self._spawn(f"{role}{i}" if copies > 1 else role, role)
        for i in range(self.apis):
            port = free_port()
            self.ports.append(port)
            self._spawn(f"api{i}" if self.apis > 1 else "api", "api", RSINFER_PORT=str(port))
        deadline = time.monotonic() + timeout
        for url in self.urls:  # the API up and every stage of the model live
            self.wait_serving(url, self.name, max(0.0, deadline - time.monotonic()), self.api_key)
        return self

    def stop(self, grace: float = 20.0) -> None:
        super().stop(grace)
        if self.redis_server is not None and self.redis_server is not self.given_redis:
            self.redis_server.stop()
        self.redis_server = None

    def __enter__(self) -> BenchStack:
        try:
            return self.start_stack()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, exc_type, *exc) -> None:
        self.stop()
        if exc_type is None:  # the logs are kept (their folder is named in the error) only when something failed
            shutil.rmtree(self.log_dir, ignore_errors=True)  # type: ignore[arg-type]


# ---- what the processes used


def cpu_ticks(pids: dict[str, int]) -> dict[str, int]:
    out = {}
    for name, pid in pids.items():
        with contextlib.suppress(OSError):
            out[name] = proc_cpu_ticks(Path(f"/proc/{pid}/stat").read_text())
    return out


def rss_kb(pid: int, key: str = "VmHWM") -> int:
    with contextlib.suppress(OSError):
        return proc_status_kb(Path(f"/proc/{pid}/status").read_text(), key)
    return 0


def redis_commands(url: str) -> dict[str, int]:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return command_calls(client.info("commandstats"))
    finally:
        client.close()


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---- load through the raw-socket client (rsinfer/sse_client.py)


@dataclass
class LoadResult:
    outcomes: list[Reply]
    wall: float
    client_cpu_s: float

    @property
    def ok(self) -> list[Reply]:
        return [o for o in self.outcomes if o.ok]

    @property
    def tokens(self) -> int:
        return sum(o.tokens for o in self.ok)

    def spans(self) -> list[Span]:
        return [Span(o.sent, o.sent + o.ttft, o.wall(o.ended), o.tokens) for o in self.ok]

    def summary(self) -> dict:
        ok = self.ok
        gaps = [b - a for o in ok for a, b in itertools.pairwise(o.content_at)]
        ttft = [o.ttft for o in ok]
        return {"requests": len(self.outcomes), "ok": len(ok), "tokens": self.tokens, "wall_s": round(self.wall, 3),
                "tok_per_s": round(self.tokens / self.wall, 1) if self.wall else 0.0,
                "ttft_p50_ms": round(1000 * percentile(ttft, 0.5), 1),
                "ttft_p99_ms": round(1000 * percentile(ttft, 0.99), 1),
                "itl_p50_ms": round(1000 * percentile(gaps, 0.5), 2),
                "itl_p99_ms": round(1000 * percentile(gaps, 0.99), 2),
                "chunks_per_request": round(sum(len(o.content_at) for o in ok) / len(ok), 1) if ok else 0.0,
                "client_cpu_s": round(self.client_cpu_s, 2),
                "errors": sorted({o.problem for o in self.outcomes if not o.ok})[:5],
                "error_counts": error_counts(o.problem for o in self.outcomes if not o.ok)}


def run_load(urls: list[str], bodies: list[bytes], concurrency: int, *, stagger_s: float = 0.0,
             processes: int = 1, timeout: float = 600.0) -> LoadResult:
    """Send every body (a streamed /v1/completions request) at most `concurrency` at a time, request i
    starting no earlier than i * stagger_s, alternating over `urls`, from `processes` client processes
    (sse_client.run_load)."""
    requests = [Request(urls[i % len(urls)], body, timeout=timeout) for i, body in enumerate(bodies)]
    return LoadResult(*sse_client.run_load(requests, concurrency, stagger_s, processes))


def completion_body(model: str, prompt: list[int] | str, max_tokens: int, **extra) -> bytes:
    return orjson.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                         "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}, **extra})


# ---- the official openai client (vs transformers serve)

# Greedy answers of max_tokens tokens from `transformers serve`, which ignores `ignore_eos`: its
# generation_config field overrides the model's settings key by key, so EOS has to be one no token has (without
# it the demo model's answers end after ~6 tokens).
TRANSFORMERS_BODY = {"generation_config": json.dumps({"do_sample": False, "eos_token_id": [-1]})}


class ChatLoad(NamedTuple):
    """`requests` streamed chat completions of `max_tokens` tokens each, `concurrency` at a time."""

    requests: int
    concurrency: int
    max_tokens: int


async def openai_load(base_url: str, model: str, load: ChatLoad, extra_body: dict) -> dict:
    """`load` through openai.AsyncOpenAI."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(load.concurrency)
    max_tokens = load.max_tokens

    async def one(i: int) -> Reply:
        async with sem:
            out = Reply()
            try:
                stream = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": f"Request {i}: tell me a long story"}],
                    max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
                    extra_body=extra_body)
                async for chunk in stream:
                    if chunk.usage:
                        out.usage = {"completion_tokens": chunk.usage.completion_tokens}
                    if chunk.choices and chunk.choices[0].delta.content:
                        out.content_at.append(time.monotonic())
                out.done = True
            except openai.OpenAIError as e:
                out.error = repr(e)[:200]
            out.ended = time.monotonic()
            return out

    try:
        before = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(one(i) for i in range(load.requests)))
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        await client.close()
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return LoadResult(list(outcomes), wall, cpu).summary()
