"""`rsinfer bench`: a load generator for a running API (any OpenAI-compatible server).

It streams /v1/completions with rsinfer/sse_client.py (plain asyncio sockets: an httpx client saturates at a
few thousand tokens/s and ends up measuring itself), counts tokens from the usage chunk, and prints
throughput, TTFT, inter-token latency and its own CPU use; `--output` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import urllib.request

from rsinfer.sse_client import Reply, Request, run_load

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


def _model(url: str, api_key: str | None) -> str:
    req = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.load(resp)["data"][0]["id"]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_bench(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    model = args.model or _model(args.url, args.api_key)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    requests = []
    for i in range(args.requests):
        prompt = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
        body = {"model": model, "prompt": f"{i} {prompt}", "max_tokens": args.max_tokens, "stream": True,
                "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
        requests.append(Request(args.url, json.dumps(body).encode(), headers=headers))
    results, wall, client_cpu = run_load(requests, args.concurrency, args.stagger_ms / 1000)
    ok = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in ok)
    gaps = [g for r in ok for g in _gaps(r)]
    summary = {
        "model": model, "url": args.url, "requests": args.requests, "ok": len(ok), "concurrency": args.concurrency,
        "max_tokens": args.max_tokens, "prompt_words": args.prompt_words, "wall_s": round(wall, 3),
        "output_tokens": tokens, "output_tok_per_s": round(tokens / wall, 1),
        "ttft_p50_ms": round(1000 * _pct([r.ttft for r in ok], 0.5), 1),
        "ttft_p99_ms": round(1000 * _pct([r.ttft for r in ok], 0.99), 1),
        "itl_p50_ms": round(1000 * _pct(gaps, 0.5), 2), "itl_p99_ms": round(1000 * _pct(gaps, 0.99), 2),
        "latency_mean_s": round(statistics.mean([r.ended - r.t0 for r in ok]), 3) if ok else 0.0,
        "client_cpu_s": round(client_cpu, 2),
        "errors": sorted({r.problem for r in results if not r.ok})[:5],
    }
    for k, v in summary.items():
        print(f"{k:18} {v}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"summary": summary, "requests": [_request(r) for r in results]}, f, indent=1)
    return 0 if len(ok) == args.requests else 1


def _gaps(r: Reply) -> list[float]:
    return [b - a for a, b in itertools.pairwise(r.content_at)]


def _request(r: Reply) -> dict:
    return {"ok": r.ok, "tokens": r.tokens, "ttft": r.ttft, "latency": r.ended - r.t0, "gaps": None,
            "error": r.problem}
