"""A Redis Cluster against a standalone Redis, same load; then a primary killed under load.

Two stacks (tokenizer, scheduler with the synthetic engine, detokenizer, API: `rsinfer up`'s processes) run side
by side: one on a standalone redis-server, one on a local Redis Cluster of 3 primaries and 3 replicas. Their load
runs alternate (so the machine's other load falls on both alike) and each reports output tok/s. Then, on the
cluster, 32 long streams run while the primary holding the detokenize stream is killed (kill -9): the script
reports how long the cluster took to promote its replica, the longest pause any stream saw, how long new requests
waited, and how the streams ended. Figures go to bench/results/cluster.json.

    python bench/cluster_bench.py [--runs 3] [--streams 128] [--requests 256] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import BenchStack, completion_body, loadavg, run_load  # noqa: E402
from rsinfer.redis_server import RedisServer  # noqa: E402
from rsinfer.sse_client import Request, StreamThread  # noqa: E402
from shared.demo_model import ensure_demo_model  # noqa: E402
from shared.keys import Keys  # noqa: E402
from tests.support.redis_cluster import LocalCluster  # noqa: E402

NAME = "rsinfer-demo"
STEP_MS = 20.0
ENV = {"scheduler": {"RSINFER_ENGINE": "synthetic", "RSINFER_STEP_MS": str(STEP_MS), "RSINFER_MAX_RUNNING": "512"},
       "api": {"RSINFER_MAX_QUEUED": "4096"}}
COMMON = {"RSINFER_HEARTBEAT_TTL_S": "10"}  # outlives a failover (docs/design.md, "Redis Cluster")


def stack_on(server: RedisServer | LocalCluster, model_dir: str) -> BenchStack:
    """BenchStack's processes on a Redis this script owns (a standalone server or a cluster)."""
    return BenchStack(model_dir, NAME, env={role: {**COMMON, **ENV.get(role, {})}
                                            for role in ("tokenizer", "scheduler", "detokenizer", "api")},
                      redis=server)


def bodies(n: int, tokens: int, seed: int) -> list[bytes]:
    return [completion_body(NAME, [(seed * 7919 + i * 31 + j) % 1000 + 10 for j in range(16)], tokens)
            for i in range(n)]


def throughput(stacks: dict[str, BenchStack], args: argparse.Namespace) -> dict:
    runs: dict[str, list[dict]] = {name: [] for name in stacks}
    for stack in stacks.values():  # warm-up
        run_load(stack.urls, bodies(16, 8, 0), 16)
    for i in range(args.runs):
        for name, stack in (stacks.items() if i % 2 == 0 else reversed(stacks.items())):
            s = run_load(stack.urls, bodies(args.requests, args.max_tokens, i + 1), args.streams,
                         stagger_s=0.002).summary()
            runs[name].append(s)
            print(f"  run {i + 1} {name:10}: {s['tok_per_s']:,.0f} tok/s, TTFT p50 {s['ttft_p50_ms']:.0f} ms, "
                  f"ITL p50/p99 {s['itl_p50_ms']:.1f}/{s['itl_p99_ms']:.1f} ms, {s['ok']}/{s['requests']} ok",
                  flush=True)
    out = {}
    for name, rs in runs.items():
        tps = sorted(r["tok_per_s"] for r in rs)
        out[name] = {"median_tok_per_s": tps[len(tps) // 2], "runs": rs}
    out["cluster_over_standalone"] = round(out["cluster"]["median_tok_per_s"] /
                                           out["standalone"]["median_tok_per_s"], 3)
    return out


class Stream(StreamThread):
    def __init__(self, url: str, i: int, tokens: int):
        super().__init__(Request(url, {"model": NAME, "prompt": f"failover {i}", "max_tokens": tokens,
                                       "temperature": 0, "ignore_eos": True, "stream": True, "timeout": 120},
                                 idle_timeout=180))

    @property
    def arrivals(self) -> list[float]:
        return self.reply.arrivals

    def gap_around(self, t: float) -> float:
        """The longest pause between two chunks of this stream that spans or follows time t."""
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False) if b >= t]
        return max(gaps, default=0.0)


def failover(stack: BenchStack, cluster: LocalCluster, streams: int, tokens: int) -> dict:
    runs = [Stream(stack.urls[0], i, tokens) for i in range(streams)]
    deadline = time.monotonic() + 60
    while not all(len(r.arrivals) > 5 for r in runs) and time.monotonic() < deadline:
        time.sleep(0.05)
    victim = cluster.primary_of(Keys().detokenize(NAME))
    failover = cluster.fail_over(victim)
    killed = failover.killed
    probes = []
    while time.monotonic() - killed < 60:
        sent = time.monotonic()
        try:
            r = httpx.post(f"{stack.urls[0]}/v1/completions", json={"model": NAME, "prompt": "probe",
                                                                     "max_tokens": 4}, timeout=90)
            status = r.status_code
        except httpx.HTTPError:
            status = 0
        took = time.monotonic() - sent
        probes.append({"sent_s": round(sent - killed, 2), "status": status, "took_s": round(took, 2)})
        if status == 200:
            break
        time.sleep(0.1)
    healthy_s = failover.seconds(60)
    for r in runs:
        r.join(150)
    ok = [r for r in runs if r.reply.error is None and r.reply.finish == ["length"]]
    first_ok = next((p["sent_s"] + p["took_s"] for p in probes if p["status"] == 200), None)
    return {"victim_port": victim, "streams": streams, "completed": len(ok),
            "ended_with_error": sum(r.reply.error is not None for r in runs), "hung": sum(r.is_alive() for r in runs),
            "cluster_healthy_after_s": round(healthy_s, 2) if healthy_s is not None else None,
            "longest_stream_pause_s": round(max(r.gap_around(killed) for r in runs), 2),
            "median_stream_pause_s": round(sorted(r.gap_around(killed) for r in runs)[streams // 2], 2),
            "new_request_served_after_s": round(first_ok, 2) if first_ok is not None else None, "probes": probes}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--failover-streams", type=int, default=32)
    ap.add_argument("--node-timeout-ms", type=int, default=2000)
    ap.add_argument("--failover-only", action="store_true", help="skip the throughput runs")
    args = ap.parse_args()
    model_dir = str(ensure_demo_model())
    result: dict = {"cpus": os.cpu_count(), "load_before": loadavg(), "step_ms": STEP_MS, "streams": args.streams,
                    "requests": args.requests, "max_tokens": args.max_tokens, "node_timeout_ms": args.node_timeout_ms}
    with RedisServer() as server, LocalCluster(node_timeout_ms=args.node_timeout_ms) as cluster, \
            stack_on(server, model_dir) as standalone, stack_on(cluster, model_dir) as clustered:
        print(f"stacks up (logs {standalone.log_dir}, {clustered.log_dir})", flush=True)
        if not args.failover_only:
            result["throughput"] = t = throughput({"standalone": standalone, "cluster": clustered}, args)
            print(f"median tok/s: standalone {t['standalone']['median_tok_per_s']:,.0f}, cluster "
                  f"{t['cluster']['median_tok_per_s']:,.0f} ({t['cluster_over_standalone']:.2f}x)", flush=True)
        result["failover"] = f = failover(clustered, cluster, args.failover_streams, 1000)
        print(f"failover: cluster healthy after {f['cluster_healthy_after_s']} s; longest stream pause "
              f"{f['longest_stream_pause_s']} s (median {f['median_stream_pause_s']} s); a new request served "
              f"{f['new_request_served_after_s']} s after the kill; {f['completed']}/{f['streams']} streams completed, "
              f"{f['ended_with_error']} ended with an error, {f['hung']} hung", flush=True)
    result["load_after"] = loadavg()
    dest = ROOT / "bench" / "results" / "cluster.json"
    dest.write_text(json.dumps(result, indent=1) + "\n")
    print(f"-> {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
