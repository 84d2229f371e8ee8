"""Prefix-aware routing vs the shared stream on a prefix-heavy workload (issue 14).

    python bench/prefix_routing.py                         # 2 and 4 schedulers, each with and without routing
    python bench/prefix_routing.py --schedulers 2 --conversations 16

The workload: `--system-prompts` (8) system prompts of `--system-tokens` (512) token ids; `--conversations`
conversations, each on one system prompt (in turn), of `--turns` turns. A turn's prompt is the previous turn's
prompt, its answer (the output ids) and a new user message of `--user-tokens` ids, so every turn extends the one
before, as a chat client resends its history. `--concurrency` conversations at a time, each turn sent when the
previous one answered: streamed `/generate` requests (greedy, ignore_eos, `--max-tokens`) on the real demo engine
on CPU, where prefill costs.

Per configuration a fresh stack (redis-server, a tokenizer with or without `--prefix-routing`, N schedulers, a
detokenizer, the API), warmed up with one request outside the workload, then the workload once (the whole matrix
`--repeat` times: the summary takes medians; one run moves with the machine's load). Figures: the
prefix hit rate (prompt tokens the schedulers read from their prefix caches, their heartbeats'
`prefix_hit_tokens`, over prompt tokens sent), the share of requests routed to a scheduler's own stream (their
records' schedule entry), TTFT p50/p99, output tokens/s and prompt tokens/s over the wall time. Prints them and
writes bench/results/prefix-routing.json; `make bench` runs it as its `prefix` section (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import BenchStack, loadavg  # noqa: E402
from bench.report import percentile  # noqa: E402
from rsinfer.sse_client import Request, open_stream  # noqa: E402
from shared.keys import Keys  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "prefix-routing.json"
TURN_TIMEOUT_S = 600.0  # one turn of a measured run: past it the turn fails and the run goes on
WARM_UP_TIMEOUT_S = 60.0  # the warm-up conversation: past it the stack is not serving, and the run stops
# Each scheduler one torch thread, and a KV pool that holds a few conversations beyond the system prompts: what
# a replica caches is bounded, as on a GPU, so where a request lands decides what it can reuse.
SCHEDULER_ENV = {"RSINFER_THREADS": "1", "OMP_NUM_THREADS": "1", "RSINFER_MAX_KV_TOKENS": "8192",
                 "RSINFER_PAGE_SIZE": "16"}


@dataclass(frozen=True)
class Workload:
    systems: list[list[int]]
    users: list[list[list[int]]]  # per conversation, per turn: the user message's ids
    system_of: list[int]  # per conversation: its system prompt
    max_tokens: int
    vocab: int = 1 << 30  # the tokenizer's: the API refuses larger ids in a prompt

    @property
    def requests(self) -> int:
        return sum(len(u) for u in self.users)


def workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(50, 1000) for _ in range(n)]

    systems = [ids(args.system_tokens) for _ in range(args.system_prompts)]
    users = [[ids(args.user_tokens) for _ in range(args.turns)] for _ in range(args.conversations)]
    return Workload(systems, users, [c % args.system_prompts for c in range(args.conversations)], args.max_tokens,
                    tokenizer_vocab(args.model_dir))


def tokenizer_vocab(model_dir: str) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(model_dir))


def resent(answer: list[int], vocab: int) -> list[int]:
    """An answer as the next turn resends it. The demo model's output layer is larger than its tokenizer's
    vocabulary (padded), and the API refuses ids past the vocabulary in a prompt (a logit_bias on them too), so
    those are mapped into it: the next turn's cached prefix then ends at the first such id's page."""
    return [i if i < vocab else 50 + i % 900 for i in answer]


@dataclass
class Turn:
    ok: bool = False
    prompt_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    ttft: float = 0.0
    error: str = ""


async def generate(url: str, model: str, ids: list[int], w: Workload) -> Turn:
    """One streamed /generate request (rsinfer/sse_client.py); every event carries the whole answer so far."""
    turn, max_tokens = Turn(prompt_tokens=len(ids)), w.max_tokens
    body = {"model": model, "input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
    began = time.perf_counter()
    try:
        async with open_stream(Request(url, body, "/generate")) as resp:
            if resp.status != 200:
                turn.error = f"{resp.status} {(await resp.read())[:200]!r}"
                return turn
            async for sse in resp.events():
                if not sse.data.startswith(b"{"):
                    continue
                event = json.loads(sse.data)
                if event.get("output_ids") and not turn.ttft:
                    turn.ttft = time.perf_counter() - began
                turn.output_ids = event.get("output_ids", turn.output_ids)
        turn.ok = len(turn.output_ids) == max_tokens
        turn.error = "" if turn.ok else f"{len(turn.output_ids)} of {max_tokens} tokens"
    except (OSError, TimeoutError) as e:  # sse_client's ConnectFailed and StreamBroken are OSErrors
        turn.error = repr(e)[:200]
    return turn


async def converse(url: str, model: str, w: Workload, concurrency: int) -> list[Turn]:
    """Every conversation, `concurrency` at a time, each turn after the previous one's answer; a turn past
    TURN_TIMEOUT_S fails (and ends its conversation), the others go on."""
    sem = asyncio.Semaphore(concurrency)

    async def conversation(c: int) -> list[Turn]:
        async with sem:
            history, turns = list(w.systems[w.system_of[c]]), []
            for user in w.users[c]:
                history += user
                try:
                    async with asyncio.timeout(TURN_TIMEOUT_S):
                        turn = await generate(url, model, history, w)
                except TimeoutError as e:
                    turn = Turn(prompt_tokens=len(history), error=repr(e)[:200])
                turns.append(turn)
                if not turn.ok:
                    break
                history += resent(turn.output_ids, w.vocab)
            return turns

    results = await asyncio.gather(*(conversation(c) for c in range(len(w.users))))
    return [t for turns in results for t in turns]


# ---- what the schedulers and records say


def scheduler_loads(redis_url: str) -> dict[str, dict]:
    keys = Keys()
    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        out = {}
        for member in r.zrange(keys.workers(), 0, -1):
            role, wid = member.split(":", 1)
            fields = r.hgetall(keys.worker(role, wid)) if role == "scheduler" else {}
            if fields:
                out[wid] = {**json.loads(fields["load"]), "updated_at": float(fields["updated_at"])}
        return out


def wait_for_beats(redis_url: str, schedulers: int, after: float, routing: bool, timeout: float = 60.0) -> dict:
    """The schedulers' loads once each has beaten after `after` (and, routing, the tokenizer knows them all)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        loads = scheduler_loads(redis_url)
        fresh = len(loads) == schedulers and all(ld["updated_at"] > after for ld in loads.values())
        if fresh and (not routing or tokenizer_routes_to(redis_url) == schedulers):
            return loads
        time.sleep(0.2)
    raise TimeoutError(f"{schedulers} schedulers did not report (have {len(scheduler_loads(redis_url))})")


def tokenizer_routes_to(redis_url: str) -> int:
    keys = Keys()
    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        for member in r.zrange(keys.workers(), 0, -1):
            if member.startswith("tokenizer:"):
                load = json.loads(r.hget(keys.worker("tokenizer", member.split(":", 1)[1]), "load") or "{}")
                return int(load.get("routing_to", 0))
    return 0


def routed_share(redis_url: str) -> tuple[int, int, list[int]]:
    """(requests admitted from a scheduler's own stream, requests admitted, requests each scheduler admitted
    from most to fewest: the balance) among the stack's records."""
    keys = Keys()
    routed = total = 0
    per: dict[str, int] = {}
    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        for key in r.scan_iter(keys.request_pattern(), count=1000):
            entry, scheduler = r.hmget(key, ["entry", "scheduler"])
            if entry:
                total += 1
                routed += "/" in entry
                per[scheduler or "?"] = per.get(scheduler or "?", 0) + 1
    return routed, total, sorted(per.values(), reverse=True)


# ---- one configuration


@dataclass(frozen=True)
class Config:
    """One configuration of the matrix: how many schedulers, routing or the shared stream, how many
    conversations at a time, and the tokenizer's --prefix-routing-load-tokens and --prefix-routing-max-skew
    (None: its default)."""

    schedulers: int
    routing: bool
    concurrency: int
    load_tokens: float | None = None
    max_skew: float | None = None


def measure(model_dir: str, name: str, config: Config, w: Workload, *, say=print) -> dict:
    schedulers, routing = config.schedulers, config.routing
    tokenizer = {"RSINFER_PREFIX_ROUTING": "true" if routing else "false"}
    if config.load_tokens is not None:
        tokenizer["RSINFER_PREFIX_ROUTING_LOAD_TOKENS"] = str(config.load_tokens)
    if config.max_skew is not None:
        tokenizer["RSINFER_PREFIX_ROUTING_MAX_SKEW"] = str(config.max_skew)
    env = {"scheduler": SCHEDULER_ENV, "tokenizer": tokenizer,
           "api": {"RSINFER_MAX_QUEUED": str(4 * w.requests)}}
    label = f"{schedulers} schedulers, {'prefix routing' if routing else 'shared stream'}"
    with BenchStack(model_dir, name, env=env, schedulers=schedulers) as stack:
        url, redis_url = stack.urls[0], stack.redis_server.url  # type: ignore[union-attr]
        wait_for_beats(redis_url, schedulers, 0.0, routing)
        warm = Workload([list(range(60, 60 + 40))], [[list(range(200, 216))]], [0], 4)
        asyncio.run(asyncio.wait_for(converse(url, name, warm, 1), WARM_UP_TIMEOUT_S))
        before = wait_for_beats(redis_url, schedulers, time.time(), routing)
        load_before = loadavg()
        began = time.perf_counter()
        turns = asyncio.run(converse(url, name, w, config.concurrency))
        wall = time.perf_counter() - began
        after = wait_for_beats(redis_url, schedulers, time.time(), routing)
        routed, admitted, per_scheduler = routed_share(redis_url)
    ok = [t for t in turns if t.ok]
    prompt = sum(t.prompt_tokens for t in turns)
    hits = sum(after[s].get("prefix_hit_tokens", 0) - before.get(s, {}).get("prefix_hit_tokens", 0) for s in after)
    ttft = [t.ttft for t in ok]
    out = {"schedulers": schedulers, "routing": routing, "requests": len(turns), "ok": len(ok),
           "prompt_tokens": prompt, "prefix_hit_tokens": hits,
           "hit_rate": round(hits / prompt, 3) if prompt else 0.0,
           "routed": routed, "admitted": admitted - 1,  # the warm-up request is among the records (never routed)
           "ttft_p50_ms": round(1000 * percentile(ttft, 0.5), 1),
           "ttft_p99_ms": round(1000 * percentile(ttft, 0.99), 1),
           "wall_s": round(wall, 2), "output_tok_per_s": round(sum(len(t.output_ids) for t in ok) / wall, 1),
           "prompt_tok_per_s": round(sum(t.prompt_tokens for t in ok) / wall, 1),
           "preemptions": sum(ld.get("preemptions", 0) for ld in after.values()),
           "per_scheduler_hit_tokens": sorted(ld.get("prefix_hit_tokens", 0) for ld in after.values()),
           "per_scheduler_requests": per_scheduler,  # the warm-up request among them
           "errors": sorted({t.error for t in turns if not t.ok})[:5], "loadavg_before": load_before}
    say(f"  {label:38}: hit rate {out['hit_rate']:.0%}, routed {out['routed']}/{out['admitted']}, TTFT p50/p99 "
        f"{out['ttft_p50_ms']:.0f}/{out['ttft_p99_ms']:.0f} ms, {out['output_tok_per_s']:,.0f} output tok/s, "
        f"{out['prompt_tok_per_s']:,.0f} prompt tok/s, {out['ok']}/{out['requests']} ok, {out['wall_s']:.1f} s, "
        f"per scheduler {'/'.join(map(str, per_scheduler))}, load {load_before}")
    return out


def run(model_dir: str, name: str, args: argparse.Namespace, say=print) -> dict:
    """Every configuration, routing and shared stream alternately per scheduler count; the results dict."""
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    w = workload(argparse.Namespace(**vars(args), model_dir=model_dir))
    say(f"prefix routing: {args.system_prompts} system prompts x {args.system_tokens} tokens, {args.conversations} "
        f"conversations x {args.turns} turns (+{args.user_tokens} user tokens, {args.max_tokens} answer tokens "
        f"each), {args.concurrency} at a time; {w.requests} requests per configuration")
    runs = []
    for k in range(args.repeat):
        for n in args.schedulers:
            for routing in (False, True):
                config = Config(n, routing, args.concurrency, args.load_tokens, args.max_skew)
                runs.append({**measure(model_dir, name, config, w, say=say), "repeat": k})
    return {"config": {k: v for k, v in vars(args).items() if k != "output"} | {"requests": w.requests,
                                                                              "scheduler_env": SCHEDULER_ENV},
            "meta": {"started_at": started, "cpus": os.cpu_count(), "commit": commit()},
            "runs": runs, "summary": summarize(runs, args.schedulers)}


def summarize(runs: list[dict], counts: list[int]) -> dict:
    """Per scheduler count, [shared stream, prefix routing] of each figure: the median over the repeats."""
    out = {}
    for n in counts:
        pair = [[r for r in runs if r["schedulers"] == n and r["routing"] == flag] for flag in (False, True)]

        def med(key: str, pair=pair) -> list[float]:
            return [statistics.median(r[key] for r in side) for side in pair]

        tps = med("output_tok_per_s")
        out[str(n)] = {"hit_rate": med("hit_rate"), "ttft_p50_ms": med("ttft_p50_ms"),
                       "ttft_p99_ms": med("ttft_p99_ms"), "output_tok_per_s": tps,
                       "throughput_ratio": round(tps[1] / tps[0], 3) if tps[0] else None}
    return out
def commit() -> str:
    import subprocess

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results",
                            ":!docs/benchmarks.md"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return head.strip() + ("+changes" if dirty else "")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedulers", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4],
                    help="scheduler counts, comma-separated (default 2,4)")
    ap.add_argument("--system-prompts", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--load-tokens", type=float, default=None, help="the tokenizer's --prefix-routing-load-tokens "
                    "(default: its default)")
    ap.add_argument("--max-skew", type=float, default=None, help="the tokenizer's --prefix-routing-max-skew "
                    "(default: its default)")
    ap.add_argument("--repeat", type=int, default=1, help="run the whole matrix this many times; the summary "
                    "takes the medians")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=str(RESULTS))
    return ap


def main() -> int:
    args = parser().parse_args()
    from shared.demo_model import ensure_demo_model
    from shared.settings import DEMO_MODEL_NAME

    result = run(str(ensure_demo_model()), DEMO_MODEL_NAME, args)
    print(json.dumps(result["summary"], indent=1))
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
