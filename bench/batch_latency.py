"""Interactive latency beside a batch (issue 22): TTFT of interactive requests on an idle stack, and while a batch
of chat lines runs on the same engine.

    python bench/batch_latency.py                      # 300 batch lines of 32 tokens, 40 interactive requests
    python bench/batch_latency.py --lines 600 --interactive 80

One stack (redis-server, a tokenizer, a scheduler, a detokenizer, the API, each its own process) on the demo model.
Interactive requests are streamed /generate requests (greedy, `ignore_eos`, `--max-tokens`), one every
`--gap-s`: first with nothing else running, then while a batch of `--lines` chat lines (`--batch-tokens` each)
runs, submitted through `POST /v1/files` and `POST /v1/batches`. Figures: TTFT p50/p99/max in both phases and
their ratio, the batch's lines done during the loaded phase, and the load average. Prints them and writes
bench/results/batch-latency.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import BenchStack, loadavg  # noqa: E402
from bench.prefix_routing import Workload, commit, generate  # noqa: E402
from bench.report import percentile  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "batch-latency.json"
SCHEDULER_ENV = {"RSINFER_THREADS": "1", "OMP_NUM_THREADS": "1"}


async def interactive(url: str, model: str, args: argparse.Namespace) -> list[float]:
    """TTFTs of `--interactive` requests sent one every `--gap-s` (each with its own prompt)."""
    w = Workload([], [], [], args.max_tokens)

    async def one(k: int) -> float | None:
        turn = await generate(url, model, [(k * 31 + j) % 900 + 50 for j in range(args.prompt_tokens)], w)
        return turn.ttft if turn.ok else None

    tasks = []
    for k in range(args.interactive):
        tasks.append(asyncio.create_task(one(k)))
        await asyncio.sleep(args.gap_s)
    return [t for t in await asyncio.gather(*tasks) if t is not None]


def start_batch(url: str, model: str, args: argparse.Namespace) -> str:
    rows = [json.dumps({"custom_id": f"b{k}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": model, "messages": [{"role": "user", "content": f"Batch line {k}"}],
        "max_tokens": args.batch_tokens, "ignore_eos": True, "temperature": 0}}) for k in range(args.lines)]
    f = httpx.post(f"{url}/v1/files", files={"file": ("in.jsonl", "\n".join(rows).encode())},
                   data={"purpose": "batch"}, timeout=60).json()
    b = httpx.post(f"{url}/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                              "completion_window": "24h"}, timeout=60).json()
    return b["id"]


def batch_counts(url: str, batch_id: str) -> dict:
    b = httpx.get(f"{url}/v1/batches/{batch_id}", timeout=30).json()
    return {"status": b["status"], **b["request_counts"]}


def figures(ttfts: list[float]) -> dict:
    ms = sorted(t * 1000 for t in ttfts)
    return {"requests": len(ms), "ttft_p50_ms": round(statistics.median(ms), 1),
            "ttft_p99_ms": round(percentile(ms, 99), 1), "ttft_max_ms": round(ms[-1], 1)}


def run(model_dir: str, name: str, args: argparse.Namespace) -> dict:
    with BenchStack(model_dir, name, env={"scheduler": SCHEDULER_ENV}) as stack:
        url = stack.urls[0]
        asyncio.run(interactive(url, name, argparse.Namespace(**{**vars(args), "interactive": 4})))  # warm up
        idle = figures(asyncio.run(interactive(url, name, args)))
        batch_id = start_batch(url, name, args)
        time.sleep(args.settle_s)  # the batch's lines are running before the first interactive request
        before = batch_counts(url, batch_id)
        loaded = figures(asyncio.run(interactive(url, name, args)))
        after = batch_counts(url, batch_id)
        load = loadavg()
    return {"commit": commit(), "args": vars(args), "idle": idle, "with_batch": loaded,
            "p99_ratio": round(loaded["ttft_p99_ms"] / idle["ttft_p99_ms"], 2),
            "p50_ratio": round(loaded["ttft_p50_ms"] / idle["ttft_p50_ms"], 2),
            "batch": {"before": before, "after": after,
                      "lines_during_loaded_phase": after["completed"] - before["completed"]},
            "loadavg": load}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=300)
    ap.add_argument("--batch-tokens", type=int, default=32)
    ap.add_argument("--interactive", type=int, default=40)
    ap.add_argument("--gap-s", type=float, default=0.5)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--settle-s", type=float, default=3.0)
    ap.add_argument("--output", default=str(RESULTS))
    return ap


def main() -> int:
    args = parser().parse_args()
    from shared.demo_model import ensure_demo_model
    from shared.settings import DEMO_MODEL_NAME

    result = run(str(ensure_demo_model()), DEMO_MODEL_NAME, args)
    print(json.dumps({k: result[k] for k in ("idle", "with_batch", "p50_ratio", "p99_ratio", "batch")}, indent=1))
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
