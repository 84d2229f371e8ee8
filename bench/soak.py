"""Crash-recovery soak (issue 10): how much throughput survives a worker killed every few seconds.

Two replicas of every stage (tokenizer, scheduler, detokenizer) and two API processes, each its own process on a
redis-server of its own. The same load runs twice: undisturbed, then with one random stage worker SIGKILLed every
`--kill-every` seconds and a replacement started at once (a new process, as a pod's restart would be). The load
is `--streams` greedy streams of `--max-tokens` tokens (ignore_eos) with a deadline of `--deadline` seconds.

    python bench/soak.py                          # 60 streams x 400 tokens, a kill every 2.5 s, 600 s deadline
    python bench/soak.py --env RSINFER_CLAIM_IDLE_MS=2000 --streams 30

Prints and writes (bench/results/soak.json): both wall times and throughputs and their ratio, requests that
missed their deadline, and where recovery time went: the wait before a peer claimed a dead worker's entries
(claim idle), a replacement's time from spawn to heartbeat, the stalls of the streams (their longest gap between
chunks), takeovers and resumes per request (ping-pong), and completion tokens recomputed on resume. The goal:
at least half of the undisturbed throughput, and no request past its deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rsinfer.redis_server import RedisServer  # noqa: E402
from shared.demo_model import ensure_demo_model  # noqa: E402
from shared.keys import STAGES  # noqa: E402
from tests.support.chaos_kit import LOG_TIME, Chaos, Clients, Job, Outcome, log_times, percentile  # noqa: E402
from tests.support.stack import Stack, start_replicas  # noqa: E402

RESUMED = re.compile(r"uid=(\w+) resumed after \[([\d, ]*)\] tokens")


async def load(clients: Clients, jobs: list[Job], during=None) -> tuple[float, list[Outcome]]:
    """Run every job at once (and `during`, a coroutine, until they end); wall time and outcomes."""
    began = time.monotonic()
    tasks = [asyncio.create_task(clients.run(j)) for j in jobs]
    chaos = asyncio.create_task(during()) if during else None
    outcomes = await asyncio.gather(*tasks)
    wall = time.monotonic() - began
    if chaos:
        chaos.cancel()
        await asyncio.gather(chaos, return_exceptions=True)
    return wall, list(outcomes)


async def kill_every(chaos: Chaos, every: float, rng: random.Random) -> None:
    """One random stage worker SIGKILLed, and its replacement started, every `every` seconds."""
    while True:
        await asyncio.sleep(every)
        role = rng.choice(STAGES)
        names = chaos.names(role)
        if names:
            await chaos.kill(role, rng.choice(names))


def run_figures(wall: float, outcomes: list[Outcome], max_tokens: int) -> dict:
    done = [o for o in outcomes if o.complete]
    gaps = [o.max_gap for o in outcomes]
    return {"wall_s": round(wall, 1), "completed": len(done), "tokens": len(done) * max_tokens,
            "tok_s": round(len(done) * max_tokens / wall, 1),
            "missed_deadline": sum(any("deadline" in e for e in o.errors) for o in outcomes),
            "failed": [f"uid={o.uid}: {o.errors[:1]}" for o in outcomes if not o.complete][:10],
            "longest_gap_s": {"p50": _r(percentile(gaps, 50)), "p99": _r(percentile(gaps, 99)), "max": _r(max(gaps))},
            "stalled_s_total": round(sum(b - a for o in outcomes
                                         for a, b in zip([o.started, *o.times], o.times, strict=False)
                                         if b - a > 1.0), 1)}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def resumes(log_dir: Path) -> list[tuple[float, str, list[int]]]:
    """(time, uid, completion tokens per choice already produced) of every scheduler resume."""
    out = []
    for path in log_dir.glob("scheduler*.log"):
        for line in path.read_text(errors="replace").splitlines():
            m, t = RESUMED.search(line), LOG_TIME.match(line)
            if m and t:
                when = datetime.strptime(t.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                out.append((when, m.group(1), [int(x) for x in m.group(2).split(",") if x.strip()]))
    return sorted(out)


def breakdown(chaos: Chaos, log_dir: Path, outcomes: list[Outcome]) -> dict:
    """Where recovery time went: claim waits, restarts, ping-pong, recomputation."""
    resumed = resumes(log_dir)
    claim_waits: dict[str, list[float]] = {role: [] for role in STAGES}
    for e in chaos.events:
        if not e.victims:
            continue
        if e.role == "scheduler":  # each request it held: until a peer resumed it
            for uid in e.victims:
                first = next((t for t, u, _ in resumed if u == uid and t >= e.at), None)
                if first is not None:
                    claim_waits["scheduler"].append(first - e.at)
        else:  # the first claim by a peer of that stage
            first = next((t for t in log_times(log_dir, r"\bclaimed\b", e.role) if t >= e.at), None)
            if first is not None:
                claim_waits[e.role].append(first - e.at)
    per_uid = Counter(uid for _, uid, _ in resumed)
    kills_holding = Counter(uid for e in chaos.events if e.role == "scheduler" for uid in e.victims)
    restarts = [e.restart_s for e in chaos.events if e.restart_s is not None]
    followed = {o.uid for o in outcomes}
    return {
        "kills": dict(Counter(e.role for e in chaos.events)),
        "kills_holding_work": sum(bool(e.victims) for e in chaos.events),
        "claim_wait_s": {role: {"n": len(w), "p50": _r(percentile(w, 50)), "max": _r(max(w, default=None))}
                         for role, w in claim_waits.items()},
        "restart_s": {"n": len(restarts), "p50": _r(percentile(restarts, 50)), "max": _r(max(restarts, default=None)),
                      "never_up": sum(e.restart_s is None for e in chaos.events)},
        "scheduler_resumes": len(resumed),
        "resumes_beyond_kills": sum(max(0, n - kills_holding[uid]) for uid, n in per_uid.items()),
        "most_resumes_of_one_request": max(per_uid.values(), default=0),
        "resumed_from_zero_after_progress": _from_zero(resumed),
        "completion_tokens_recomputed": sum(sum(tokens) for _, uid, tokens in resumed if uid in followed),
        "taken_over_drops": len(log_times(log_dir, r"taken_over|taken over", "scheduler")),
    }


def _from_zero(resumed: list[tuple[float, str, list[int]]]) -> int:
    """Resumes that started a request over although an earlier resume found tokens (its reply was trimmed)."""
    best: dict[str, int] = {}
    count = 0
    for _, uid, tokens in resumed:
        count += sum(tokens) == 0 and best.get(uid, 0) > 0
        best[uid] = max(best.get(uid, 0), sum(tokens))
    return count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--kill-every", type=float, default=2.5)
    ap.add_argument("--deadline", type=float, default=600.0, help="each request's timeout, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for every process (repeatable)")
    ap.add_argument("--skip-undisturbed", action="store_true")
    ap.add_argument("--output", default=str(ROOT / "bench" / "results" / "soak.json"))
    args = ap.parse_args()
    env = dict(kv.split("=", 1) for kv in args.env)
    env.setdefault("RSINFER_REQUEST_TIMEOUT_S", str(args.deadline))
    rng = random.Random(args.seed)

    def jobs(first: int) -> list[Job]:
        return [Job(key=first + i, kind="greedy", n=1, max_tokens=args.max_tokens, api=i % 2, background=False,
                    timeout=args.deadline) for i in range(args.streams)]

    with RedisServer() as server:
        stack = Stack(server.url, ensure_demo_model(), "soak", Path(tempfile.mkdtemp(prefix="rsinfer-soak-")))
        try:
            ports = start_replicas(stack, dict.fromkeys(STAGES, 2), apis=2, timeout=300, **env)
            print(f"soak: {args.streams} streams x {args.max_tokens} tokens; logs in {stack.log_dir}", flush=True)
            result = asyncio.run(soak(Chaos(stack, env, ports), args, jobs, rng))
        finally:
            stack.stop()
    result["config"] = {**vars(args), "env": env}
    print(json.dumps(result, indent=1))
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    return 0


async def soak(chaos: Chaos, args, jobs, rng: random.Random) -> dict:
    """The runs, undisturbed then under `chaos` (which this closes), through its stack's API processes."""
    clients = Clients([f"http://127.0.0.1:{p}" for p in chaos.api_ports])
    try:
        out: dict = {}
        if not args.skip_undisturbed:
            wall, outcomes = await load(clients, jobs(0))
            out["undisturbed"] = run_figures(wall, outcomes, args.max_tokens)
            print(f"undisturbed: {out['undisturbed']['wall_s']} s, {out['undisturbed']['tok_s']} tok/s", flush=True)
        wall, outcomes = await load(clients, jobs(10_000), lambda: kill_every(chaos, args.kill_every, rng))
        await chaos.settle()
        out["disturbed"] = run_figures(wall, outcomes, args.max_tokens)
        out["breakdown"] = breakdown(chaos, chaos.stack.log_dir, outcomes)
        if "undisturbed" in out:
            out["throughput_ratio"] = round(out["disturbed"]["tok_s"] / out["undisturbed"]["tok_s"], 3)
            out["goal_met"] = out["throughput_ratio"] >= 0.5 and out["disturbed"]["missed_deadline"] == 0
        return out
    finally:
        await chaos.close()


if __name__ == "__main__":
    sys.exit(main())
