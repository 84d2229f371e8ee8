"""Fair queueing between tenants (issue 21): one tenant's flood and another tenant's TTFT.

    python bench/fair_queue.py                      # defaults below
    python bench/fair_queue.py --b-requests 30 --watermark 1

Per configuration a fresh stack (redis-server, one tokenizer with or without --fair-queueing, one scheduler on
the synthetic engine: `--step-ms` (20) steps, at most `--max-running` (8) requests running, a detokenizer, the
API with a keys file of two tenants). First tenant B alone sends `--b-requests` (15) streamed completions of
`--b-tokens` (4) tokens, one a second (B's TTFT idle). Then tenant A floods: a closed loop of `--a-queued` (200)
plus max-running streams of `--a-tokens` (50) tokens (about a second of engine time each), so that A keeps about
200 requests queued behind the running batch; once the backlog is there B sends its requests again, one a second
(B's TTFT under the flood). The backlog is read from Redis at each of B's sends (the streams' part of the API's
backlog figure: the tokenize stream's lag and pending entries and the schedule stream's lag; the flood stays
within --fair-max-held, so none of it is parked), to show it stayed up.

Figures: B's TTFT p50/p99 idle and under the flood, with fair queueing on and off; A's completions per second
under the flood (what holding the backlog in the tokenizer costs the flood itself); and, to compare B's TTFT
with, one of A's requests' engine time (the longest an engine slot takes to free: A's requests start together,
so slots tend to free together) and that over --max-running. Prints them and writes
bench/results/fair-queue.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import BenchStack, loadavg  # noqa: E402
from bench.report import percentile  # noqa: E402
from rsinfer.sse_client import Reply, Request, stream  # noqa: E402
from shared.keys import SCHEDULER_GROUP, TOKENIZER_GROUP, Keys  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "fair-queue.json"
A_KEY, B_KEY = "sk-bench-tenant-a-" + "0" * 20, "sk-bench-tenant-b-" + "0" * 20  # 32+ characters
REQUEST_TIMEOUT_S = 600.0


def keys_file() -> str:
    path = Path(tempfile.mkdtemp(prefix="rsinfer-fair-")) / "api-keys.json"
    path.write_text(json.dumps([{"key": A_KEY, "tenant": "team-a"}, {"key": B_KEY, "tenant": "team-b"}]))
    return str(path)


def body(name: str, max_tokens: int) -> dict:
    return {"model": name, "prompt": "hello there", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}


def ttft(reply: Reply) -> float | None:
    """Seconds to the first token's event (text, or an empty delta if the token decodes to nothing yet)."""
    if not reply.ok:
        return None
    first = reply.content_at[0] if reply.content_at else reply.arrivals[0] if reply.arrivals else None
    return None if first is None else first - reply.t0


def queued(r: redis.Redis, keys: Keys, model: str) -> int:
    """The streams' part of the API's backlog figure (services/api/operations/registry.py `queued`)."""
    def group(key: str, name: str) -> dict:
        try:
            return next((g for g in r.xinfo_groups(key) if g["name"] in (name, name.encode())), {})
        except redis.ResponseError:
            return {}
    tok, sched = group(keys.tokenize(model), TOKENIZER_GROUP), group(keys.schedule(model), SCHEDULER_GROUP)
    return int(tok.get("lag") or 0) + int(tok.get("pending") or 0) + int(sched.get("lag") or 0)


def stats(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50_s": round(percentile(values, 0.5), 3), "p99_s": round(percentile(values, 0.99), 3),
            "mean_s": round(statistics.fmean(values), 3), "max_s": round(max(values), 3)}


async def b_series(url: str, name: str, args: argparse.Namespace, probe=None) -> tuple[list[float], list[int]]:
    """B's requests, one a second; their TTFTs (and the backlog `probe` saw at each send)."""
    headers = {"Authorization": f"Bearer {B_KEY}"}
    tasks, seen = [], []
    for _ in range(args.b_requests):
        if probe is not None:
            seen.append(await asyncio.to_thread(probe))
        tasks.append(asyncio.create_task(stream(Request(url, body(name, args.b_tokens), headers=headers,
                                                        timeout=REQUEST_TIMEOUT_S))))
        await asyncio.sleep(args.b_every_s)
    replies = await asyncio.gather(*tasks)
    bad = [r.problem for r in replies if not r.ok]
    if bad:
        print(f"  {len(bad)} of B's requests failed: {bad[0]}")
    return [t for r in replies if (t := ttft(r)) is not None], seen


async def flood(url: str, name: str, args: argparse.Namespace, stop: asyncio.Event, done: list[float]) -> None:
    """Tenant A's closed loop: --a-queued plus --max-running requests open at all times until `stop`."""
    headers = {"Authorization": f"Bearer {A_KEY}"}

    async def loop() -> None:
        while not stop.is_set():
            reply = await stream(Request(url, body(name, args.a_tokens), headers=headers, timeout=REQUEST_TIMEOUT_S))
            if reply.ok:
                done.append(time.monotonic())
            elif not stop.is_set():
                await asyncio.sleep(0.5)

    await asyncio.gather(*(loop() for _ in range(args.a_queued + args.max_running)))


async def measure_stack(url: str, name: str, r: redis.Redis, args: argparse.Namespace) -> dict:
    keys = Keys()
    await b_series(url, name, argparse.Namespace(**{**vars(args), "b_requests": 2}))  # warm-up
    idle, _ = await b_series(url, name, args)
    stop, done = asyncio.Event(), []
    flooding = asyncio.create_task(flood(url, name, args, stop, done))
    started = time.monotonic()
    while queued(r, keys, name) < args.a_queued * 0.9:
        if time.monotonic() - started > 120:
            raise RuntimeError(f"A's backlog did not build: {queued(r, keys, name)} queued after 120 s")
        await asyncio.sleep(0.2)
    t0, n0 = time.monotonic(), len(done)
    under, seen = await b_series(url, name, args, probe=lambda: queued(r, keys, name))
    rate = (len(done) - n0) / (time.monotonic() - t0)
    stop.set()
    for task in asyncio.all_tasks() - {asyncio.current_task()}:  # A's streams: the stack is stopped after
        if task is not flooding:
            task.cancel()
    await asyncio.gather(flooding, return_exceptions=True)
    return {"b_ttft_idle": stats(idle), "b_ttft_flood": stats(under),
            "b_ttft_flood_values": [round(x, 3) for x in under],
            "a_queued_at_b_sends": {"min": min(seen), "mean": round(statistics.fmean(seen), 1), "max": max(seen)},
            "a_done_per_s": round(rate, 2)}


def run_config(model_dir: str, name: str, fair: bool, args: argparse.Namespace) -> dict:
    tokenizer = {"RSINFER_FAIR_QUEUEING": "true" if fair else "false", "RSINFER_FAIR_WATERMARK": str(args.watermark)}
    env = {"api": {"RSINFER_API_KEYS_FILE": keys_file(), "RSINFER_MAX_QUEUED": str(4 * args.a_queued)},
           "tokenizer": tokenizer,
           "scheduler": {"RSINFER_ENGINE": "synthetic", "RSINFER_STEP_MS": str(args.step_ms),
                         "RSINFER_MAX_RUNNING": str(args.max_running)}}
    print(f"fair queueing {'on' if fair else 'off'}: starting the stack")
    stack = BenchStack(model_dir, name, env=env)
    stack.api_key = A_KEY
    with stack:
        r = redis.Redis.from_url(stack.redis_server.url)  # type: ignore[union-attr]
        try:
            out = asyncio.run(measure_stack(stack.urls[0], name, r, args))
        finally:
            r.close()
    print(f"  B idle {out['b_ttft_idle']}, under A's flood {out['b_ttft_flood']}, "
          f"A queued {out['a_queued_at_b_sends']}, A done/s {out['a_done_per_s']}")
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a-queued", type=int, default=200, help="A's requests kept queued behind the running ones")
    ap.add_argument("--a-tokens", type=int, default=50)
    ap.add_argument("--b-requests", type=int, default=15)
    ap.add_argument("--b-tokens", type=int, default=4)
    ap.add_argument("--b-every-s", type=float, default=1.0)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--max-running", type=int, default=8)
    ap.add_argument("--watermark", type=int, default=None, help="the tokenizer's --fair-watermark (default: its "
                    "default)")
    ap.add_argument("--output", default=str(RESULTS))
    return ap


def main() -> int:
    args = parser().parse_args()
    from shared.demo_model import ensure_demo_model
    from shared.settings import DEMO_MODEL_NAME, TokenizerSettings

    if args.watermark is None:
        args.watermark = TokenizerSettings.model_fields["fair_watermark"].default
    model_dir = str(ensure_demo_model())
    runs = {"fair": run_config(model_dir, DEMO_MODEL_NAME, True, args),
            "fifo": run_config(model_dir, DEMO_MODEL_NAME, False, args)}
    summary = {"b_ttft_idle": runs["fifo"]["b_ttft_idle"], "b_ttft_idle_fair_on": runs["fair"]["b_ttft_idle"],
               "b_ttft_flood_fair": runs["fair"]["b_ttft_flood"], "b_ttft_flood_fifo": runs["fifo"]["b_ttft_flood"],
               "a_done_per_s_fair": runs["fair"]["a_done_per_s"], "a_done_per_s_fifo": runs["fifo"]["a_done_per_s"],
               # the longest one engine slot can take to free (one of A's requests), and how often one frees
               "a_request_engine_s": round(args.a_tokens * args.step_ms / 1000, 3),
               "slot_frees_every_s": round(args.a_tokens * args.step_ms / 1000 / args.max_running, 3)}
    result = {"summary": summary, "runs": runs, "config": {k: v for k, v in vars(args).items() if k != "output"},
              "loadavg": loadavg(), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(json.dumps(summary, indent=1))
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
