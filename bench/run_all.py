"""Every benchmark of issue 11 as one command (`make bench`): what the plumbing costs against the engine.

    python bench/run_all.py                 # quick mode: a few minutes on 2 cores
    python bench/run_all.py --full          # longer runs, more tokens per stream
    python bench/run_all.py --only synthetic,10k     # some sections, merged into the last results
    python bench/run_all.py --report-only   # docs/benchmarks.md and the plots from the last results

Sections (the demo model unless --model):
  engine       the paged engine in-process (bench/engine_bench.py): 64 requests x 64 prompt x 64 out
  pipeline     the same workload through every process (redis-server, tokenizer, scheduler, detokenizer, API)
  cpu          CPU µs per generated token per process and Redis commands per token, 256 requests at 64
               concurrent; the engine alone on the same workload in-process
  transformers `transformers serve --continuous-batching` vs rsinfer, the openai client for both
  synthetic    the synthetic engine at a 20 ms step: 512 streams through one API process, then two; a
               concurrency sweep 1..512 with TTFT/ITL p50/p99
  10k          10,000 streams open at once on one API process (synthetic engine): all delivered, RSS, ITL
  prefix       prefix-aware routing vs the shared stream with 2 and 4 schedulers on a prefix-heavy multi-turn
               workload (bench/prefix_routing.py): prefix hit rate, TTFT, throughput
  gpurate      the synthetic engine at a GPU's step rate, 5 ms x 256 streams of 256 tokens, one API process
               (bench/gpurate.py): plumbing CPU µs per token per process, Redis commands per token
  slo          SLO-aware admission under a flood of 40 queued requests (bench/slo_goodput.py): probes with a 1.5 s
               TTFT target without one, refused at once (no fair lanes), served first in their tenant's lane; goodput
  guidellm     guidellm sweeps (the `bench` extra) against rsinfer and `transformers serve --continuous-batching`
               (bench/guidellm_sweep.py): request and token throughput, TTFT and ITL p50/p99 per step
Writes bench/results/run_all.json, PNG plots in bench/results/plots/ and docs/benchmarks.md (the prefix section
also bench/results/prefix-routing.json, which `bench/prefix_routing.py` alone writes too; the page shows the newer).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import gpurate, guidellm_sweep, prefix_routing, report, slo_goodput  # noqa: E402
from bench.harness import (  # noqa: E402
    TRANSFORMERS_BODY,
    BenchStack,
    ChatLoad,
    completion_body,
    cpu_ticks,
    loadavg,
    openai_load,
    redis_commands,
    rss_kb,
    run_load,
)
from rsinfer import children  # noqa: E402
from rsinfer.redis_server import free_port  # noqa: E402
from rsinfer.sse_client import raise_fd_limit  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "run_all.json"
PLOTS = ROOT / "bench" / "results" / "plots"
DOCS = ROOT / "docs" / "benchmarks.md"
HISTORY = ROOT / "bench" / "results" / "history.jsonl"  # one headline line per run written to RESULTS
SECTIONS = ("engine", "pipeline", "cpu", "merged", "transformers", "synthetic", "10k", "prefix", "gpurate", "slo",
            "guidellm")
MERGED_INTERVAL = 4  # --stream-interval of the merged-steps section
STEP_MS = 20.0
PROMPT_LEN, OUTPUT_LEN = 64, 64

# quick / full sizes
SIZES = {
    "quick": dict(runs=3, cpu_requests=256, syn_tokens=64, syn_waves=2, sweep_tokens=64, big_tokens=16, tf_runs=3,
                  conversations=48, prefix_repeat=1),
    "full": dict(runs=5, cpu_requests=1024, syn_tokens=256, syn_waves=3, sweep_tokens=128, big_tokens=32, tf_runs=5,
                 conversations=48, prefix_repeat=3),
}

T0 = time.monotonic()


@dataclass(frozen=True)
class Target:
    """What every section runs: the checkpoint, the name it is served as, and the sizes of this run's mode."""

    model_dir: str
    name: str
    size: dict


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="longer runs (quick mode by default)")
    ap.add_argument("--only", default="", help=f"comma-separated sections of {','.join(SECTIONS)}; merged into "
                    "the last results")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the demo model)")
    ap.add_argument("--tf-load", default="64,32,64", help="transformers section: requests,concurrency,max_tokens "
                    "(the issue's 0.6B-shape comparison: 32,16,32)")
    ap.add_argument("--report-only", action="store_true", help="only regenerate docs/benchmarks.md and plots")
    ap.add_argument("--out", default=str(RESULTS), help="results JSON")
    ap.add_argument("--big-streams", type=int, default=10_000, help="streams of the 10k section")
    ap.add_argument("--big-arrival-s", type=float, default=10.0, help="10k section: seconds over which streams open")
    ap.add_argument("--big-max-running", type=int, default=0, help="10k section: the synthetic engine's "
                    "max_running (0 = every stream at once)")
    return ap.parse_args()


# ---- (a) the engine in-process, and alone for the CPU figure


def engine_bench(model_dir: str, requests: int, max_running: int, runs: int) -> dict:
    """bench/engine_bench.py's engine (system a) in its own process, one torch thread per core pair as the
    scheduler runs it; its tok/s and CPU µs per token (medians)."""
    threads = max(1, (os.cpu_count() or 2) // 2)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "engine.json"
        cmd = [sys.executable, str(ROOT / "bench" / "engine_bench.py"), "--model", model_dir, "--systems", "a",
               "--requests", str(requests), "--max-running", str(max_running), "--prompt-len", str(PROMPT_LEN),
               "--output-len", str(OUTPUT_LEN), "--threads", str(threads), "--runs", str(runs), "--out", str(out)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS":
                                                                                 str(threads)})
        for line in proc.stdout.splitlines():
            if line.startswith("  run"):
                say(f"    {line.strip()}")
        if proc.returncode:
            raise RuntimeError(f"engine_bench failed:\n{proc.stdout}\n{proc.stderr}")
        res = json.loads(out.read_text())["results"]["engine"]
    return {"tok_per_s": round(res["tok_per_s"], 1), "runs": [round(x, 1) for x in res["runs"]],
            "cpu_us_per_token": round(res["cpu_us_per_token"], 1), "requests": requests, "max_running": max_running,
            "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN, "threads": threads}


# ---- (b) the pipeline, (c) CPU and Redis per token, (f) rsinfer's side vs transformers


def id_prompts(n: int, seed: int, length: int = PROMPT_LEN) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, 1000) for _ in range(length)] for _ in range(n)]


def pipeline_sections(target: Target, want: set[str], results: dict) -> None:
    """(b), (c) and (f) on one stack of the paged engine."""
    model_dir, name, size = target.model_dir, target.name, target.size
    with BenchStack(model_dir, name) as stack:
        say(f"  stack up (logs {stack.log_dir})")
        url = stack.urls[0]
        run_load([url], [completion_body(name, p, 16) for p in id_prompts(8, 1)], 8)  # warm-up
        if "pipeline" in want:
            engine_and_pipeline(stack, target, "engine" in want, results)
        if "cpu" in want:
            results["cpu"] = {**results.get("cpu", {}), **cpu_run(stack, name, size)}
        if "transformers" in want:
            load = ChatLoad(*(int(x) for x in size["tf_load"].split(",")))
            say("(f) vs transformers serve --continuous-batching (OMP_NUM_THREADS=1), the openai client for both: "
                f"{load.requests} requests, {load.concurrency} concurrent, {load.max_tokens} tokens, runs "
                "interleaved")
            results["vs_transformers"] = versus_transformers(url, name, model_dir, size["tf_runs"], load)


def engine_and_pipeline(stack: BenchStack, target: Target, engine: bool, results: dict) -> None:
    """(a) and (b) interleaved run by run (an engine run in its own process, then the same workload through the
    pipeline), so that load from other processes falls on both alike; the medians and their ratio."""
    model_dir, name, size = target.model_dir, target.name, target.size
    url = stack.urls[0]
    engine_runs, runs = [], []
    for i in range(size["runs"]):
        if engine:  # two runs, the second counted: the first after a load runs ~25% slower (allocations)
            e = engine_bench(model_dir, 64, 64, 2)
            engine_runs.append({**e, "tok_per_s": e["runs"][-1]})
        bodies = [completion_body(name, p, OUTPUT_LEN) for p in id_prompts(64, 100 + i)]
        s = run_load([url], bodies, concurrency=64).summary()
        runs.append(s)
        say(f"    run {i + 1}/{size['runs']} pipeline: {s['tok_per_s']:,.0f} tok/s, TTFT p50 {s['ttft_p50_ms']:.0f} ms,"
            f" {s['ok']}/{s['requests']} ok")
    results["pipeline"] = {"tok_per_s": median([r["tok_per_s"] for r in runs]), "runs": runs}
    if engine_runs:
        results["engine"] = {**engine_runs[0], "tok_per_s": median([e["tok_per_s"] for e in engine_runs]),
                             "runs": [e["tok_per_s"] for e in engine_runs], "interleaved": True}
    if engine_runs:  # each pipeline run over the engine run just before it: the pairs saw the same other load
        ratios = [r["tok_per_s"] / e["tok_per_s"] for r, e in zip(runs, engine_runs, strict=True)]
        results["pipeline"]["ratio_runs"] = [round(x, 3) for x in ratios]
        results["pipeline"]["ratio_vs_engine"] = round(median(ratios), 3)
        say(f"  engine {results['engine']['tok_per_s']:,.0f} tok/s; pipeline / engine in-process, median of the "
            f"pairs: {median(ratios):.2f}x")


def merged_section(target: Target, results: dict) -> None:
    """(g) the pipeline workload and the CPU one again with the scheduler merging MERGED_INTERVAL steps into one
    delta per choice (--stream-interval): what the plumbing costs per token when it pays per delta."""
    model_dir, name, size = target.model_dir, target.name, target.size
    env = {"scheduler": {"RSINFER_STREAM_INTERVAL": str(MERGED_INTERVAL), "RSINFER_STREAM_FLUSH_MS": "0"}}  # by steps
    with BenchStack(model_dir, name, env=env) as stack:
        url = stack.urls[0]
        run_load([url], [completion_body(name, p, 16) for p in id_prompts(8, 1)], 8)  # warm-up
        runs = []
        for i in range(size["runs"]):
            bodies = [completion_body(name, p, OUTPUT_LEN) for p in id_prompts(64, 100 + i)]
            runs.append(run_load([url], bodies, concurrency=64).summary())
            say(f"    run {i + 1}/{size['runs']}: {runs[-1]['tok_per_s']:,.0f} tok/s, TTFT p50 "
                f"{runs[-1]['ttft_p50_ms']:.0f} ms, ITL p50 {runs[-1]['itl_p50_ms']:.0f} ms")
        merged = {"stream_interval": MERGED_INTERVAL, "tok_per_s": median([r["tok_per_s"] for r in runs]),
                  "runs": runs, **cpu_run(stack, name, size)}
    engine = _get_engine(results)
    if engine:
        merged["ratio_vs_engine"] = round(merged["tok_per_s"] / engine, 3)
        say(f"  merged pipeline / engine in-process: {merged['ratio_vs_engine']:.2f}x")
    results["merged"] = merged


def _get_engine(results: dict) -> float | None:
    return (results.get("engine") or {}).get("tok_per_s")


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def cpu_run(stack: BenchStack, name: str, size: dict) -> dict:
    n = size["cpu_requests"]
    say(f"  CPU and Redis per token: {n} requests at 64 concurrent")
    bodies = [completion_body(name, p, OUTPUT_LEN) for p in id_prompts(n, 7)]
    out, _ = measured_load(stack, [stack.urls[0]], bodies, concurrency=64)
    say(f"    {out['load']['tok_per_s']:,.0f} tok/s; µs/token " +
        ", ".join(f"{k} {v:.0f}" for k, v in out["us_per_token"].items()) +
        f"; Redis {out['redis_cmds_per_token']:.2f} cmds/token")
    return out


def measured_load(stack: BenchStack, urls: list[str], bodies: list[bytes], concurrency: int, *,
                  stagger_s: float = 0.0, processes: int = 1) -> tuple[dict, list[report.Span]]:
    """A load run with each process's CPU and Redis's command counts measured around it; its request spans."""
    pids = stack.pids()
    clk = os.sysconf("SC_CLK_TCK")
    cmds0, ticks0 = redis_commands(stack.redis_server.url), cpu_ticks(pids)  # type: ignore[union-attr]
    load = run_load(urls, bodies, concurrency, stagger_s=stagger_s, processes=processes)
    ticks1, cmds1 = cpu_ticks(pids), redis_commands(stack.redis_server.url)  # type: ignore[union-attr]
    summary = load.summary()
    tokens = summary["tokens"]
    per = {}
    for proc_name in pids:
        role = "api" if proc_name.startswith("api") else proc_name
        per[role] = per.get(role, 0.0) + report.us_per_token(ticks1[proc_name] - ticks0[proc_name], clk, tokens)
    per["client"] = 1e6 * load.client_cpu_s / tokens if tokens else 0.0
    delta = report.command_delta(cmds0, cmds1)
    return {"load": summary, "tokens": tokens, "us_per_token": {k: round(v, 1) for k, v in per.items()},
            "redis_cmds": delta, "redis_cmds_per_token": round(sum(delta.values()) / tokens, 3) if tokens else 0.0,
            }, load.spans()


RSINFER_BODY = {"ignore_eos": True}


def versus_transformers(rs_url: str, rs_model: str, model_dir: str, runs: int,
                        load: ChatLoad = ChatLoad(64, 32, OUTPUT_LEN)) -> dict:
    """rsinfer (already up) and `transformers serve --continuous-batching`, each warmed up, then their runs
    interleaved so that load from other processes falls on both alike (each idles near 0% CPU)."""
    why = transformers_available()
    if why:
        say(f"  transformers skipped: {why}")
        return {"skipped": why}
    with transformers_server(model_dir) as tf_url:
        systems = {"rsinfer": (rs_url, rs_model, RSINFER_BODY), "transformers": (tf_url, model_dir, TRANSFORMERS_BODY)}
        for url, model, body in systems.values():
            asyncio.run(openai_load(url, model, ChatLoad(2, 2, 8), body))  # warm-up (transformers: starts batching)
        out: dict[str, list[dict]] = {k: [] for k in systems}
        for i in range(runs):
            for key, (url, model, body) in systems.items():
                s = asyncio.run(openai_load(url, model, load, body))
                out[key].append(s)
                say(f"    run {i + 1}/{runs} {key:>12}: {s['tok_per_s']:,.0f} tok/s, TTFT p50 {s['ttft_p50_ms']:.0f} "
                    f"ms, {s['ok']}/{s['requests']} ok {s['error_counts'] or ''}")
    result = {k: {**sorted(v, key=lambda s: s["tok_per_s"])[len(v) // 2], "runs": v} for k, v in out.items()}
    result["load"] = load._asdict()
    say(f"  rsinfer / transformers: {result['rsinfer']['tok_per_s'] / result['transformers']['tok_per_s']:.2f}x")
    return result


def transformers_available() -> str | None:
    """None if `transformers serve --continuous-batching` can run here, else why not."""
    exe = Path(sys.executable).with_name("transformers")
    if not exe.exists():
        return f"no `transformers` command next to {sys.executable}"
    if importlib.util.find_spec("accelerate") is None:
        return "accelerate is not installed"
    try:
        helptext = subprocess.run([str(exe), "serve", "--help"], capture_output=True, text=True, timeout=120).stdout
    except subprocess.TimeoutExpired:
        return "`transformers serve --help` did not answer"
    if "--continuous-batching" not in helptext:
        return "this transformers has no `serve --continuous-batching`"
    return None


@contextlib.contextmanager
def transformers_server(model_dir: str):
    """`transformers serve --continuous-batching` on a free port, one torch thread; its URL. Stopped (its whole
    process group) however the block ends."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="transformers-serve-", suffix=".log", delete=False)  # noqa: SIM115
    proc = children.spawn([str(Path(sys.executable).with_name("transformers")), "serve", "--continuous-batching",
                           "--host", "127.0.0.1", "--port", str(port), model_dir],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT,
                          start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", proc, 180)
        say(f"  transformers serve up (log {log.name})")
        yield url
    finally:
        with_group(proc, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            with_group(proc, signal.SIGKILL)
            proc.wait()


def with_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} not up in {timeout:.0f}s")


# ---- (d) the synthetic engine


def synthetic_env(max_running: int, **api: str) -> dict[str, dict[str, str]]:
    return {"scheduler": {"RSINFER_ENGINE": "synthetic", "RSINFER_STEP_MS": str(STEP_MS),
                          "RSINFER_MAX_RUNNING": str(max_running)},
            "api": dict(api)}


def ideal(streams: int) -> float:
    return streams * report.IDEAL_STREAM_RATE / STEP_MS


@dataclass(frozen=True)
class Point:
    """One load of the synthetic section: `requests` of `tokens` tokens, `streams` at a time, sent from
    `processes` client processes."""

    streams: int
    requests: int
    tokens: int
    processes: int


def synthetic_point(stack: BenchStack, urls: list[str], name: str, point: Point) -> dict:
    streams, tokens = point.streams, point.tokens
    prompts = id_prompts(point.requests, 11, length=16)
    bodies = [completion_body(name, p, tokens) for p in prompts]
    m, spans = measured_load(stack, urls, bodies, streams, stagger_s=0.002, processes=point.processes)
    steady, window = report.steady_rate(spans, streams)
    s = m["load"]
    return {**s, "concurrency": streams, "api_processes": len(urls), "max_tokens": tokens, "ideal": ideal(streams),
            "steady_tok_per_s": round(steady, 1), "steady_window_s": round(window, 2),
            "peak_open": report.peak_open(spans), "us_per_token": m["us_per_token"],
            "redis_cmds_per_token": m["redis_cmds_per_token"]}


def synthetic_section(target: Target, results: dict) -> None:
    model_dir, name, size = target.model_dir, target.name, target.size
    out = results.setdefault("synthetic", {})
    with BenchStack(model_dir, name, apis=2, env=synthetic_env(512)) as stack:
        say(f"  synthetic stack up, 2 API processes (logs {stack.log_dir})")
        run_load(stack.urls, [completion_body(name, p, 8) for p in id_prompts(16, 2, 16)], 16)  # warm-up
        for key, urls in (("api1", stack.urls[:1]), ("api2", stack.urls)):
            p = synthetic_point(stack, urls, name, Point(512, 512 * size["syn_waves"], size["syn_tokens"], 2))
            out[key] = p
            say(f"    512 streams, {len(urls)} API: {p['steady_tok_per_s']:,.0f} tok/s steady "
                f"({p['steady_tok_per_s'] / p['ideal']:.0%} of {p['ideal']:,.0f}), {p['tok_per_s']:,.0f} overall, "
                f"ITL p99 {p['itl_p99_ms']:.0f} ms, {p['ok']}/{p['requests']} ok")
        sweep = []
        for c in (1, 8, 64, 256, 512):
            p = synthetic_point(stack, stack.urls[:1], name,
                                Point(c, max(2, 2 * c), size["sweep_tokens"], 1 if c < 256 else 2))
            sweep.append(p)
            say(f"    sweep {c:>3} streams: {p['steady_tok_per_s'] or p['tok_per_s']:,.0f} tok/s of "
                f"{p['ideal']:,.0f}, TTFT p50/p99 {p['ttft_p50_ms']:.0f}/{p['ttft_p99_ms']:.0f} ms, "
                f"ITL p50/p99 {p['itl_p50_ms']:.1f}/{p['itl_p99_ms']:.1f} ms")
        out["sweep"] = sweep


# ---- (e) 10,000 streams


def streams_10k_section(target: Target, results: dict, args: argparse.Namespace) -> None:
    model_dir, name, size = target.model_dir, target.name, target.size
    streams, arrival = args.big_streams, args.big_arrival_s
    max_running = args.big_max_running or streams
    limit = raise_fd_limit()
    if limit < streams + 1000:
        results["streams_10k"] = {"skipped": f"open-file limit {limit} is below {streams + 1000}"}
        say(f"  skipped: {results['streams_10k']['skipped']}")
        return
    env = synthetic_env(max_running, RSINFER_MAX_QUEUED=str(2 * streams))
    env["scheduler"]["RSINFER_BATCH_SIZE"] = "512"
    with BenchStack(model_dir, name, env=env) as stack:
        say(f"  synthetic stack up (logs {stack.log_dir}); {streams:,} streams of {size['big_tokens']} tokens opened "
            f"over {arrival:.0f} s, max_running {max_running:,}, 4 client processes")
        api_pid = stack.pids()["api"]
        rss_before = rss_kb(api_pid, "VmRSS")
        bodies = [completion_body(name, p, size["big_tokens"]) for p in id_prompts(streams, 13, length=16)]
        m, spans = measured_load(stack, stack.urls, bodies, streams, stagger_s=arrival / streams, processes=4)
        s = m["load"]
        big = {**s, "requests": streams, "step_ms": STEP_MS, "max_tokens": size["big_tokens"], "arrival_s": arrival,
               "max_running": max_running,
               "peak_open": report.peak_open(spans), "api_rss_before_kb": rss_before,
               "api_rss_peak_kb": rss_kb(api_pid, "VmHWM"), "us_per_token": m["us_per_token"],
               "redis_cmds_per_token": m["redis_cmds_per_token"], "fd_limit": limit}
        results["streams_10k"] = big
        say(f"    {big['ok']:,}/{streams:,} delivered, peak {big['peak_open']:,} open, API RSS peak "
            f"{big['api_rss_peak_kb'] / 1024:,.0f} MB, ITL p50/p99 {big['itl_p50_ms']:.0f}/{big['itl_p99_ms']:.0f} ms, "
            f"{big['tok_per_s']:,.0f} tok/s {big['error_counts'] or ''}")


# ---- (g) prefix-aware routing


def prefix_routing_section(target: Target, results: dict) -> None:
    size = target.size
    args = prefix_routing.parser().parse_args(["--conversations", str(size["conversations"]),
                                               "--repeat", str(size["prefix_repeat"])])
    out = prefix_routing.run(target.model_dir, target.name, args, say=lambda m: say(f"  {m.strip()}"))
    results["prefix_routing"] = out
    prefix_routing.RESULTS.write_text(json.dumps(out, indent=1) + "\n")


def newest_prefix_routing(results: dict) -> None:
    """The prefix section as last measured, by `make bench` or by bench/prefix_routing.py alone."""
    if not prefix_routing.RESULTS.exists():
        return
    alone = json.loads(prefix_routing.RESULTS.read_text())
    mine = results.get("prefix_routing", {})
    if alone.get("meta", {}).get("started_at", "") > mine.get("meta", {}).get("started_at", ""):
        results["prefix_routing"] = alone


# ---- the run


def meta(args: argparse.Namespace, model_dir: str) -> dict:
    cpu_model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results",
                            ":!docs/benchmarks.md"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"started_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "mode": "full" if args.full else "quick",
            "cpus": os.cpu_count(), "cpu_model": cpu_model, "platform": platform.platform(),
            "python": platform.python_version(), "torch": version("torch"), "transformers": version("transformers"),
            "commit": commit.strip() + ("+changes" if dirty else ""), "model": model_dir,
            "loadavg_before": loadavg(), "results_file": _shown(Path(args.out))}


def _shown(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main() -> int:
    args = parse_args()
    out = Path(args.out)
    if args.report_only:
        return report_only(out)
    want = wanted_sections(args)
    size = {**SIZES["full" if args.full else "quick"], "tf_load": args.tf_load}
    raise_fd_limit()
    target = Target(*model_of(args), size)
    results = report.load(out) if args.only and out.exists() else {}
    results["meta"] = {**results.get("meta", {}), **meta(args, target.model_dir)}
    say(f"rsinfer benchmarks, {results['meta']['mode']} mode, sections {', '.join(s for s in SECTIONS if s in want)}; "
        f"{os.cpu_count()} CPUs, load average {results['meta']['loadavg_before']}")
    engine_sections(target, want, results)
    stack_sections(target, want, results, args)
    results["meta"]["loadavg_after"] = loadavg()
    results["meta"]["duration_s"] = round(time.monotonic() - T0, 1)
    write_results(out, results)
    for row in report.rows(results):
        print(f"  {row.figure:70} {row.measured:40} {row.goal:45} {row.verdict}")
    return 0


def report_only(out: Path) -> int:
    results = report.load(out)
    newest_prefix_routing(results)
    report.write_docs(results, DOCS, PLOTS, report.read_history(HISTORY))
    print(f"wrote {DOCS.relative_to(ROOT)} and plots from {_shown(out)}")
    return 0


def wanted_sections(args: argparse.Namespace) -> set[str]:
    want = set(args.only.split(",")) if args.only else set(SECTIONS)
    unknown = want - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    return want


def model_of(args: argparse.Namespace) -> tuple[str, str]:
    """The checkpoint folder and the name it is served as: --model's, or the demo model's."""
    if args.model:
        return args.model, Path(args.model).name
    from shared.demo_model import ensure_demo_model
    from shared.settings import DEMO_MODEL_NAME

    return str(ensure_demo_model()), DEMO_MODEL_NAME


def engine_sections(target: Target, want: set[str], results: dict) -> None:
    """(a) alone when the pipeline does not interleave it, and (c)'s engine alone."""
    if "engine" in want and "pipeline" not in want:  # else interleaved with the pipeline's runs
        say("(a) engine in-process: 64 requests x 64 prompt x 64 out")
        results["engine"] = engine_bench(target.model_dir, 64, 64, target.size["runs"])
        say(f"  engine: {results['engine']['tok_per_s']:,.0f} tok/s")
    if "cpu" in want:
        n = target.size["cpu_requests"]
        say(f"(c) the engine alone on the CPU workload: {n} requests, 64 running")
        alone = engine_bench(target.model_dir, n, 64, 1)
        results["cpu"] = {**results.get("cpu", {}), "engine_alone": alone,
                          "engine_alone_us_per_token": alone["cpu_us_per_token"]}


def stack_sections(target: Target, want: set[str], results: dict, args: argparse.Namespace) -> None:
    """The sections that start stacks of processes, in order."""
    if want & {"pipeline", "cpu", "transformers"}:
        say("(a, b, c, f) the pipeline (paged engine): redis-server, tokenizer, scheduler, detokenizer, API; (a) the "
            "engine in-process between its runs: 64 requests x 64 prompt x 64 out")
        pipeline_sections(target, want, results)
    if "cpu" in want:
        cpu = results["cpu"]
        cpu["scheduler_plumbing"] = round(cpu["us_per_token"]["scheduler"] / cpu["engine_alone_us_per_token"] - 1, 3)
        say(f"  scheduler plumbing over the engine alone: {cpu['scheduler_plumbing']:+.0%}")
    if "merged" in want:
        say(f"(g) the pipeline with merged steps (--stream-interval {MERGED_INTERVAL}): 64 requests x 64 prompt x 64 "
            f"out, then the CPU workload")
        merged_section(target, results)
    if "synthetic" in want:
        say(f"(d) synthetic engine, {STEP_MS:.0f} ms step")
        synthetic_section(target, results)
    if "10k" in want:
        say("(e) 10,000 streams on one API process (synthetic engine)")
        streams_10k_section(target, results, args)
    if "prefix" in want:
        say("(g) prefix-aware routing vs the shared stream, 2 and 4 schedulers (bench/prefix_routing.py)")
        prefix_routing_section(target, results)
    else:
        newest_prefix_routing(results)
    mode = "full" if args.full else "quick"
    if "gpurate" in want:
        say(f"(h) GPU step rate: synthetic engine, {gpurate.STEP_MS:.0f} ms step, {gpurate.STREAMS} streams of "
            f"{gpurate.TOKENS} tokens, one API process")
        results["gpurate"] = gpurate.section(target.model_dir, target.name, mode, say, measured_load)
    if "slo" in want:
        say(f"(j) SLO-aware admission: {slo_goodput.FLOOD} requests queued, probes with a {slo_goodput.TTFT_MS} ms "
            "TTFT target (bench/slo_goodput.py)")
        results["slo"] = slo_goodput.section(target.model_dir, target.name, say)
    if "guidellm" in want:
        say("(i) guidellm sweeps: rsinfer (paged engine) and transformers serve --continuous-batching")
        results["guidellm"] = guidellm_sweep.section(target, mode, say, (transformers_available, transformers_server))


def write_results(out: Path, results: dict) -> None:
    """The results file; for the committed one, its history line, docs/benchmarks.md and the plots too."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    if out.resolve() == RESULTS.resolve():  # the committed page follows the committed results only
        with HISTORY.open("a") as f:
            f.write(json.dumps(report.headline(results)) + "\n")
        report.write_docs(results, DOCS, PLOTS, report.read_history(HISTORY))
        say(f"wrote {_shown(out)}, {DOCS.relative_to(ROOT)} and plots in {PLOTS.relative_to(ROOT)}")
    else:
        say(f"wrote {_shown(out)} (docs/benchmarks.md follows {_shown(RESULTS)} only)")


if __name__ == "__main__":
    sys.exit(main())
