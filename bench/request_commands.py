"""The Redis commands one request costs: the fixed part (admission, record, job, marks, TTLs, end) and the part
per generated token, each by command (issue 34, item 5).

    python bench/request_commands.py        # prints the table, writes bench/results/request-commands.json

Method: one stack of every process with the synthetic engine (2 ms steps, so the text costs nothing), streamed
completions sent one at a time (nothing is shared between requests: every engine step carries one request's
token, the worst case per token), first `--requests` of 1 token, then as many of `--tokens` tokens. INFO
commandstats is read around each run, and around an idle window (heartbeats, sweeps, registry refreshes) whose
rate per second, times each run's length, is taken out. With C(T) the commands of one request of T tokens:
per token = (C(T) - C(1)) / (T - 1), fixed = C(1) - per token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import BenchStack, completion_body, loadavg, redis_commands, run_load  # noqa: E402
from bench.report import command_delta  # noqa: E402
from shared.demo_model import ensure_demo_model  # noqa: E402
from shared.settings import DEMO_MODEL_NAME  # noqa: E402

RESULTS = ROOT / "bench/results/request-commands.json"
STEP_MS = 2.0


def measured(stack: BenchStack, bodies: list[bytes]) -> tuple[dict[str, int], float, int]:
    """(commands by name, seconds, requests delivered) of sending `bodies` one at a time."""
    url = stack.redis_server.url  # type: ignore[union-attr]
    before, t0 = redis_commands(url), time.monotonic()
    result = run_load(stack.urls, bodies, 1)
    seconds = time.monotonic() - t0
    return command_delta(before, redis_commands(url)), seconds, len(result.ok)


def idle_rate(stack: BenchStack, seconds: float) -> dict[str, float]:
    url = stack.redis_server.url  # type: ignore[union-attr]
    before = redis_commands(url)
    time.sleep(seconds)  # the idle window is what is measured: nothing is sent during it
    return {k: v / seconds for k, v in command_delta(before, redis_commands(url)).items()}


def per_request(calls: dict[str, int], seconds: float, requests: int, idle: dict[str, float]) -> dict[str, float]:
    """Commands of one request, by command, the idle rate over the run's length taken out."""
    names = set(calls) | set(idle)
    out = {k: (calls.get(k, 0) - idle.get(k, 0.0) * seconds) / requests for k in names}
    return {k: round(v, 2) for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if abs(v) >= 0.05}


def split(one: dict[str, float], many: dict[str, float], tokens: int) -> tuple[dict[str, float], dict[str, float]]:
    """(fixed, per token) by command from the costs of a 1-token and a `tokens`-token request."""
    names = set(one) | set(many)
    slope = {k: (many.get(k, 0.0) - one.get(k, 0.0)) / (tokens - 1) for k in names}
    fixed = {k: one.get(k, 0.0) - slope[k] for k in names}
    keep = lambda d: {k: round(v, 2) for k, v in sorted(d.items(), key=lambda kv: -kv[1]) if abs(v) >= 0.05}  # noqa: E731
    return keep(fixed), keep(slope)


def run(requests: int, tokens: int, idle_s: float) -> dict:
    env = {"scheduler": {"RSINFER_ENGINE": "synthetic", "RSINFER_STEP_MS": str(STEP_MS)}}
    with BenchStack(str(ensure_demo_model()), DEMO_MODEL_NAME, env=env) as stack:
        run_load(stack.urls, [completion_body(DEMO_MODEL_NAME, "warm up", 4)] * 4, 1)
        idle = idle_rate(stack, idle_s)
        costs, delivered = {}, {}
        for t in (1, tokens):
            bodies = [completion_body(DEMO_MODEL_NAME, f"request {i}", t) for i in range(requests)]
            calls, seconds, ok = measured(stack, bodies)
            costs[t], delivered[t] = per_request(calls, seconds, ok, idle), ok
    fixed, per_token = split(costs[1], costs[tokens], tokens)
    return {"requests": requests, "tokens": tokens, "step_ms": STEP_MS, "delivered": delivered,
            "idle_per_s": {k: round(v, 2) for k, v in idle.items()}, "one_token": costs[1],
            f"{tokens}_tokens": costs[tokens], "fixed": fixed, "per_token": per_token,
            "fixed_total": round(sum(fixed.values()), 1), "per_token_total": round(sum(per_token.values()), 2),
            "loadavg": loadavg(), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=100, help="requests of each length")
    ap.add_argument("--tokens", type=int, default=33, help="tokens of the longer requests")
    ap.add_argument("--idle-s", type=float, default=5.0, help="length of the idle window")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    out = run(args.requests, args.tokens, args.idle_s)
    print(f"Redis commands per request: fixed {out['fixed_total']}, per token {out['per_token_total']} "
          f"({args.requests} streamed requests of 1 and of {args.tokens} tokens, one at a time; load {out['loadavg']})")
    width = max(map(len, [*out["fixed"], *out["per_token"]]), default=8)
    print(f"  {'command':<{width}}  fixed  per token")
    for name in sorted(set(out["fixed"]) | set(out["per_token"]), key=lambda k: -out["fixed"].get(k, 0.0)):
        print(f"  {name:<{width}}  {out['fixed'].get(name, 0.0):5.2f}  {out['per_token'].get(name, 0.0):9.2f}")
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
