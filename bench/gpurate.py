"""`make bench` section `gpurate`: the plumbing at a GPU's step rate (issue 34).

The synthetic engine steps every 5 ms with 256 streams running, one token per stream per step (the shape of a
small model's decode on an H100/H200: 51,200 tok/s ideal), through one API process. What the plumbing costs per
generated token, process by process, and in cores per 10,000 tok/s, is what a GPU pod would spend on it; on 2
shared cores the delivered rate falls short of the ideal, which the section reports as measured. The same requests
with one token each, on the same stack, say how much of that is paid per request rather than per token.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from bench import report
from bench.harness import BenchStack, completion_body, run_load
from shared.settings import SchedulerSettings

STEP_MS = 5.0
STREAMS = 256
TOKENS = 256
WAVES = {"quick": 4, "full": 8}  # requests = STREAMS x waves
# --stream-flush-ms of the sweep, unpaced (--stream-entry-rate 0: every choice holds its tokens that long; the
# defaults are the section's main run): how many tokens a reply entry carries is what Redis commands and the
# stages' CPU per token follow, at the price of the gaps between chunks
FLUSH_SWEEP_MS = (0.0, 10.0, 20.0, 80.0)
PLUMBING = ("api", "tokenizer", "scheduler", "detokenizer", "redis")  # every process but the load generator
Say = Callable[[str], None]


def env(flush_ms: float | None = None) -> dict[str, dict[str, str]]:
    flush = {} if flush_ms is None else {"RSINFER_STREAM_FLUSH_MS": str(flush_ms), "RSINFER_STREAM_ENTRY_RATE": "0"}
    return {"scheduler": {"RSINFER_ENGINE": "synthetic", "RSINFER_STEP_MS": str(STEP_MS),
                          "RSINFER_MAX_RUNNING": str(STREAMS), "RSINFER_BATCH_SIZE": str(STREAMS), **flush}}


def figures(m: dict, spans: list[report.Span]) -> dict:
    """The section's figures from bench/run_all.py's measured_load result and its request spans."""
    per = m["us_per_token"]
    total = round(sum(per.get(k, 0.0) for k in PLUMBING), 1)
    steady, window = report.steady_rate(spans, STREAMS)
    ideal = STREAMS * report.IDEAL_STREAM_RATE / STEP_MS
    s = m["load"]
    return {"step_ms": STEP_MS, "streams": STREAMS, "max_tokens": TOKENS, "requests": s["requests"], "ok": s["ok"],
            "tokens": s["tokens"], "tok_per_s": s["tok_per_s"], "steady_tok_per_s": round(steady, 1),
            "steady_window_s": round(window, 2), "ideal": ideal,
            "fraction_of_ideal": round((steady or s["tok_per_s"]) / ideal, 3),
            "us_per_token": per, "plumbing_us_per_token": total,
            # CPU seconds per token x 10,000 tokens per second = cores busy with the plumbing at 10k tok/s
            "plumbing_cores_per_10k_tok_s": round(total * 1e-6 * 10_000, 3),
            "redis_cmds_per_token": m["redis_cmds_per_token"], "redis_cmds": m["redis_cmds"],
            "ttft_p50_ms": s["ttft_p50_ms"], "ttft_p99_ms": s["ttft_p99_ms"], "itl_p50_ms": s["itl_p50_ms"],
            "itl_p99_ms": s["itl_p99_ms"], "chunks_per_request": s["chunks_per_request"],
            "xadds_per_token": round(m["redis_cmds"].get("xadd", 0) / s["tokens"], 3) if s["tokens"] else 0.0,
            "error_counts": s["error_counts"]}


def per_request(m: dict, plumbing_us_per_token: float) -> dict:
    """What a request costs apart from its tokens, from measured_load's result for requests of ONE token each (so
    its `us_per_token` is CPU per request; it includes that one token's chunk): per process, in all, and that
    spread over a TOKENS-token request of the main run, beside the main run's plumbing per token."""
    us = {k: m["us_per_token"].get(k, 0.0) for k in PLUMBING}
    total = round(sum(us.values()), 1)
    spread = round(total / TOKENS, 1)
    return {"requests": m["load"]["ok"], "us": us, "us_in_all": total, "us_per_token_spread": spread,
            "share_of_plumbing": round(spread / plumbing_us_per_token, 3) if plumbing_us_per_token else 0.0,
            "redis_cmds": m["redis_cmds_per_token"]}


def section(model_dir: str, name: str, mode: str, say: Say, measure: Callable) -> dict:
    """The load at the default --stream-flush-ms, then the same load at each of FLUSH_SWEEP_MS (under
    `flush_sweep`), each on a fresh stack."""
    out = run(model_dir, name, mode, say, measure)
    out["flush_sweep"] = [run(model_dir, name, mode, say, measure, flush_ms=f) for f in FLUSH_SWEEP_MS]
    return out


def run(model_dir: str, name: str, mode: str, say: Say, measure: Callable, *, flush_ms: float | None = None) -> dict:
    """One stack of the synthetic engine at STEP_MS (--stream-flush-ms `flush_ms`, None: its default), a warm-up,
    then STREAMS x WAVES[mode] requests of TOKENS tokens, STREAMS at a time from 2 client processes, measured by
    `measure` (bench/run_all.py's measured_load: per-process CPU and Redis commands around the load); at the
    default flush, the same requests again with one token each (`per_request`)."""
    rng = random.Random(34)
    prompts = [[rng.randrange(16, 1000) for _ in range(16)] for _ in range(STREAMS * WAVES[mode])]
    with BenchStack(model_dir, name, env=env(flush_ms)) as stack:
        flush = "default" if flush_ms is None else f"{flush_ms:.0f} ms unpaced"
        say(f"  synthetic stack up, {STEP_MS:.0f} ms step, max_running {STREAMS}, flush {flush} (logs {stack.log_dir})")
        run_load(stack.urls, [completion_body(name, p, 8) for p in prompts[:32]], 32)  # warm-up
        bodies = [completion_body(name, p, TOKENS) for p in prompts]
        m, spans = measure(stack, stack.urls, bodies, STREAMS, stagger_s=0.001, processes=2)
        # the main run only: the same requests with one token each, on the same stack, to split what a request
        # costs from what its tokens cost
        ones = None if flush_ms is not None else measure(
            stack, stack.urls, [completion_body(name, p, 1) for p in prompts], STREAMS, stagger_s=0.001,
            processes=2)[0]
    fields = SchedulerSettings.model_fields
    out = {"flush_ms": fields["stream_flush_ms"].default if flush_ms is None else flush_ms,
           "entry_rate": fields["stream_entry_rate"].default if flush_ms is None else 0.0,
           "flush_default": flush_ms is None, **figures(m, spans)}
    per = out["us_per_token"]
    say(f"    {out['ok']}/{out['requests']} ok, {out['steady_tok_per_s']:,.0f} tok/s steady = "
        f"{out['fraction_of_ideal']:.0%} of {out['ideal']:,.0f} ({out['tok_per_s']:,.0f} overall)")
    say("    plumbing CPU µs/token: " + ", ".join(f"{k} {per.get(k, 0):.1f}" for k in PLUMBING) +
        f"; in all {out['plumbing_us_per_token']:.1f} = {out['plumbing_cores_per_10k_tok_s']:.2f} cores per "
        f"10k tok/s; Redis {out['redis_cmds_per_token']:.2f} cmds/token ({out['xadds_per_token']:.2f} XADD); "
        f"client {per.get('client', 0):.1f} µs/token; TTFT p50 {out['ttft_p50_ms']:.0f} ms, ITL p50/p99 "
        f"{out['itl_p50_ms']:.1f}/{out['itl_p99_ms']:.1f} ms")
    if ones is not None:
        r = out["per_request"] = per_request(ones, out["plumbing_us_per_token"])
        say("    a request of one token, CPU µs: " + ", ".join(f"{k} {r['us'][k]:.0f}" for k in PLUMBING) +
            f"; in all {r['us_in_all']:,.0f} = {r['us_per_token_spread']:.1f} µs/token over {TOKENS} tokens "
            f"({r['share_of_plumbing']:.0%} of the plumbing above); Redis {r['redis_cmds']:.1f} cmds")
    return out
