"""The write-up of `make bench`'s `gpurate` and `guidellm` sections (issue 34): their rows of the summary table,
their tables in docs/benchmarks.md and the guidellm plot, from results JSON; no processes, no sockets."""

from __future__ import annotations

from pathlib import Path

from bench.report import Row, _check, _fmt

PLUMBING = ("api", "tokenizer", "scheduler", "detokenizer", "redis")
GOAL_US, GOAL_CMDS = 25.0, 0.3  # issue 34's goals at GPU step rates: plumbing µs and Redis commands per token
SERVERS = ("rsinfer", "transformers")


def gpurate_rows(g: dict) -> list[Row]:
    if not g:
        return []
    shape = f"{g['step_ms']:.0f} ms step x {g['streams']} streams"
    return [Row("gpurate", f"{shape}: plumbing CPU per generated token, all processes",
                _fmt(g["plumbing_us_per_token"], ",.1f", " µs") +
                f" = {g['plumbing_cores_per_10k_tok_s']:.2f} cores per 10k tok/s",
                f"<= {GOAL_US:.0f} µs", _check(g["plumbing_us_per_token"], GOAL_US, True)),
            Row("gpurate", f"{shape}: Redis commands per generated token", _fmt(g["redis_cmds_per_token"], ".2f"),
                f"<= {GOAL_CMDS}", _check(g["redis_cmds_per_token"], GOAL_CMDS, True)),
            Row("gpurate", f"{shape}: delivered (steady), one API process",
                f"{g['steady_tok_per_s']:,.0f} tok/s = {g['fraction_of_ideal']:.0%}", f"ideal {g['ideal']:,.0f} tok/s",
                "")]


def gpurate_section(g: dict) -> list[str]:
    if not g:
        return []
    per = g["us_per_token"]
    return ["", "## At a GPU's step rate (synthetic engine, issue 34)", "",
            f"`make bench` section `gpurate` (`bench/gpurate.py`): the synthetic engine steps every "
            f"{g['step_ms']:.0f} ms with {g['streams']} streams running (one token per stream per step: the shape "
            f"of a small model's decode on an H100/H200, ideal {g['ideal']:,.0f} tok/s), {g['requests']} streamed "
            f"`/v1/completions` of {g['max_tokens']} tokens, {g['streams']} at a time through one API process. CPU "
            "per generated token of "
            "each process from `/proc/<pid>/stat`; `cores per 10k tok/s` = plumbing CPU seconds per token x 10,000: "
            "the cores a pod spends on the plumbing for every 10,000 tok/s its GPU decodes. On 2 shared cores the "
            "delivered rate is bounded by the plumbing's CPU (and the load generator's), not by the engine.", "",
            "| " + " | ".join(PLUMBING) + " | plumbing in all | cores per 10k tok/s | Redis cmds/token | client "
            "| delivered (steady) | TTFT p50/p99 | ITL p50/p99 | chunks/request | ok |",
            "|" + "---|" * (len(PLUMBING) + 9),
            "| " + " | ".join(f"{per.get(k, 0):.1f} µs" for k in PLUMBING) +
            f" | {g['plumbing_us_per_token']:.1f} µs | {g['plumbing_cores_per_10k_tok_s']:.2f} "
            f"| {g['redis_cmds_per_token']:.2f} | {per.get('client', 0):.1f} µs "
            f"| {g['steady_tok_per_s']:,.0f} tok/s ({g['fraction_of_ideal']:.0%}) "
            f"| {g['ttft_p50_ms']:,.0f} / {g['ttft_p99_ms']:,.0f} ms "
            f"| {g['itl_p50_ms']:.1f} / {g['itl_p99_ms']:.1f} ms "
            f"| {g['chunks_per_request']:.0f} | {g['ok']}/{g['requests']} |", *per_request_table(g),
            *flush_sweep_table(g)]


def per_request_table(g: dict) -> list[str]:
    """What a request costs apart from its tokens (the same requests, one token each), and that spread over the
    main run's tokens per request."""
    r = g.get("per_request")
    if not r:
        return []
    return ["", f"A request apart from its tokens: the same {r['requests']} requests with one token each, on the same "
            "stack (admission, record, job, marks, TTLs, end, and the one token's chunk). Spread over a request of "
            f"{g['max_tokens']} tokens it is the part of the plumbing per token that merging tokens into fewer "
            "chunks cannot cut.", "",
            "| " + " | ".join(PLUMBING) + f" | in all | per token over {g['max_tokens']} | share of the plumbing "
            "| Redis cmds |", "|" + "---|" * (len(PLUMBING) + 4),
            "| " + " | ".join(f"{r['us'].get(k, 0):,.0f} µs" for k in PLUMBING) +
            f" | {r['us_in_all']:,.0f} µs | {r['us_per_token_spread']:.1f} µs | {r['share_of_plumbing']:.0%} "
            f"| {r['redis_cmds']:.1f} |"]


def flush_sweep_table(g: dict) -> list[str]:
    """The same load at several --stream-flush-ms, unpaced, and at the defaults (the section's main run)."""
    sweep = g.get("flush_sweep") or []
    if not sweep:
        return []
    rows = sorted([g, *sweep], key=lambda p: (p["flush_ms"], p.get("entry_rate", 0)))
    lines = ["", "The same load at other settings: `--stream-flush-ms` T, how long a choice's tokens may wait to merge "
             "into one delta (its first token and its end go at once), and `--stream-entry-rate` R, the deltas per "
             "second a scheduler aims at (a token waits choices / R, at most T; 0: always T). The stages' CPU and "
             "Redis' commands are paid per delta, so they fall as deltas carry more tokens; the gaps between chunks "
             "grow toward the wait.", "",
             "| T (ms) | R (/s) | tokens per chunk | XADD / token | Redis cmds / token | api | detokenizer | "
             "plumbing in all | delivered (steady) | TTFT p50 | ITL p50 / p99 |", "|" + "---|" * 11]
    for p in rows:
        per = p["us_per_token"]
        flush = f"{p['flush_ms']:.0f}" + (" (default)" if p.get("flush_default") else "")
        per_chunk = p["max_tokens"] / p["chunks_per_request"] if p["chunks_per_request"] else 0.0
        xadds = f"{p['xadds_per_token']:.2f}" if "xadds_per_token" in p else "–"
        lines.append(f"| {flush} | {p.get('entry_rate', 0):,.0f} | {per_chunk:.1f} | {xadds} | "
                     f"{p['redis_cmds_per_token']:.2f} | {per.get('api', 0):.1f} µs | "
                     f"{per.get('detokenizer', 0):.1f} µs | {p['plumbing_us_per_token']:.1f} µs | "
                     f"{p['steady_tok_per_s']:,.0f} tok/s ({p['fraction_of_ideal']:.0%}) | "
                     f"{p['ttft_p50_ms']:,.0f} ms | {p['itl_p50_ms']:.1f} / {p['itl_p99_ms']:.1f} ms |")
    return lines


def _peak(res: dict) -> dict | None:
    """The step of a sweep with the most output tokens per second."""
    steps = [s for s in res.get("steps", []) if s.get("output_tok_per_s")]
    return max(steps, key=lambda s: s["output_tok_per_s"]) if steps else None


def guidellm_rows(gl: dict) -> list[Row]:
    if not gl:
        return []
    if gl.get("skipped"):
        return [Row("guidellm", "guidellm sweeps", "skipped: " + gl["skipped"], "", "")]
    out = []
    for server in SERVERS:
        res = gl.get(server, {})
        peak = _peak(res)
        why = res.get("skipped") or res.get("error")
        measured = (f"{peak['output_tok_per_s']:,.0f} tok/s, {peak['requests_per_s']:.1f} req/s ({peak['step']}); "
                    f"TTFT p50 {peak['ttft_p50_ms']:,.0f} ms, ITL p50 {peak['itl_p50_ms']:.1f} ms") if peak else \
            f"skipped: {why}" if why else "—"
        out.append(Row("guidellm", f"guidellm sweep, {server}: the step of most output tok/s", measured, "", ""))
    return out


def guidellm_section(gl: dict) -> list[str]:
    if not gl or gl.get("skipped"):
        return []
    cfg = gl.get("config", {})
    lines = ["", "## guidellm sweeps: rsinfer vs transformers serve (issue 34)", "",
             f"`make bench` section `guidellm` (`bench/guidellm_sweep.py`): `guidellm run` with a sweep profile "
             f"({cfg.get('sweep_size', '?')} steps of {cfg.get('step_s', '?')} s: synchronous, throughput at "
             f"{cfg.get('max_concurrency', '?')} concurrent, then constant rates between the two) on synthetic prompts "
             f"of {cfg.get('prompt_tokens', '?')} tokens and {cfg.get('output_tokens', '?')} output tokens (the demo "
             f"model's tokenizer), streamed `{cfg.get('endpoint', '?')}`, against rsinfer (the paged engine, demo "
             "model) and `transformers serve --continuous-batching` (OMP_NUM_THREADS=1; a generation config whose EOS "
             "no token has), greedy, every answer capped by guidellm's `max_tokens`. Throughputs over successful "
             "requests (a step's unfinished requests are cut at its end); TTFT and ITL percentiles as guidellm "
             "reports them. guidellm's own processes share the machine's cores with the server's.", "",
             "| server | step | req/s | output tok/s | concurrency p50 | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 "
             "| ok / errored / incomplete |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for server in SERVERS:
        res = gl.get(server, {})
        why = res.get("skipped") or res.get("error")
        if why:
            lines.append(f"| {server} | skipped: {why} |  |  |  |  |  |  |  |  |")
        for s in res.get("steps", []):
            lines.append(f"| {server} | {s['step']} | {_fmt(s['requests_per_s'], '.2f')} "
                         f"| {_fmt(s['output_tok_per_s'])} | {_fmt(s['concurrency_p50'], '.0f')} "
                         f"| {_fmt(s['ttft_p50_ms'], ',.0f', ' ms')} | {_fmt(s['ttft_p99_ms'], ',.0f', ' ms')} "
                         f"| {_fmt(s['itl_p50_ms'], ',.1f', ' ms')} | {_fmt(s['itl_p99_ms'], ',.1f', ' ms')} "
                         f"| {s['successful']} / {s['errored']} / {s['incomplete']} |")
    return lines


def guidellm_plot(gl: dict, out_dir: Path, plt) -> Path | None:
    """Output tok/s against TTFT and ITL percentiles, one line per server and percentile, steps by rate."""
    series = {s: sorted(gl.get(s, {}).get("steps", []), key=lambda x: x.get("output_tok_per_s") or 0)
              for s in SERVERS}
    if not any(series.values()):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric in zip(axes, ("ttft", "itl"), strict=True):
        for server, color in zip(SERVERS, ("tab:blue", "tab:orange"), strict=True):
            steps = series[server]
            for q, style in (("p50", "o-"), ("p99", "s--")):
                pts = [(s["output_tok_per_s"], s[f"{metric}_{q}_ms"]) for s in steps
                       if s.get("output_tok_per_s") and s.get(f"{metric}_{q}_ms") is not None]
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, color=color, label=f"{server} {q}")
        ax.set(yscale="log", xlabel="output tokens/s (guidellm sweep step)", ylabel="ms",
               title=f"{metric.upper()} vs throughput")
        ax.legend()
    fig.tight_layout()
    path = out_dir / "guidellm.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def slo_section(g: dict) -> list[str]:
    """`make bench` section `slo` (bench/slo_goodput.py)."""
    if not g:
        return []
    lines = ["", "## SLO-aware admission under a flood (issue 35)", "",
             f"`make bench` section `slo` (`bench/slo_goodput.py`): the synthetic engine ({g['step_ms']} ms steps, "
             f"{g['max_running']} requests at a time) gets {g['flood']} requests of {g['flood_tokens']} tokens; once "
             f"one finished, {g['probes']} probes of 4 tokens are sent {g['probe_every_s']} s apart with a "
             f"{g['ttft_ms']:,} ms time-to-first-token target. `no target`: the probes send no header (they wait "
             "their turn: late by the target's measure); `fifo`: `x-slo-ttft-ms` on an API without fair lanes "
             "(refused at once, 503); `lanes`: the same on an API with keys, where the tokenizer's fair lane puts "
             "each probe before its tenant's flood (earliest deadline first). Goodput: probes that met the target "
             "per second of the probing window; the counters are the API's `rsinfer_slo_requests_total`."
             + (f" Measured {g['measured']}." if g.get("measured") else ""), "",
             "| scenario | met | late | refused at once (p50) | ended (slo_missed) | TTFT p50 / max | goodput "
             "| counters met/missed/refused |", "|---|---|---|---|---|---|---|---|"]
    for label, s in g["scenarios"].items():
        c = s["counters"]
        refusal = f"{s['refused']} ({s['refusal_p50_ms']} ms)" if s["refused"] else "0"
        ttft = (f"{s['ttft_p50_ms']:,} / {s['ttft_max_ms']:,} ms" if s["ttft_p50_ms"] is not None else "-")
        lines.append(f"| {label} | {s['met']}/{s['probes']} | {s['late']} | {refusal} | {s['ended_missed']} | {ttft} "
                     f"| {s['goodput_per_s']}/s | {c['met']:.0f}/{c['missed']:.0f}/{c['refused']:.0f} |")
    return lines


TP_RESULTS = Path(__file__).resolve().parent / "results" / "tp-step.json"


def tp_section(tp: dict) -> list[str]:
    """Tensor parallelism on CPU over gloo, from bench/tp_bench.py's results (issue 36)."""
    shapes = tp.get("shapes") or {}
    if not shapes:
        return []
    cfg, machine = tp.get("config", {}), tp.get("machine", {})
    lines = ["", "## Tensor parallelism on CPU: what the collectives cost per step (issue 36)", "",
             f"`bench/tp_bench.py`: the paged engine built by the scheduler's factory with `--tensor-parallel-size` 1 "
             f"and 2 (a real worker process, gloo over loopback), {cfg.get('batch', '?')} greedy rows decoding, "
             f"{cfg.get('dtype', 'float32')}, one torch thread per rank; median step of a run, median of "
             f"{cfg.get('runs', '?')} interleaved runs. Collectives: rank 0's wall time inside torch.distributed calls "
             "per step (two all-reduces per layer, one for the embedding, the logits' all-gather and the step's "
             "four broadcasts), which on a loaded 2-core machine is mostly waiting for the other rank to be "
             f"scheduled. Measured {tp.get('when', '?')} on {machine.get('cpus', '?')} CPUs, load average "
             f"{' / '.join(str(x) for x in machine.get('loadavg') or [])} before: a figure, not a goal. On CPU a "
             "second rank buys no speed (both ranks share the same cores); tensor parallelism is for models larger "
             "than one GPU, where NCCL over NVLink all-reduces a decode step's activations in microseconds "
             "(`bench/gpu_check.sh` measures it on a machine with 2 GPUs or more).", "",
             "| model | TP=1 ms/step | TP=2 ms/step | TP=2 collectives per step | their ms per step "
             "| greedy TP=1 = TP=2 |",
             "|---|---|---|---|---|---|"]
    for shape, r in shapes.items():
        one, two = r.get("tp1", {}), r.get("tp2", {})
        lines.append(f"| {shape} | {one.get('wall_ms', 0):.2f} (best {one.get('best_wall_ms', 0):.2f}) | "
                     f"{two.get('wall_ms', 0):.2f} (best {two.get('best_wall_ms', 0):.2f}) | "
                     f"{two.get('collectives', 0):.0f} | {two.get('collective_ms', 0):.2f} | "
                     f"{'yes' if r.get('greedy_agree') else 'no'} |")
    return lines
