"""What stop strings cost the pipeline: the same streamed workload with no stop strings and with many long ones
(that never match, so every request runs to max_tokens), on one stack of the demo model.

    python bench/stop_strings.py [--requests 64] [--concurrency 16] [--max-tokens 128] [--stops 16] [--stop-bytes 256]

Per configuration: output tok/s, CPU µs per generated token of every process, Redis commands per token, and the
bytes clients sent Redis per token (INFO stats `total_net_input_bytes`: every XADD, HSET and EVAL the stages
write) with the growth of Redis' `used_memory_peak`. Writes bench/results/stop-strings.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402
from bench.harness import BenchStack, completion_body, cpu_ticks, redis_commands, run_load  # noqa: E402
from shared.demo_model import ensure_demo_model  # noqa: E402


def redis_stats(url: str) -> dict[str, int]:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return {"net_input": int(client.info("stats")["total_net_input_bytes"]),
                "memory_peak": int(client.info("memory")["used_memory_peak"])}
    finally:
        client.close()


def stop_strings(count: int, size: int, seed: int) -> list[str]:
    """`count` distinct strings of `size` bytes (ASCII letters and a digit run the demo model never writes)."""
    rng = random.Random(seed)
    return [f"{k:04d}" + "".join(rng.choice("qxzjQXZJ") for _ in range(size - 4)) for k in range(count)]


def measure(stack: BenchStack, bodies: list[bytes], concurrency: int) -> dict:
    pids = stack.pids()
    clk = os.sysconf("SC_CLK_TCK")
    url = stack.redis_server.url  # type: ignore[union-attr]
    stats0, cmds0, ticks0 = redis_stats(url), redis_commands(url), cpu_ticks(pids)
    load = run_load(stack.urls, bodies, concurrency)
    ticks1, cmds1, stats1 = cpu_ticks(pids), redis_commands(url), redis_stats(url)
    summary = load.summary()
    tokens = summary["tokens"]
    delta = report.command_delta(cmds0, cmds1)
    return {
        "load": summary,
        "us_per_token": {name: round(report.us_per_token(ticks1[name] - ticks0[name], clk, tokens), 1)
                         for name in pids},
        "redis_cmds_per_token": round(sum(delta.values()) / tokens, 3) if tokens else 0.0,
        "redis_bytes_in_per_token": round((stats1["net_input"] - stats0["net_input"]) / tokens, 1) if tokens else 0,
        "redis_bytes_in_mib": round((stats1["net_input"] - stats0["net_input"]) / 2**20, 2),
        "redis_peak_growth_mib": round((stats1["memory_peak"] - stats0["memory_peak"]) / 2**20, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--stops", type=int, default=16, help="stop strings per request")
    ap.add_argument("--stop-bytes", type=int, default=256, help="bytes of each stop string")
    ap.add_argument("--runs", type=int, default=2, help="runs per configuration, interleaved; the median is kept")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "stop-strings.json"))
    args = ap.parse_args()
    model_dir = str(ensure_demo_model())
    name = "rsinfer-demo"
    rng = random.Random(7)
    prompts = [[rng.randrange(16, 1000) for _ in range(32)] for _ in range(args.requests)]
    configs = {
        "no_stop": [completion_body(name, p, args.max_tokens) for p in prompts],
        f"{args.stops}x{args.stop_bytes}B_stops": [
            completion_body(name, p, args.max_tokens, stop=stop_strings(args.stops, args.stop_bytes, i))
            for i, p in enumerate(prompts)],
    }
    runs: dict[str, list[dict]] = {k: [] for k in configs}
    with BenchStack(model_dir, name) as stack:
        run_load(stack.urls, configs["no_stop"][:8], 8)  # warm-up
        for _ in range(args.runs):
            for key, bodies in configs.items():
                out = measure(stack, bodies, args.concurrency)
                runs[key].append(out)
                print(f"{key:>22}: {out['load']['tok_per_s']:8,.0f} tok/s ({out['load']['ok']}/{args.requests} ok); "
                      f"µs/token " + ", ".join(f"{k} {v:.0f}" for k, v in out["us_per_token"].items()) +
                      f"; Redis {out['redis_cmds_per_token']:.2f} cmds/token, "
                      f"{out['redis_bytes_in_per_token']:,.0f} B in/token ({out['redis_bytes_in_mib']} MiB), "
                      f"peak +{out['redis_peak_growth_mib']} MiB", flush=True)
    median = {k: sorted(v, key=lambda r: r["redis_bytes_in_per_token"])[len(v) // 2] for k, v in runs.items()}
    result = {"at": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": vars(args), "median": median, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
