"""Adapter-aware routing vs the shared stream: LoRA adapter loads with 2 schedulers and 4 adapters (issue 23).

    python bench/lora_routing.py                        # 2 schedulers of 2 slots, 4 adapters, 64 requests, 4 at a time
    python bench/lora_routing.py --requests 128 --concurrency 8 --repeat 3

Per configuration a fresh stack (redis-server, a tokenizer with or without `--prefix-routing`, `--schedulers`
schedulers with `--max-loras` slots each, a detokenizer, the API) on the demo model, with `--adapters` random PEFT
adapters (rank 16 on every projection) registered by `--lora-modules`; then `--requests` streamed `/generate`
requests (greedy, ignore_eos, `--max-tokens`), each naming an adapter in a seeded random order (the same in both
configurations), `--concurrency` at a time. Figures: the adapter loads and evictions of all schedulers (their
heartbeats' `lora_loads`, `lora_evictions`), the requests routed to a scheduler's own stream (their records'
schedule entry), TTFT p50/p99 and output tokens/s over the wall time. A load reads the folder and copies it into
a slot: on the demo model it costs milliseconds, on a real model and a GPU the copy of its weights, and a request
waits for it. Prints the figures and writes bench/results/lora-routing.json (docs/benchmarks.md reads it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import BenchStack, loadavg  # noqa: E402
from bench.prefix_routing import Workload, commit, generate, routed_share, wait_for_beats  # noqa: E402
from bench.report import percentile  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "lora-routing.json"
SCHEDULER_ENV = {"RSINFER_THREADS": "1", "OMP_NUM_THREADS": "1", "RSINFER_MAX_KV_TOKENS": "8192"}


def write_adapters(model_dir: str, folder: Path, count: int) -> dict[str, Path]:
    import torch
    from transformers import AutoModelForCausalLM

    from bench.lora_bench import write_adapter

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = {}
    for k in range(count):
        out[f"a{k}"] = folder / f"a{k}"
        write_adapter(model, out[f"a{k}"], rank=16, seed=k + 1)
    return out


async def drive(url: str, order: list[str], prompt: list[int], w: Workload, concurrency: int) -> list:
    sem = asyncio.Semaphore(concurrency)

    async def one(adapter: str):
        async with sem:
            return await generate(url, adapter, prompt, w, 120)

    return await asyncio.gather(*(one(a) for a in order))


def measure(model_dir: str, name: str, adapters: dict[str, Path], routing: bool, args: argparse.Namespace, *,
            say=print) -> dict:
    env = {"tokenizer": {"RSINFER_PREFIX_ROUTING": "true" if routing else "false"},
           "scheduler": {**SCHEDULER_ENV, "RSINFER_MAX_LORAS": str(args.max_loras)}}
    modules = " ".join(f"{n}={p}" for n, p in adapters.items())
    roots = " ".join(sorted({str(p.parent) for p in adapters.values()}))  # local folders load from --lora-roots
    for role in ("tokenizer", "scheduler", "detokenizer", "api"):
        env.setdefault(role, {}).update(RSINFER_LORA_MODULES=modules, RSINFER_LORA_ROOTS=roots)
    order = [n for n in adapters for _ in range(args.requests // len(adapters))]
    random.Random(args.seed).shuffle(order)
    prompt = [(i * 37) % 900 + 50 for i in range(args.prompt_tokens)]
    w = Workload([], [], [], args.max_tokens)
    with BenchStack(model_dir, name, env=env, schedulers=args.schedulers) as stack:
        url, redis_url = stack.urls[0], stack.redis_server.url  # type: ignore[union-attr]
        before = wait_for_beats(redis_url, args.schedulers, 0.0, routing)
        load_before = loadavg()
        began = time.perf_counter()
        turns = asyncio.run(drive(url, order, prompt, w, args.concurrency))
        wall = time.perf_counter() - began
        after = wait_for_beats(redis_url, args.schedulers, time.time(), routing)
        routed, admitted = routed_share(redis_url)
    ok = [t for t in turns if t.ok]
    ttft = [t.ttft for t in ok]

    def delta(key: str) -> int:
        return sum(after[s].get(key, 0) - before.get(s, {}).get(key, 0) for s in after)

    out = {"routing": routing, "requests": len(turns), "ok": len(ok), "lora_loads": delta("lora_loads"),
           "lora_evictions": delta("lora_evictions"), "routed": routed, "admitted": admitted,
           "ttft_p50_ms": round(1000 * percentile(ttft, 0.5), 1),
           "ttft_p99_ms": round(1000 * percentile(ttft, 0.99), 1),
           "wall_s": round(wall, 2), "output_tok_per_s": round(sum(len(t.output_ids) for t in ok) / wall, 1),
           "errors": sorted({t.error for t in turns if not t.ok})[:5], "loadavg_before": load_before}
    label = "adapter-aware routing" if routing else "shared stream"
    say(f"  {label:22}: {out['lora_loads']} loads, {out['lora_evictions']} evictions, routed "
        f"{out['routed']}/{out['admitted']}, TTFT p50/p99 {out['ttft_p50_ms']:.0f}/{out['ttft_p99_ms']:.0f} ms, "
        f"{out['output_tok_per_s']:,.0f} output tok/s, {out['ok']}/{out['requests']} ok, {out['wall_s']:.1f} s")
    return out


def run(model_dir: str, name: str, args: argparse.Namespace, say=print) -> dict:
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    say(f"LoRA routing: {args.schedulers} schedulers x {args.max_loras} slots, {args.adapters} adapters, "
        f"{args.requests} requests ({args.concurrency} at a time, {args.max_tokens} tokens each)")
    runs = []
    with tempfile.TemporaryDirectory(prefix="rsinfer-lora-bench-") as tmp:
        adapters = write_adapters(model_dir, Path(tmp), args.adapters)
        for k in range(args.repeat):
            for routing in (False, True):
                runs.append({**measure(model_dir, name, adapters, routing, args, say=say), "repeat": k})
    summary = {key: [statistics.median(r[key] for r in runs if r["routing"] == flag) for flag in (False, True)]
               for key in ("lora_loads", "lora_evictions", "ttft_p50_ms", "ttft_p99_ms", "output_tok_per_s")}
    return {"config": {k: v for k, v in vars(args).items() if k != "output"} | {"scheduler_env": SCHEDULER_ENV},
            "meta": {"started_at": started, "cpus": os.cpu_count(), "commit": commit()}, "runs": runs,
            "summary": summary}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedulers", type=int, default=2)
    ap.add_argument("--max-loras", type=int, default=2)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--seed", type=int, default=23)
    ap.add_argument("--output", default=str(RESULTS))
    return ap


def main() -> int:
    from shared.demo_model import ensure_demo_model

    args = parser().parse_args()
    model_dir = str(ensure_demo_model())
    results = run(model_dir, "rsinfer-demo", args)
    Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
