"""`make bench` section `guidellm`: the field's load tool against rsinfer and `transformers serve` (issue 34).

guidellm (the `bench` extra) runs the same sweep against both servers through their openai-compatible chat
endpoint: a synchronous step, a throughput step, then constant rates between the two, each step bounded by a
max duration, on the same synthetic prompts (the demo model's tokenizer as processor). Its JSON report gives,
per step, request throughput, output tok/s, TTFT and ITL percentiles; `parse` keeps those. guidellm runs as a
command (`guidellm run`), so this module imports without it and the section says it is skipped when it is
missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.harness import TRANSFORMERS_BODY, BenchStack, ChatLoad, completion_body, openai_load, run_load

PROMPT_TOKENS, OUTPUT_TOKENS = 64, 64
# The throughput step's concurrency, as the `transformers` section's: at 64, transformers serve on one thread
# finishes few 64-token answers within a quick step
MAX_CONCURRENCY = 32
SIZES = {"quick": {"sweep_size": 4, "step_s": 6}, "full": {"sweep_size": 8, "step_s": 20}}
ENDPOINT = "/v1/chat/completions"  # transformers serve has no /v1/completions
# Every answer OUTPUT_TOKENS long, greedy. guidellm adds `ignore_eos` (and `stop`) to a request only when its
# data sets output tokens, and transformers serve answers 422 to a field it does not know: so the data leaves
# them out, the backend's max_tokens caps each answer, and each server gets its own way of ignoring EOS
# (transformers serve: harness.TRANSFORMERS_BODY, as the `transformers` section sends).
RSINFER_BODY = {"ignore_eos": True, "temperature": 0}
Say = Callable[[str], None]


def executable() -> Path | None:
    """The `guidellm` command next to this Python, or on the PATH; None if it is not installed."""
    here = Path(sys.executable).with_name("guidellm")
    if here.exists():
        return here
    found = shutil.which("guidellm")
    return Path(found) if found else None


@dataclass(frozen=True)
class Server:
    """What guidellm is pointed at: a base URL, the model name it serves, and fields every request adds."""

    url: str
    model: str
    extra_body: dict | None = None


def command(exe: Path, server: Server, processor: str, out: Path, size: dict) -> list[str]:
    """`guidellm run` of one sweep against `server`, its JSON report written to `out`."""
    backend = {"kind": "openai_http", "target": server.url, "model": server.model, "request_format": ENDPOINT,
               "max_tokens": OUTPUT_TOKENS, "timeout": 120}
    if server.extra_body:
        backend["extras"] = {"body": server.extra_body}
    profile = {"kind": "sweep", "sweep_size": size["sweep_size"], "max_concurrency": MAX_CONCURRENCY}
    data = {"kind": "synthetic_text", "prompt_tokens": PROMPT_TOKENS}
    return [str(exe), "run", "--backend", json.dumps(backend), "--profile", json.dumps(profile),
            "--data", json.dumps(data), "--constraint", json.dumps({"kind": "max_duration", "seconds": size["step_s"]}),
            "--tokenizer", json.dumps({"kind": "huggingface_auto", "model": processor}),
            "--output", json.dumps({"kind": "json", "path": str(out)}), "--disable-progress"]


# ---- the report


def _pct(metric: dict, key: str) -> float | None:
    v = (metric or {}).get("successful", {}).get("percentiles", {}).get(key)
    return None if v is None else round(v, 2)


def _mean(metric: dict) -> float | None:
    v = (metric or {}).get("successful", {}).get("mean")
    return None if v is None else round(v, 2)


def step_name(strategy: dict) -> str:
    kind = strategy.get("type_", "?")
    if kind in ("constant", "poisson") and strategy.get("rate") is not None:
        return f"{kind}@{strategy['rate']:.2f}/s"
    if kind == "concurrent" and strategy.get("streams") is not None:
        return f"concurrent@{strategy['streams']}"
    if kind == "throughput" and strategy.get("max_concurrency") is not None:
        return f"throughput@{strategy['max_concurrency']}"
    return kind


def parse(report: dict) -> list[dict]:
    """One row per benchmark (sweep step) of a guidellm JSON report, in the order run: request and output
    token throughput (successful requests), concurrency, TTFT and ITL p50/p99 in ms, request counts."""
    steps = []
    for b in report.get("benchmarks", []):
        strategy, m = b.get("config", {}).get("strategy", {}), b.get("metrics", {})
        totals = m.get("request_totals", {})
        steps.append({"step": step_name(strategy), "strategy": strategy.get("type_"), "rate": strategy.get("rate"),
                      "duration_s": round(b.get("duration", 0.0), 2),
                      "requests_per_s": _mean(m.get("requests_per_second")),
                      "output_tok_per_s": _mean(m.get("output_tokens_per_second")),
                      "concurrency_p50": _pct(m.get("request_concurrency"), "p50"),
                      "ttft_p50_ms": _pct(m.get("time_to_first_token_ms"), "p50"),
                      "ttft_p99_ms": _pct(m.get("time_to_first_token_ms"), "p99"),
                      "itl_p50_ms": _pct(m.get("inter_token_latency_ms"), "p50"),
                      "itl_p99_ms": _pct(m.get("inter_token_latency_ms"), "p99"),
                      "successful": totals.get("successful", 0), "errored": totals.get("errored", 0),
                      "incomplete": totals.get("incomplete", 0)})
    return steps


def sweep(exe: Path, server: Server, processor: str, size: dict) -> dict:
    """One guidellm sweep against `server`: its steps parsed, or why it failed (the tail of its output)."""
    with tempfile.TemporaryDirectory(prefix="guidellm-") as tmp:
        out = Path(tmp) / "report.json"
        env = {**os.environ, "GUIDELLM__MAX_WORKER_PROCESSES": str(max(1, os.cpu_count() or 1))}
        limit = 180 + 4 * size["sweep_size"] * size["step_s"]
        try:
            proc = subprocess.run(command(exe, server, processor, out, size), capture_output=True, text=True, env=env,
                                  cwd=tmp, timeout=limit)
        except subprocess.TimeoutExpired:
            return {"error": f"guidellm did not finish in {limit} s"}
        if proc.returncode or not out.exists():
            return {"error": f"guidellm exited {proc.returncode}: {(proc.stdout + proc.stderr)[-600:]}"}
        report = json.loads(out.read_text())
    return {"guidellm": report.get("metadata", {}).get("guidellm_version"), "steps": parse(report)}


# ---- the section


def section(target, mode: str, say: Say, transformers: tuple[Callable, Callable]) -> dict:
    """The sweep against rsinfer (a stack of the paged engine), then against `transformers serve
    --continuous-batching` where it can run. `target`: bench/run_all.py's Target; `transformers`: its
    (transformers_available, transformers_server)."""
    exe = executable()
    if exe is None:
        why = "guidellm is not installed (pip install -e '.[bench]')"
        say(f"  guidellm skipped: {why}")
        return {"skipped": why}
    size = SIZES[mode]
    out: dict = {"config": {"prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS, "endpoint": ENDPOINT,
                            "max_concurrency": MAX_CONCURRENCY, **size}}
    with BenchStack(target.model_dir, target.name) as stack:
        say(f"  rsinfer stack up (logs {stack.log_dir}); guidellm sweep, {size['sweep_size']} steps of "
            f"{size['step_s']} s")
        run_load(stack.urls, [completion_body(target.name, [20 + i] * 16, 8) for i in range(8)], 8)  # warm-up
        out["rsinfer"] = sweep(exe, Server(stack.urls[0], target.name, RSINFER_BODY), target.model_dir, size)
    _say_steps(say, "rsinfer", out["rsinfer"])
    available, server = transformers
    why = available()
    if why:
        say(f"  transformers skipped: {why}")
        out["transformers"] = {"skipped": why}
        return out
    try:
        with server(target.model_dir) as tf_url:
            _warm_transformers(tf_url, target.model_dir)
            out["transformers"] = sweep(exe, Server(tf_url, target.model_dir, TRANSFORMERS_BODY), target.model_dir,
                                        size)
    except (RuntimeError, TimeoutError) as e:  # it did not come up: the rsinfer sweep still stands
        out["transformers"] = {"error": f"transformers serve: {e}"}
    _say_steps(say, "transformers", out["transformers"])
    return out


def _warm_transformers(url: str, model: str) -> None:
    """One request through transformers serve first: it loads the model and starts its batching loop lazily."""
    with contextlib.suppress(Exception):
        asyncio.run(openai_load(url, model, ChatLoad(2, 2, 8), TRANSFORMERS_BODY))


def _say_steps(say: Say, server: str, res: dict) -> None:
    if "error" in res:
        say(f"    {server}: {res['error']}")
        return
    for s in res["steps"]:
        say(f"    {server} {s['step']:>22}: {s['requests_per_s'] or 0:6.2f} req/s, {s['output_tok_per_s'] or 0:7,.0f} "
            f"out tok/s, TTFT p50/p99 {s['ttft_p50_ms'] or 0:,.0f}/{s['ttft_p99_ms'] or 0:,.0f} ms, ITL p50/p99 "
            f"{s['itl_p50_ms'] or 0:.1f}/{s['itl_p99_ms'] or 0:.1f} ms, {s['successful']} ok, {s['errored']} errors")
