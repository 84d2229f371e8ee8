"""What bench/run_all.py drives: a stack of rsinfer processes (the ones `rsinfer up` starts, with as many API
processes as asked), per-process CPU and Redis command snapshots, and load generators that hold thousands
of streams (a raw-socket asyncio client in several processes) or use the official openai client.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import orjson

from bench.report import Span, command_calls, error_counts, percentile, proc_cpu_ticks, proc_status_kb
from rsinfer.up import serving
from shared import children
from shared.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent
SINGLE_THREAD = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (inherited by the processes started after); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# ---- the stack


class BenchStack:
    """redis-server, one tokenizer, `schedulers` schedulers (one by default) and one detokenizer, and `apis` API
    processes, each its own process (as `rsinfer up` runs them: one torch thread each but the scheduler's default);
    stopped in reverse order."""

    def __init__(self, model_dir: str, name: str, apis: int = 1, env: dict[str, dict[str, str]] | None = None,
                 schedulers: int = 1):
        self.model_dir, self.name, self.apis, self.schedulers = model_dir, name, apis, schedulers
        self.role_env = env or {}
        self.log_dir = Path(tempfile.mkdtemp(prefix="rsinfer-bench-"))
        self.redis_server: RedisServer | None = None
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.ports: list[int] = []

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def pids(self) -> dict[str, int]:
        out = {name: p.pid for name, p in self.procs}
        if self.redis_server and self.redis_server.proc:
            out["redis"] = self.redis_server.proc.pid
        return out

    def _spawn(self, name: str, role: str, extra: dict[str, str]) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RSINFER_")}
        env.update({"RSINFER_REDIS_URL": self.redis_server.url, "RSINFER_MODEL": self.model_dir,  # type: ignore
                    "RSINFER_SERVED_MODEL_NAME": self.name, "RSINFER_LOG_LEVEL": "WARNING"})
        env.update({} if role == "scheduler" else SINGLE_THREAD)
        env.update(self.role_env.get(role, {}))
        env.update(extra)
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115  (owned by the child)
        proc = children.spawn([sys.executable, "-m", "rsinfer.cli", role], env=env, stdout=log,
                              stderr=subprocess.STDOUT, cwd=ROOT)
        self.procs.append((name, proc))

    def start(self, timeout: float = 300.0) -> BenchStack:
        self.redis_server = RedisServer().start()
        for role in ("tokenizer", "scheduler", "detokenizer"):
            copies = self.schedulers if role == "scheduler" else 1
            for i in range(copies):
                self._spawn(f"{role}{i}" if copies > 1 else role, role, {})
        for i in range(self.apis):
            port = free_port()
            self.ports.append(port)
            self._spawn(f"api{i}" if self.apis > 1 else "api", "api", {"RSINFER_PORT": str(port)})
        deadline = time.monotonic() + timeout
        for url in self.urls:
            self._wait_ready(url, deadline)
        return self

    def _wait_ready(self, url: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} exited; logs in {self.log_dir}")
            if serving(url, self.name):  # the API up and every stage of the model live
                return
            time.sleep(0.3)
        raise TimeoutError(f"{url} not ready; logs in {self.log_dir}")

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for _, proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        if self.redis_server:
            self.redis_server.stop()

    def __enter__(self) -> BenchStack:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, exc_type, *exc) -> None:
        self.stop()
        if exc_type is None:  # the logs are kept (their folder is named in the error) only when something failed
            shutil.rmtree(self.log_dir, ignore_errors=True)


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


# ---- the raw-socket load generator


@dataclass
class Outcome:
    ok: bool
    start: float = 0.0  # time.time() when sent
    ttft: float = 0.0
    end: float = 0.0
    tokens: int = 0
    chunks: list[float] = field(default_factory=list)  # perf_counter offsets from send of content chunks
    error: str = ""


async def _read_event_stream(reader: asyncio.StreamReader, on_event: Callable[[bytes], None]) -> None:
    """Chunked transfer-encoding carrying SSE: call on_event with each `data:` payload."""
    buf = b""
    while True:
        size = int((await reader.readline()).strip() or b"0", 16)
        if size == 0:
            return
        buf += await reader.readexactly(size)
        await reader.readexactly(2)
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    on_event(line[6:])


async def stream_one(url: str, body: bytes, timeout: float) -> Outcome:
    u = urllib.parse.urlsplit(url)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nAccept: text/event-stream\r\nConnection: close\r\n\r\n").encode()
    out = Outcome(ok=False, start=time.time())
    t0 = time.perf_counter()
    writer = None

    def on_event(data: bytes) -> None:
        msg = orjson.loads(data)
        if msg.get("usage"):
            out.tokens = msg["usage"]["completion_tokens"]
        if msg.get("choices") and msg["choices"][0].get("text"):
            out.chunks.append(time.perf_counter() - t0)

    async def run() -> None:
        nonlocal writer
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
        writer.write(head + body)
        status = await reader.readline()
        while await reader.readline() not in (b"\r\n", b""):  # headers
            pass
        if b" 200 " not in status:
            out.error = status.decode().strip() + " " + (await reader.read(300)).decode(errors="replace")
            return
        await _read_event_stream(reader, on_event)
        out.ok = True

    try:
        await asyncio.wait_for(run(), timeout)
    except (OSError, ValueError, asyncio.IncompleteReadError, TimeoutError) as e:
        out.error = repr(e)[:200]
    finally:
        if writer is not None:
            writer.close()
    out.end = out.start + (time.perf_counter() - t0)
    out.ttft = out.chunks[0] if out.chunks else 0.0
    return out


@dataclass(frozen=True)
class LoadPart:
    urls: list[str]
    bodies: list[bytes]  # this part's requests, in start order
    offsets: list[float]  # each request's start, seconds after start_at
    concurrency: int
    start_at: float  # time.time() when the first request of every part may start
    timeout: float


async def _run_part(part: LoadPart) -> list[Outcome]:
    sem = asyncio.Semaphore(part.concurrency)

    async def one(i: int) -> Outcome:
        await asyncio.sleep(max(0.0, part.start_at + part.offsets[i] - time.time()))
        async with sem:
            return await stream_one(part.urls[i], part.bodies[i], part.timeout)

    return await asyncio.gather(*(one(i) for i in range(len(part.bodies))))


def _part_main(part: LoadPart) -> tuple[list[Outcome], float]:
    raise_fd_limit()
    before = resource.getrusage(resource.RUSAGE_SELF)
    outcomes = asyncio.run(_run_part(part))
    after = resource.getrusage(resource.RUSAGE_SELF)
    return outcomes, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


@dataclass
class LoadResult:
    outcomes: list[Outcome]
    wall: float
    client_cpu_s: float

    @property
    def ok(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.ok]

    @property
    def tokens(self) -> int:
        return sum(o.tokens for o in self.ok)

    def spans(self) -> list[Span]:
        return [Span(o.start, o.start + o.ttft, o.end, o.tokens) for o in self.ok]

    def summary(self) -> dict:
        ok = self.ok
        gaps = [b - a for o in ok for a, b in zip(o.chunks, o.chunks[1:], strict=False)]
        ttft = [o.ttft for o in ok]
        return {"requests": len(self.outcomes), "ok": len(ok), "tokens": self.tokens, "wall_s": round(self.wall, 3),
                "tok_per_s": round(self.tokens / self.wall, 1) if self.wall else 0.0,
                "ttft_p50_ms": round(1000 * percentile(ttft, 0.5), 1),
                "ttft_p99_ms": round(1000 * percentile(ttft, 0.99), 1),
                "itl_p50_ms": round(1000 * percentile(gaps, 0.5), 2),
                "itl_p99_ms": round(1000 * percentile(gaps, 0.99), 2),
                "chunks_per_request": round(sum(len(o.chunks) for o in ok) / len(ok), 1) if ok else 0.0,
                "client_cpu_s": round(self.client_cpu_s, 2),
                "errors": sorted({o.error for o in self.outcomes if not o.ok})[:5],
                "error_counts": error_counts(o.error for o in self.outcomes if not o.ok)}


def run_load(urls: list[str], bodies: list[bytes], concurrency: int, stagger_s: float = 0.0,
             processes: int = 1, timeout: float = 600.0) -> LoadResult:
    """Send every body (a streamed /v1/completions request) at most `concurrency` at a time, request i
    starting no earlier than i * stagger_s, alternating over `urls`; `processes` client processes share the
    requests and the concurrency (a single Python process cannot parse tens of thousands of events a second)."""
    n = len(bodies)
    processes = max(1, min(processes, n))
    start_at = time.time() + (0.5 if processes > 1 else 0.05)
    parts = []
    for k in range(processes):
        idx = list(range(k, n, processes))
        share = concurrency // processes + (1 if k < concurrency % processes else 0)
        parts.append(LoadPart([urls[i % len(urls)] for i in idx], [bodies[i] for i in idx],
                              [i * stagger_s for i in idx], max(1, share), start_at, timeout))
    t0 = time.time()
    if processes == 1:
        results = [_part_main(parts[0])]
    else:
        with ProcessPoolExecutor(processes, mp_context=get_context("fork")) as pool:
            results = list(pool.map(_part_main, parts))
    outcomes = [o for part, _ in results for o in part]
    first = min((o.start for o in outcomes), default=t0)
    wall = max((o.end for o in outcomes), default=t0) - first
    return LoadResult(outcomes, wall, sum(cpu for _, cpu in results))


def completion_body(model: str, prompt: list[int] | str, max_tokens: int, **extra) -> bytes:
    return orjson.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                         "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}, **extra})


# ---- the official openai client (vs transformers serve)


async def openai_load(base_url: str, model: str, requests: int, concurrency: int, max_tokens: int,
                      extra_body: dict) -> dict:
    """Streamed chat completions through openai.AsyncOpenAI, `concurrency` at a time."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> Outcome:
        async with sem:
            out = Outcome(ok=False, start=time.time())
            t0 = time.perf_counter()
            try:
                stream = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": f"Request {i}: tell me a long story"}],
                    max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
                    extra_body=extra_body)
                async for chunk in stream:
                    if chunk.usage:
                        out.tokens = chunk.usage.completion_tokens
                    if chunk.choices and chunk.choices[0].delta.content:
                        out.chunks.append(time.perf_counter() - t0)
                out.ok = True
            except openai.OpenAIError as e:
                out.error = repr(e)[:200]
            out.end = out.start + time.perf_counter() - t0
            out.ttft = out.chunks[0] if out.chunks else 0.0
            return out

    try:
        before = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(one(i) for i in range(requests)))
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        await client.close()
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return LoadResult(list(outcomes), wall, cpu).summary()
