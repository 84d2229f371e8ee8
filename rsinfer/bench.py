"""`rsinfer bench`: a load generator for a running API (any OpenAI-compatible server).

It streams /v1/completions over plain asyncio sockets (an httpx client saturates at a few thousand
tokens/s and ends up measuring itself), counts tokens from the usage chunk, and prints throughput,
TTFT, inter-token latency and its own CPU use; `--output` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import statistics
import time
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field

WORDS = (
    "the quick brown fox jumps over a lazy dog while redis streams carry tokens between "
    "stages of a serving system that batches requests on every engine step"
).split()


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="API base URL")
    p.add_argument("--model", default=None, help="model name (default: the first in /v1/models)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stagger-ms", type=float, default=5.0, help="delay between request starts")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write results JSON here")


@dataclass
class Result:
    ok: bool
    tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    gaps: list[float] = field(default_factory=list)
    error: str = ""


async def _read_chunked(reader: asyncio.StreamReader):
    while True:
        size = int((await reader.readline()).strip() or b"0", 16)
        if size == 0:
            return
        data = await reader.readexactly(size)
        await reader.readexactly(2)
        yield data


async def one_request(url: str, body: dict, api_key: str | None) -> Result:
    u = urllib.parse.urlsplit(url)
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nAccept: text/event-stream\r\nConnection: close\r\n")
    if api_key:
        head += f"Authorization: Bearer {api_key}\r\n"
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(u.hostname, u.port or 80)
    res = Result(ok=False)
    try:
        writer.write(head.encode() + b"\r\n" + payload)
        status = (await reader.readline()).decode()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        if " 200 " not in status:
            res.error = status.strip()
            return res
        buf, last = b"", None
        async for data in _read_chunked(reader):
            buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    msg = json.loads(line[6:])
                    now = time.perf_counter()
                    if msg.get("usage"):
                        res.tokens = msg["usage"]["completion_tokens"]
                    if msg.get("choices") and msg["choices"][0].get("text"):
                        if last is None:
                            res.ttft = now - start
                        else:
                            res.gaps.append(now - last)
                        last = now
        res.latency = time.perf_counter() - start
        res.ok = True
        return res
    finally:
        writer.close()


def _model(url: str, api_key: str | None) -> str:
    req = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.load(resp)["data"][0]["id"]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run_bench(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    model = args.model or _model(args.url, args.api_key)
    sem = asyncio.Semaphore(args.concurrency)

    async def worker(i: int) -> Result:
        await asyncio.sleep(i * args.stagger_ms / 1000)
        prompt = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
        body = {"model": model, "prompt": f"{i} {prompt}", "max_tokens": args.max_tokens, "stream": True,
                "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
        async with sem:
            try:
                return await one_request(args.url, body, args.api_key)
            except (OSError, ValueError, asyncio.IncompleteReadError) as e:
                return Result(ok=False, error=repr(e))

    cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    results = await asyncio.gather(*(worker(i) for i in range(args.requests)))
    wall, cpu1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    ok = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in ok)
    gaps = [g for r in ok for g in r.gaps]
    summary = {
        "model": model, "url": args.url, "requests": args.requests, "ok": len(ok), "concurrency": args.concurrency,
        "max_tokens": args.max_tokens, "prompt_words": args.prompt_words, "wall_s": round(wall, 3),
        "output_tokens": tokens, "output_tok_per_s": round(tokens / wall, 1),
        "ttft_p50_ms": round(1000 * _pct([r.ttft for r in ok], 0.5), 1),
        "ttft_p99_ms": round(1000 * _pct([r.ttft for r in ok], 0.99), 1),
        "itl_p50_ms": round(1000 * _pct(gaps, 0.5), 2), "itl_p99_ms": round(1000 * _pct(gaps, 0.99), 2),
        "latency_mean_s": round(statistics.mean([r.latency for r in ok]), 3) if ok else 0.0,
        "client_cpu_s": round((cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime), 2),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    for k, v in summary.items():
        print(f"{k:18} {v}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"summary": summary, "requests": [asdict(r) | {"gaps": None} for r in results]}, f, indent=1)
    return 0 if len(ok) == args.requests else 1
