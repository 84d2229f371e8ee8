"""The Redis commands one request costs: the fixed part (admission, record, job, marks, TTLs, end) and the part
per generated token, each by command (issue 34, item 5).

    python bench/request_commands.py        # prints the table, writes bench/results/request-commands.json

Method: one stack of every process with the synthetic engine (2 ms steps, so the text costs nothing), streamed
completions sent one at a time (nothing is shared between requests: every engine step carries one request's
token, the worst case per token), first `--requests` of 1 token, then as many of `--tokens` tokens. INFO
commandstats is read around each run, and around an idle window (heartbeats, sweeps, registry refreshes) whose
rate per second, times each run's length, is taken out. With C(T) the commands of one request of T tokens:
per token = (C(T) - C(1)) / (T - 1), fixed = C(1) - per token.

Two figures: the commands Redis executes (INFO commandstats: those a script or a MULTI runs count, and MULTI and
EXEC themselves), and the commands clients send (MONITOR during the same windows: a script call counts once, the
commands it runs none; MULTI and EXEC count). MONITOR costs Redis a little; the counts do not depend on it.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import BenchStack, completion_body, loadavg, redis_commands, run_load  # noqa: E402
from bench.report import command_delta  # noqa: E402
from shared.demo_model import ensure_demo_model  # noqa: E402
from shared.settings import DEMO_MODEL_NAME  # noqa: E402

RESULTS = ROOT / "bench/results/request-commands.json"
STEP_MS = 2.0


class Sent:
    """The commands clients send while it is open, by name (MONITOR; what scripts run is left out)."""

    def __init__(self, url: str):
        import redis

        self.url, self.counts, self.open = url, Counter(), True
        self.client = redis.Redis.from_url(url)
        self.monitor = self.client.monitor().__enter__()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while self.open:
            cmd = self.monitor.next_command()
            if cmd.get("client_type") == "lua" or not self.open:
                continue
            words = cmd["command"].split(" ", 2)
            name = words[0].lower()
            if name in ("xinfo", "client", "config", "script", "xgroup") and len(words) > 1:
                name = f"{name}|{words[1].lower()}"  # as INFO commandstats names subcommands
            if name != "info":
                self.counts[name] += 1

    def close(self) -> dict[str, int]:
        self.open = False
        self.client.ping()  # the monitor's next line, so that its reader sees it closed
        self.thread.join(5)
        self.monitor.__exit__(None, None, None)
        self.client.close()
        return dict(self.counts)


def measured(stack: BenchStack, bodies: list[bytes]) -> tuple[dict[str, int], dict[str, int], float, int]:
    """(commands executed by name, commands sent by name, seconds, requests delivered) of sending `bodies` one at
    a time."""
    url = stack.redis_server.url  # type: ignore[union-attr]
    sent = Sent(url)
    before, t0 = redis_commands(url), time.monotonic()
    result = run_load(stack.urls, bodies, 1)
    seconds = time.monotonic() - t0
    executed = command_delta(before, redis_commands(url))
    return executed, sent.close(), seconds, len(result.ok)


def idle_rate(stack: BenchStack, seconds: float) -> tuple[dict[str, float], dict[str, float]]:
    """Commands executed and sent per second while nothing is sent."""
    url = stack.redis_server.url  # type: ignore[union-attr]
    sent = Sent(url)
    before = redis_commands(url)
    time.sleep(seconds)  # the idle window is what is measured: nothing is sent during it
    executed = command_delta(before, redis_commands(url))
    return {k: v / seconds for k, v in executed.items()}, {k: v / seconds for k, v in sent.close().items()}


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
        idle, idle_sent = idle_rate(stack, idle_s)
        costs, sent, delivered = {}, {}, {}
        for t in (1, tokens):
            bodies = [completion_body(DEMO_MODEL_NAME, f"request {i}", t) for i in range(requests)]
            calls, sends, seconds, ok = measured(stack, bodies)
            costs[t], delivered[t] = per_request(calls, seconds, ok, idle), ok
            sent[t] = per_request(sends, seconds, ok, idle_sent)
    fixed, per_token = split(costs[1], costs[tokens], tokens)
    sent_fixed, sent_per_token = split(sent[1], sent[tokens], tokens)
    return {"requests": requests, "tokens": tokens, "step_ms": STEP_MS, "delivered": delivered,
            "idle_per_s": {k: round(v, 2) for k, v in idle.items()}, "one_token": costs[1],
            f"{tokens}_tokens": costs[tokens], "fixed": fixed, "per_token": per_token,
            "fixed_total": round(sum(fixed.values()), 1), "per_token_total": round(sum(per_token.values()), 2),
            "sent_fixed": sent_fixed, "sent_per_token": sent_per_token,
            "sent_fixed_total": round(sum(sent_fixed.values()), 1),
            "sent_per_token_total": round(sum(sent_per_token.values()), 2),
            "loadavg": loadavg(), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=100, help="requests of each length")
    ap.add_argument("--tokens", type=int, default=33, help="tokens of the longer requests")
    ap.add_argument("--idle-s", type=float, default=5.0, help="length of the idle window")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    out = run(args.requests, args.tokens, args.idle_s)
    print(f"Redis commands per request, executed: fixed {out['fixed_total']}, per token {out['per_token_total']}; "
          f"sent: fixed {out['sent_fixed_total']}, per token {out['sent_per_token_total']} ({args.requests} "
          f"streamed requests of 1 and of {args.tokens} tokens, one at a time; load {out['loadavg']})")
    names = set(out["fixed"]) | set(out["per_token"]) | set(out["sent_fixed"]) | set(out["sent_per_token"])
    width = max(map(len, names), default=8)
    print(f"  {'command':<{width}}  executed: fixed  per token   sent: fixed  per token")
    for name in sorted(names, key=lambda k: (-out["fixed"].get(k, 0.0), k)):
        row = [out[k].get(name, 0.0) for k in ("fixed", "per_token", "sent_fixed", "sent_per_token")]
        print(f"  {name:<{width}}  {row[0]:15.2f}  {row[1]:9.2f}  {row[2]:11.2f}  {row[3]:9.2f}")
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
