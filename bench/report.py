"""The arithmetic and the write-up of bench/run_all.py, kept free of processes and sockets so that it can be
tested: CPU ticks and Redis command counts per generated token, latency percentiles, steady-state rates,
and docs/benchmarks.md (the table with each figure's goal from issue 11) and the plots, from results JSON.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

IDEAL_STREAM_RATE = 1000.0  # tokens/s of one stream at a 1 ms step: ideal tok/s = streams * this / step_ms


# ---- /proc and INFO arithmetic


def proc_cpu_ticks(stat: str) -> int:
    """utime + stime (clock ticks) from the text of /proc/<pid>/stat. The command name (field 2) may hold
    spaces and parentheses, so fields are counted from the last ')'."""
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5); fields[0] is field 3


def proc_status_kb(status: str, key: str) -> int:
    """A `key:  N kB` line of /proc/<pid>/status (VmRSS, VmHWM), in kB; 0 if absent."""
    for line in status.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def us_per_token(ticks: int, clk_tck: int, tokens: int) -> float:
    return ticks / clk_tck * 1e6 / tokens if tokens else 0.0


def command_calls(commandstats: dict) -> dict[str, int]:
    """{command: calls} from redis-py's INFO commandstats ({"cmdstat_xadd": {"calls": 3, ...}, ...})."""
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in commandstats.items() if k.startswith("cmdstat_")}


def command_delta(before: dict[str, int], after: dict[str, int], ignore: Iterable[str] = ("info",)) -> dict[str, int]:
    """Calls per command between two snapshots, the bench's own INFO calls left out; commands never called
    before count from zero."""
    skip = set(ignore)
    out = {k: v - before.get(k, 0) for k, v in after.items() if k not in skip}
    return {k: v for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v > 0}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def short_error(error: str) -> str:
    """A client error, grouped: `503 broker_unavailable` for an HTTP error with OpenAI's body, else its start."""
    if error.startswith("HTTP/"):
        status = error.split()[1] if len(error.split()) > 1 else "?"
        code = error.partition('"code":"')[2].partition('"')[0]
        return f"{status} {code}".strip()
    return error[:60]


def error_counts(errors: Iterable[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in errors:
        key = short_error(e)
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


# ---- rates from request spans


@dataclass(frozen=True)
class Span:
    start: float  # absolute seconds: the request was sent
    first: float  # absolute seconds: its first token arrived (start if none)
    end: float  # absolute seconds: its stream ended
    tokens: int


def peak_open(spans: list[Span]) -> int:
    """Most streams open at one time."""
    events = sorted([(s.start, 1) for s in spans] + [(s.end, -1) for s in spans])
    now = peak = 0
    for _, d in events:
        now += d
        peak = max(peak, now)
    return peak


def steady_rate(spans: list[Span], concurrency: int) -> tuple[float, float]:
    """(tokens/s, window seconds) over the longest time `concurrency` streams were open, each request's tokens
    spread evenly over [first, end]: the rate with the ramp-up and the tail left out. (0, 0) if never."""
    events = sorted([(s.start, 1) for s in spans] + [(s.end, -1) for s in spans])
    now, since, lo, hi = 0, None, 0.0, 0.0
    for t, d in events:
        now += d
        if now >= concurrency and since is None:
            since = t
        elif now < concurrency and since is not None:
            if t - since > hi - lo:
                lo, hi = since, t
            since = None
    if hi <= lo:
        return 0.0, 0.0
    tokens = 0.0
    for s in spans:
        overlap = min(s.end, hi) - max(s.first, lo)
        if s.end > s.first and overlap > 0:
            tokens += s.tokens * overlap / (s.end - s.first)
    return tokens / (hi - lo), hi - lo


# ---- the table

@dataclass(frozen=True)
class Row:
    section: str
    figure: str
    measured: str
    goal: str
    verdict: str  # "met", "not met", or "" where the issue sets no bound


def _check(value: float | None, bound: float | None, at_most: bool) -> str:
    if value is None or bound is None:
        return ""
    return "met" if (value <= bound if at_most else value >= bound) else "not met"


def _fmt(v: float | None, spec: str = ",.0f", unit: str = "") -> str:
    return "—" if v is None else f"{v:{spec}}{unit}"


def _get(d: dict, *path, default=None):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return default
        d = d[p]
    return d


CPU_GOALS_US = {"api": 30.0, "detokenizer": 20.0}  # CPU µs per generated token, issue 11


def rows(r: dict) -> list[Row]:
    """One row per measured figure with its goal from issue 11 (where it sets one)."""
    from bench import report_rates  # it imports this module's Row

    return [*pipeline_rows(r), *cpu_rows(r), *merged_rows(_get(r, "merged", default={})),
            *synthetic_rows(_get(r, "synthetic", default={})), *streams_10k_rows(_get(r, "streams_10k", default={})),
            *prefix_rows(_get(r, "prefix_routing", default={})),
            *transformers_rows(_get(r, "vs_transformers", default={})),
            *report_rates.gpurate_rows(_get(r, "gpurate", default={})),
            *report_rates.guidellm_rows(_get(r, "guidellm", default={}))]


def pipeline_rows(r: dict) -> list[Row]:
    eng, pipe = _get(r, "engine", "tok_per_s"), _get(r, "pipeline", "tok_per_s")
    ratio = pipeline_ratio(r)
    return [Row("pipeline", "engine in-process, 64 req x 64 prompt x 64 out", _fmt(eng, unit=" tok/s"), "", ""),
            Row("pipeline", "full pipeline, same workload", _fmt(pipe, unit=" tok/s"), "", ""),
            Row("pipeline", "full pipeline / engine in-process (median of interleaved pairs)",
                _fmt(ratio, ".2f", "x"), ">= 0.85x here; >= 0.97x on the 0.6B shape", _check(ratio, 0.85, False))]


def cpu_rows(r: dict) -> list[Row]:
    """CPU per token per stage, the engine alone and the scheduler's plumbing over it, Redis commands per token."""
    out: list[Row] = []
    cpu = _get(r, "cpu", "us_per_token", default={})
    for stage in ("api", "tokenizer", "scheduler", "detokenizer", "redis", "client"):
        if stage in cpu:
            goal = CPU_GOALS_US.get(stage)
            out.append(Row("cpu", f"CPU per generated token: {stage}", _fmt(cpu[stage], ",.1f", " µs"),
                           f"<= {goal:.0f} µs" if goal else "", _check(cpu[stage], goal, True)))
    eng_us, plumbing = _get(r, "cpu", "engine_alone_us_per_token"), _get(r, "cpu", "scheduler_plumbing")
    if eng_us is not None:
        out.append(Row("cpu", "CPU per generated token: the engine alone (in-process)", _fmt(eng_us, ",.1f", " µs"),
                       "", ""))
        out.append(Row("cpu", "scheduler plumbing over the engine alone", _fmt(plumbing, "+.0%"), "<= +10%",
                       _check(plumbing, 0.10, True)))
    cmds = _get(r, "cpu", "redis_cmds_per_token")
    out.append(Row("redis", "Redis commands per generated token (paged engine, 1 token per step)",
                   _fmt(cmds, ".2f"), "<= 1.1 at one token per step; <= 0.5 when steps are merged",
                   _check(cmds, 1.1, True)))
    return out


def merged_rows(merged: dict) -> list[Row]:
    if not merged:
        return []
    k = merged["stream_interval"]
    out = [Row("merged", f"--stream-interval {k}: full pipeline / engine in-process",
               _fmt(merged.get("ratio_vs_engine"), ".2f", "x") + f" ({merged['tok_per_s']:,.0f} tok/s)",
               ">= 0.85x here", _check(merged.get("ratio_vs_engine"), 0.85, False))]
    mcpu = merged.get("us_per_token", {})
    for stage in ("api", "detokenizer"):
        out.append(Row("merged", f"--stream-interval {k}: CPU per generated token: {stage}",
                       _fmt(mcpu.get(stage), ",.1f", " µs"), f"<= {CPU_GOALS_US[stage]:.0f} µs",
                       _check(mcpu.get(stage), CPU_GOALS_US[stage], True)))
    out.append(Row("merged", f"--stream-interval {k}: Redis commands per generated token",
                   _fmt(merged.get("redis_cmds_per_token"), ".2f"), "<= 0.5 when steps are merged",
                   _check(merged.get("redis_cmds_per_token"), 0.5, True)))
    return out


def synthetic_rows(syn: dict) -> list[Row]:
    out = []
    for key, label in (("api1", "one API process"), ("api2", "two API processes")):
        run = syn.get(key)
        if run:
            out.append(Row("synthetic", f"512 streams, 20 ms step, {label}: delivered (steady)",
                           f"{run['steady_tok_per_s']:,.0f} tok/s = {run['steady_tok_per_s'] / run['ideal']:.0%} "
                           f"({run['tok_per_s']:,.0f} overall)", f"ideal {run['ideal']:,.0f} tok/s", ""))
    if syn.get("api1"):
        out.append(Row("redis", "Redis commands per generated token (synthetic, 512 streams)",
                       _fmt(syn["api1"].get("redis_cmds_per_token"), ".2f"), "<= 1.1 at one token per step",
                       _check(syn["api1"].get("redis_cmds_per_token"), 1.1, True)))
    return out


def streams_10k_rows(big: dict) -> list[Row]:
    if not big or big.get("skipped"):
        return []
    delivered = big["ok"] == big["requests"]
    failed = ", ".join(f"{n:,} {why}" for why, n in big.get("error_counts", {}).items())
    rss_mb = big["api_rss_peak_kb"] / 1024
    added = big["itl_p99_ms"] - big["step_ms"]
    return [Row("10k", f"{big['requests']:,} streams on one API process: delivered",
                f"{big['ok']:,} of {big['requests']:,}, peak {big['peak_open']:,} open"
                + (f" (failed: {failed})" if failed else ""),
                "all, all open at once", "met" if delivered and big["peak_open"] >= big["requests"] else "not met"),
            Row("10k", "API process RSS, peak", f"{rss_mb:,.0f} MB", "< 1 GB", _check(rss_mb, 1024, True)),
            Row("10k", "ITL p99 added by the plumbing (ITL p99 - step)", _fmt(added, ",.1f", " ms"), "<= 5 ms",
                _check(added, 5.0, True))]


def transformers_rows(tf: dict) -> list[Row]:
    if tf.get("skipped"):
        return [Row("transformers", "vs transformers serve --continuous-batching", "skipped: " + tf["skipped"],
                    ">= 2x (demo model)", "")]
    if not tf:
        return []
    ratio = tf["rsinfer"]["tok_per_s"] / tf["transformers"]["tok_per_s"]
    return [Row("transformers", "rsinfer vs transformers serve --continuous-batching (openai client)",
                f"{tf['rsinfer']['tok_per_s']:,.0f} vs {tf['transformers']['tok_per_s']:,.0f} tok/s = "
                f"{ratio:.2f}x", ">= 2x (demo model); >= 1.5x (0.6B shape)", _check(ratio, 2.0, False)),
            Row("transformers", "TTFT p50, rsinfer vs transformers",
                f"{tf['rsinfer']['ttft_p50_ms']:,.0f} vs {tf['transformers']['ttft_p50_ms']:,.0f} ms", "", "")]


def prefix_rows(pr: dict) -> list[Row]:
    """Issue 14's routing figures, shared stream vs prefix routing per scheduler count (no goal is set)."""
    out = []
    for n, s in pr.get("summary", {}).items():
        shared_hit, routed_hit = s["hit_rate"]
        out.append(Row("routing", f"prefix hit rate, {n} schedulers: shared stream -> prefix routing",
                       f"{shared_hit:.0%} -> {routed_hit:.0%}", "", ""))
        out.append(Row("routing", f"TTFT p50 / p99, {n} schedulers: shared stream -> prefix routing",
                       f"{s['ttft_p50_ms'][0]:,.0f} / {s['ttft_p99_ms'][0]:,.0f} -> {s['ttft_p50_ms'][1]:,.0f} / "
                       f"{s['ttft_p99_ms'][1]:,.0f} ms", "", ""))
        ratio = s.get("throughput_ratio")
        out.append(Row("routing", f"output tokens/s, {n} schedulers: shared stream -> prefix routing",
                       f"{s['output_tok_per_s'][0]:,.0f} -> {s['output_tok_per_s'][1]:,.0f}"
                       + (f" ({ratio:.2f}x)" if ratio else ""), "", ""))
    return out


def _or(value, default):
    return default if value is None else value


def prefix_section(pr: dict) -> list[str]:
    """The routing section of docs/benchmarks.md: every configuration's figures, and how they were measured."""
    runs, cfg, meta = pr.get("runs", []), pr.get("config", {}), pr.get("meta", {})
    if not runs:
        return []
    lines = ["", "## Prefix-aware routing (issue 14)", "",
             f"`bench/prefix_routing.py` (`make bench` section `prefix`), measured {meta.get('started_at', '?')}"
             f"{', commit `' + meta['commit'] + '`' if meta.get('commit') else ''}: {cfg.get('system_prompts')} system "
             f"prompts of {cfg.get('system_tokens')} token ids, {cfg.get('conversations')} conversations of "
             f"{cfg.get('turns')} turns (each turn resends the conversation so far plus {cfg.get('user_tokens')} new "
             f"user tokens; {cfg.get('max_tokens')} answer tokens, greedy), {cfg.get('concurrency')} conversations at "
             "a time, streamed `/generate` on the demo model on CPU (one torch thread per scheduler, "
             f"{_get(cfg, 'scheduler_env', 'RSINFER_MAX_KV_TOKENS', default='?')} KV tokens each). A fresh stack per "
             f"row; load weight (`--prefix-routing-load-tokens`) {_or(cfg.get('load_tokens'), 'the default, 64')}; "
             f"skew bound (`--prefix-routing-max-skew`) {_or(cfg.get('max_skew'), 'the default, 2')}; the "
             "summary rows above take the medians of the repeats. Hit rate: prompt tokens the schedulers read from "
             "their prefix caches (their `prefix_hit_tokens`) over prompt tokens sent; routed: requests admitted from "
             "a scheduler's own stream. With the shared stream every replica soon caches each system prompt it has "
             "seen, so what it misses is a prompt's first sight on each replica and the turns of a conversation that "
             "land on another replica than the turn before; routing saves those, and grows with the replicas, at the "
             "cost of load imbalance while one replica holds what many requests want.", "",
             "| schedulers | stream | hit rate | routed | TTFT p50 | TTFT p99 | output tok/s | prompt tok/s | wall | "
             "ok | load before |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in runs:
        lines.append(f"| {x['schedulers']} | {'prefix routing' if x['routing'] else 'shared'} | {x['hit_rate']:.0%} "
                     f"| {x['routed']}/{x['admitted']} | {x['ttft_p50_ms']:,.0f} ms | {x['ttft_p99_ms']:,.0f} ms "
                     f"| {x['output_tok_per_s']:,.0f} | {x['prompt_tok_per_s']:,.0f} | {x['wall_s']:.1f} s "
                     f"| {x['ok']}/{x['requests']} | {x.get('loadavg_before', '')} |")
    return lines


LORA_ROUTING_RESULTS = Path(__file__).resolve().parent / "results" / "lora-routing.json"


def lora_routing_section(lr: dict) -> list[str]:
    """Adapter-aware routing against the shared stream, from bench/lora_routing.py's results (issue 23)."""
    runs, cfg, meta = lr.get("runs", []), lr.get("config", {}), lr.get("meta", {})
    if not runs:
        return []
    lines = ["", "## LoRA adapters: adapter-aware routing (issue 23)", "",
             f"`bench/lora_routing.py`, measured {meta.get('started_at', '?')}"
             f"{', commit `' + meta['commit'] + '`' if meta.get('commit') else ''}: {cfg.get('schedulers')} schedulers "
             f"of {cfg.get('max_loras')} LoRA slots, {cfg.get('adapters')} random adapters (rank 16, every "
             f"projection), {cfg.get('requests')} streamed `/generate` requests naming them in a seeded random order "
             f"(the same in every row), {cfg.get('concurrency')} at a time, {cfg.get('max_tokens')} tokens each, on "
             "the demo model on CPU; a fresh stack per row. Loads and evictions: all schedulers' (their heartbeats'); "
             "routed: requests admitted from a scheduler's own stream. Routed, each adapter is loaded once, on the "
             "scheduler with a free slot, and its later requests land there; from the shared stream whoever reads a "
             "request loads its adapter, evicting another, and requests wait for those loads (on the demo model a "
             "load costs milliseconds; on a GPU the copy of the adapter's weights). TTFT and throughput move with "
             "the load of the machine's other processes (see each row's); the loads and evictions hardly do.", "",
             "| stream | LoRA loads | evictions | routed | TTFT p50 | TTFT p99 | output tok/s | wall | ok "
             "| load before |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for x in runs:
        lines.append(f"| {'adapter-aware routing' if x['routing'] else 'shared'} | {x['lora_loads']} "
                     f"| {x['lora_evictions']} | {x['routed']}/{x['admitted']} | {x['ttft_p50_ms']:,.0f} ms "
                     f"| {x['ttft_p99_ms']:,.0f} ms | {x['output_tok_per_s']:,.0f} | {x['wall_s']:.1f} s "
                     f"| {x['ok']}/{x['requests']} | {x.get('loadavg_before', '')} |")
    return lines


def pipeline_ratio(r: dict) -> float | None:
    """Pipeline over engine in-process: the median of the interleaved pairs' ratios where recorded, else the
    ratio of the medians."""
    eng, pipe = _get(r, "engine", "tok_per_s"), _get(r, "pipeline", "tok_per_s")
    return _get(r, "pipeline", "ratio_vs_engine") or (pipe / eng if eng and pipe else None)


def headline(r: dict) -> dict:
    """The few figures that say how a run went, for the run-to-run table (bench/results/history.jsonl)."""
    meta, cpu = r.get("meta", {}), r.get("cpu", {})
    eng, pipe = _get(r, "engine", "tok_per_s"), _get(r, "pipeline", "tok_per_s")
    tf = r.get("vs_transformers", {})
    big = r.get("streams_10k", {})
    return {
        "started_at": meta.get("started_at"), "commit": meta.get("commit"), "mode": meta.get("mode"),
        "loadavg_before": meta.get("loadavg_before"), "loadavg_after": meta.get("loadavg_after"),
        "engine_tok_per_s": eng, "pipeline_tok_per_s": pipe,
        "pipeline_ratio": round(pipeline_ratio(r), 3) if pipeline_ratio(r) else None,
        "api_us": _get(cpu, "us_per_token", "api"), "detokenizer_us": _get(cpu, "us_per_token", "detokenizer"),
        "scheduler_plumbing": cpu.get("scheduler_plumbing"), "redis_cmds_per_token": cpu.get("redis_cmds_per_token"),
        "synthetic_512_steady": _get(r, "synthetic", "api1", "steady_tok_per_s"),
        "synthetic_512_2api_steady": _get(r, "synthetic", "api2", "steady_tok_per_s"),
        "streams_10k_ok": big.get("ok"),
        "vs_transformers": round(tf["rsinfer"]["tok_per_s"] / tf["transformers"]["tok_per_s"], 3)
        if tf.get("rsinfer") and tf.get("transformers") else None,
    }


HISTORY_COLUMNS = [("started_at", "run", "{}"), ("loadavg_before", "load before", "{}"),
                   ("pipeline_ratio", "pipeline / engine", "{:.2f}x"), ("api_us", "API µs/tok", "{:.0f}"),
                   ("detokenizer_us", "detok µs/tok", "{:.0f}"), ("scheduler_plumbing", "sched plumbing", "{:+.0%}"),
                   ("redis_cmds_per_token", "Redis cmds/tok", "{:.2f}"),
                   ("synthetic_512_steady", "512 streams tok/s", "{:,.0f}"),
                   ("synthetic_512_2api_steady", "512 streams, 2 APIs", "{:,.0f}"),
                   ("streams_10k_ok", "10k delivered", "{:,}"), ("vs_transformers", "vs transformers", "{:.2f}x")]


def history_table(history: list[dict]) -> list[str]:
    """The runs recorded in bench/results/history.jsonl, newest first: how much the figures move between runs."""
    if not history:
        return []
    lines = ["| " + " | ".join(label for _, label, _ in HISTORY_COLUMNS) + " |",
             "|" + "---|" * len(HISTORY_COLUMNS)]
    for h in reversed(history):
        cells = [("—" if h.get(k) is None else fmt.format(h[k])) for k, _, fmt in HISTORY_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


HOST_RESULTS = Path(__file__).resolve().parent / "results" / "host-bench.json"


def host_section(h: dict) -> list[str]:
    """The engine's host time per decode step before and after issue 20, from bench/host_bench.py's results."""
    modes = sorted({key.split("/", 1)[1] for key in h if "/" in key}, reverse=True)
    if not modes:
        return []
    any_run = next(iter(h.values()))
    lines = ["", "## Engine host time per decode step (issue 20)", "",
             "`bench/host_bench.py`: the engine's own Python on CPU (scheduling, metadata, plan, input copies, "
             "graph replay, sampler, outputs) around CUDA-graph replays that queue a fixed time on a simulated GPU "
             "stream (0.25 ms at batch 1, 6 ms at 256, linear between: an H200's decode step of Qwen3-0.6B); "
             "`before` is the engine of the commit before issue 20 (synchronous steps: its `ids.tolist()` waits "
             "for the stream), `after` this one (overlapped steps). Host ms is the host thread's CPU time per step "
             "outside its waits for results (median over the steps; wall time less waits moves with other "
             "processes on this machine, the JSON has both); GPU busy is the share of wall time the stream "
             "worked, measured, and as it follows from the host time (synchronous: GPU / (GPU + host); "
             "overlapped: GPU / max(GPU, host)). Goal: host time hidden behind the GPU step at batch 64 and 256, "
             f"<= 0.3 ms at batch 1. Measured {any_run.get('when', '?')} on {any_run.get('machine', {}).get('cpus')} "
             f"CPUs, {any_run.get('config', {}).get('steps')} steps x median of "
             f"{any_run.get('config', {}).get('repeat')} runs; flashinfer's own plan() cost is not in these figures "
             "(a fake does its copies only): the plans column says how often a step pays it.", "",
             "| sampling | batch | GPU step | host ms/step, before -> after | GPU busy measured | "
             "GPU busy from host time | plan() per step | goal |",
             "|---|---|---|---|---|---|---|---|"]
    for mode in modes:
        before = {r["batch"]: r for r in h.get(f"before/{mode}", {}).get("results", [])}
        after = {r["batch"]: r for r in h.get(f"after/{mode}", {}).get("results", [])}
        for batch in sorted(set(before) | set(after)):
            b, a = before.get(batch, {}), after.get(batch, {})
            gpu = (a or b).get("gpu_ms", 0.0)
            hb, ha = b.get("host_cpu_ms_per_step"), a.get("host_cpu_ms_per_step")
            model_b = f"{100 * gpu / (gpu + hb):.0f}%" if hb is not None else "?"
            model_a = f"{100 * gpu / max(gpu, ha):.0f}%" if ha is not None else "?"
            goal = "?" if ha is None else ("met" if (ha <= 0.3 if batch == 1 else ha <= gpu) else "not met")
            lines.append(
                f"| {mode} | {batch} | {gpu:.2f} ms | {_ms(hb)} -> {_ms(ha)} | "
                f"{_pct(b.get('gpu_busy_share'))} -> {_pct(a.get('gpu_busy_share'))} | {model_b} -> {model_a} | "
                f"{b.get('plans_per_step', 0):.2f} -> {a.get('plans_per_step', 0):.2f} | {goal} |")
    return lines


LORA_RESULTS = Path(__file__).resolve().parent / "results" / "lora-step.json"
LORA_CONFIGS = (("no-lora", "no adapters (--max-loras 0)"), ("base", "adapters on, every row on the base"),
                ("1-adapter", "1 adapter"), ("4-adapters", "4 distinct adapters"))


def lora_section(lr: dict) -> list[str]:
    """The step cost of LoRA adapters at batch 16 on CPU, from bench/lora_bench.py's results (issue 23)."""
    shapes = lr.get("shapes") or {}
    if not shapes:
        return []
    cfg, machine = lr.get("config", {}), lr.get("machine", {})
    lines = ["", "## LoRA adapters: engine step time at batch 16 (issue 23)", "",
             f"`bench/lora_bench.py`: the paged engine's decode step with {cfg.get('batch', 16)} rows, all on the base "
             f"model, on one adapter, or 4 rows on each of 4 adapters; random adapters of rank {cfg.get('rank', '?')} "
             f"on all seven projections (the dearest kind), {cfg.get('dtype', 'float32')}, "
             f"{cfg.get('threads', 1)} torch thread, on CPU (grouped matmuls: one pair per adapter present in the "
             "step). CPU ms is this process's CPU time per step (median step of a run, median of "
             f"{cfg.get('runs', '?')} interleaved runs, and the best run); wall time moves with the other "
             f"processes on the machine (the JSON has both). Measured {lr.get('when', '?')} on "
             f"{machine.get('cpus', '?')} CPUs, load average {_load(machine.get('loadavg'))} before, "
             f"{_load(machine.get('loadavg_after'))} after. A base-only step with adapters on runs exactly the ops "
             "of one without (counted in tests/unit/engine/test_step_budgets.py), so its difference from `no "
             "adapters` is noise. Adapter rows cost a pair of small matmuls per adapter present and projection (and "
             "a gather and a scatter when its rows are not contiguous): on CPU their dispatch, more than their "
             "arithmetic (1.7% of the Qwen3-0.6B shape's per token at rank 16), is the cost, so it grows with the "
             "distinct adapters of a step and dominates on the 1M-parameter demo model. CUDA steps run two segment "
             "GEMMs per projection whatever the adapters, decode steps from graphs (`bench/gpu_check.py`, "
             "section 6).", "",
             "| model | " + " | ".join(label for _, label in LORA_CONFIGS) + " |",
             "|---|" + "---|" * len(LORA_CONFIGS)]
    for shape, r in shapes.items():
        c = r.get("configs", {})
        cells = []
        for key, _ in LORA_CONFIGS:
            v = c.get(key)
            runs = [x["cpu_ms"] for x in v.get("runs", [])] if v else []
            best = f"; best {min(runs):.2f}" if runs else ""
            cells.append("?" if v is None else f"{v['cpu_ms']:.2f} ms ({v['cpu_vs_no_lora']:.2f}x){best}")
        params = r.get("params")
        name = f"{shape} ({params / 1e6:,.0f}M parameters)" if params else shape
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _load(v) -> str:
    return "?" if not v else " / ".join(f"{x:.1f}" for x in v)


def _ms(v) -> str:
    return "?" if v is None else f"{v:.3f} ms"


def _pct(v) -> str:
    return "?" if v is None else f"{100 * v:.0f}%"


def markdown(r: dict, plots: list[str], history: list[dict] | None = None, *, host: dict | None = None,
             lora: dict | None = None, lora_routing: dict | None = None) -> str:
    """docs/benchmarks.md from a results JSON (bench/run_all.py --report-only regenerates it)."""
    meta = r.get("meta", {})
    lines = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (`bench/run_all.py`) from "
        f"`{meta.get('results_file', 'bench/results/run_all.json')}`; regenerate this page with "
        "`python bench/run_all.py --report-only`. Goals are those of issue 11; the GPU-rate section's (`gpurate`) "
        "those of issue 34, whose `guidellm` section sweeps rsinfer and `transformers serve` with guidellm.",
        "",
        f"Measured {meta.get('started_at', '?')} on {meta.get('cpus', '?')} CPUs ({meta.get('cpu_model', '?')}), "
        f"{meta.get('mode', '?')} mode, commit `{meta.get('commit', '?')}`, {meta.get('duration_s', 0):.0f} s in all. "
        f"Load average before/after: {meta.get('loadavg_before', '?')} / {meta.get('loadavg_after', '?')} "
        "(others share this machine: throughput figures move by up to 2x between runs, CPU and Redis per token "
        "by a few percent; see Run to run).",
        "",
        "| section | figure | measured | goal | |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {x.section} | {x.figure} | {x.measured} | {x.goal} | {x.verdict} |" for x in rows(r)]
    sweep = _get(r, "synthetic", "sweep", default=[])
    if sweep:
        lines += ["", "## Concurrency sweep (synthetic engine, 20 ms step, one API process)", "",
                  "| streams | tok/s (steady) | ideal | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | errors "
                  "| CPU µs/token: api, scheduler, detokenizer, redis, client |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for p in sweep:
            cpu = p.get("us_per_token", {})
            per = ", ".join(f"{cpu.get(k, 0):.0f}" for k in ("api", "scheduler", "detokenizer", "redis", "client"))
            lines.append(f"| {p['concurrency']} | {p['steady_tok_per_s'] or p['tok_per_s']:,.0f} | {p['ideal']:,.0f} "
                         f"| {p['ttft_p50_ms']:,.0f} ms | {p['ttft_p99_ms']:,.0f} ms | {p['itl_p50_ms']:,.1f} ms "
                         f"| {p['itl_p99_ms']:,.1f} ms | {p['requests'] - p['ok']} | {per} |")
    cmds = _get(r, "cpu", "redis_cmds", default={})
    if cmds:
        tokens = r["cpu"]["tokens"]
        lines += ["", "## Redis commands per generated token, by command (paged engine run)", "",
                  "| command | calls | per token |", "|---|---|---|"]
        lines += [f"| {k} | {v:,} | {v / tokens:.3f} |" for k, v in cmds.items()]
    lines += prefix_section(_get(r, "prefix_routing", default={}))
    from bench import report_rates  # it imports this module's Row

    lines += report_rates.gpurate_section(_get(r, "gpurate", default={}))
    lines += report_rates.slo_section(_get(r, "slo", default={}))
    lines += report_rates.guidellm_section(_get(r, "guidellm", default={}))
    lines += host_section(host or {})
    lines += lora_section(lora or {})
    lines += lora_routing_section(lora_routing or {})
    lines += report_rates.tp_section(load(report_rates.TP_RESULTS) if report_rates.TP_RESULTS.exists() else {})
    if history:
        lines += ["", "## Run to run", "",
                  "The headline figures of every recorded run (`bench/results/history.jsonl`), newest first; on a "
                  "shared 2-core machine they move a lot with the load of other processes.", "",
                  *history_table(history)]
    lines += ["", "## How each figure is measured", "", *METHOD, ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots] + [""]
    return "\n".join(lines)


METHOD = [
    "- **Engine in-process**: `bench/engine_bench.py --systems a`: the paged engine in one process, one torch "
    "thread (as the scheduler runs), every request added at once, greedy, EOS ignored; before each pipeline run "
    "(interleaved, so that other load falls on both) a process makes two runs and the second counts; median.",
    "- **Full pipeline**: the same processes `rsinfer up` starts (redis-server, tokenizer, scheduler, detokenizer, "
    "API), the same 64 prompts of 64 token ids sent at once as streamed `/v1/completions` with `ignore_eos`, "
    "by a raw-socket asyncio client; output tokens (from the usage chunk) over the wall time; median of the runs.",
    "- **CPU per generated token**: utime+stime deltas of each process from `/proc/<pid>/stat` over a run of 256 "
    "requests at 64 concurrent, divided by the tokens generated; `client` is the load generator. The engine alone "
    "is the same workload in-process (`engine_bench.py --requests 256 --max-running 64`), its process CPU time; "
    "the scheduler's plumbing is its CPU over that, minus one.",
    "- **Redis commands per token**: the `INFO commandstats` call deltas over the same run, over its tokens "
    "(heartbeats and other periodic commands included; the bench's own INFO left out).",
    "- **Synthetic engine**: `--engine synthetic --step-ms 20` (no model; one token per running sequence per "
    "step), 512 streams open at once through one API process, then through two (the client alternates "
    "between them). `steady` counts tokens only while all streams were open (ramp-up and tail left out); "
    "ideal = streams x 1000 / step_ms.",
    "- **10,000 streams**: the synthetic engine (20 ms step, every stream running at once: max_running 10,000) "
    "and one API process; streams opened evenly over 10 s (`--big-arrival-s`) by 4 client processes, few tokens "
    "each, so that all are open at once when the plumbing keeps up; `peak open` is counted by the client; the "
    "API's peak RSS is VmHWM from `/proc/<pid>/status`; ITL is the gap between SSE chunks.",
    "- **vs transformers**: `transformers serve --continuous-batching` (OMP_NUM_THREADS=1) and rsinfer, both "
    "driven by the official `openai` AsyncOpenAI client: streamed chat completions, 64 tokens each "
    "(transformers with a generation config whose EOS no token has, rsinfer with `ignore_eos`), each warmed up, "
    "both servers "
    "up at once (each idles near 0% CPU) and their runs interleaved; median of the runs.",
    "- **Prefix-aware routing**: `bench/prefix_routing.py`, described with its table above; each configuration "
    "runs on a fresh stack after one warm-up request, `--repeat` times (the summary rows take medians), so its TTFT "
    "and throughput move with the machine's load as much as the others (the hit rate and routed share hardly do).",
    "- **LoRA step cost**: `bench/lora_bench.py`, described with its table above (not part of `make bench`: run it "
    "by itself; the page keeps its last results from `bench/results/lora-step.json`).",
    "- **LoRA routing**: `bench/lora_routing.py`, described with its table above (not part of `make bench` either; "
    "its last results are in `bench/results/lora-routing.json`).",
    "- **Tensor parallelism on CPU**: `bench/tp_bench.py`, described with its table above (not part of `make bench` "
    "either; its last results are in `bench/results/tp-step.json`).",
    "- **GPU step rate** and **guidellm sweeps**: described with their tables above (sections `gpurate` and "
    "`guidellm`).",
    "- TTFT is from sending the request to its first non-empty chunk; ITL p50/p99 over the gaps between chunks "
    "(a chunk may carry several tokens when the API coalesces).",
]


def plots(r: dict, out_dir: Path) -> list[Path]:
    """PNG plots of a results JSON (matplotlib, the `bench` extra); [] if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plots")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    made = []
    sweep = _get(r, "synthetic", "sweep", default=[])
    if sweep:
        c = [p["concurrency"] for p in sweep]
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        a.plot(c, [p["steady_tok_per_s"] or p["tok_per_s"] for p in sweep], "o-", label="delivered (steady)")
        a.plot(c, [p["ideal"] for p in sweep], "k--", label="ideal (streams x 50/s)")
        a.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="tokens/s",
              title="synthetic engine, 20 ms step, one API")
        a.set_xticks(c, [str(x) for x in c])
        a.legend()
        for key, style in (("ttft_p50_ms", "o-"), ("ttft_p99_ms", "o--"), ("itl_p50_ms", "s-"), ("itl_p99_ms", "s--")):
            b.plot(c, [p[key] for p in sweep], style, label=key.replace("_ms", ""))
        b.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="ms", title="latency")
        b.set_xticks(c, [str(x) for x in c])
        b.legend()
        fig.tight_layout()
        made.append(_save(fig, out_dir / "sweep.png", plt))
    cpu = _get(r, "cpu", "us_per_token", default={})
    if cpu:
        fig, ax = plt.subplots(figsize=(7, 4))
        names = list(cpu)
        ax.bar(names, [cpu[n] for n in names], color="tab:blue", label="measured")
        goals = {"api": 30, "detokenizer": 20}
        eng = _get(r, "cpu", "engine_alone_us_per_token")
        if eng:
            goals["scheduler"] = eng * 1.1
        ax.scatter([n for n in names if n in goals], [goals[n] for n in names if n in goals], color="tab:red",
                   marker="_", s=800, linewidths=3, label="goal")
        ax.set(ylabel="CPU µs per generated token", title="256 requests at 64 concurrent, demo model")
        ax.legend()
        fig.tight_layout()
        made.append(_save(fig, out_dir / "cpu_per_token.png", plt))
    bars = {}
    for label, path in (("engine in-process", ("engine", "tok_per_s")), ("pipeline", ("pipeline", "tok_per_s")),
                        ("rsinfer (openai client)", ("vs_transformers", "rsinfer", "tok_per_s")),
                        ("transformers serve CB", ("vs_transformers", "transformers", "tok_per_s"))):
        v = _get(r, *path)
        if v:
            bars[label] = v
    if bars:
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.bar(list(bars), list(bars.values()), color="tab:green")
        ax.set(ylabel="output tokens/s", title="demo model, 2 CPUs")
        fig.tight_layout()
        made.append(_save(fig, out_dir / "throughput.png", plt))
    from bench import report_rates  # it imports this module's Row

    guidellm = report_rates.guidellm_plot(_get(r, "guidellm", default={}), out_dir, plt)
    return made + ([guidellm] if guidellm else [])


def _save(fig, path: Path, plt) -> Path:
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_docs(r: dict, docs_path: Path, plot_dir: Path, history: list[dict] | None = None) -> None:
    made = plots(r, plot_dir)
    rel = [Path(_relative(p, docs_path.parent)).as_posix() for p in made]
    host = load(HOST_RESULTS) if HOST_RESULTS.exists() else {}
    lora = load(LORA_RESULTS) if LORA_RESULTS.exists() else {}
    routing = load(LORA_ROUTING_RESULTS) if LORA_ROUTING_RESULTS.exists() else {}
    docs_path.write_text(markdown(r, rel, history, host=host, lora=lora, lora_routing=routing))


def read_history(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _relative(path: Path, start: Path) -> str:
    return os.path.relpath(path.resolve(), start.resolve())


def load(path: Path) -> dict:
    return json.loads(path.read_text())
