"""`make bench` section `slo`: SLO-aware admission under a flood (issue 35, item 4; services/api/answer/slo.py).

    python bench/slo_goodput.py            # the section alone: prints its figures and writes bench/results/slo.json

A scheduler on the synthetic engine (50 ms steps, 8 requests at a time) gets a flood of 40 requests of 30 tokens
(1.5 s each: ~7.5 s of queue). Once one of them finished (the API has measured a request's service time), 10 probe
requests of 4 tokens are sent 0.3 s apart, each with a time-to-first-token target of 1,500 ms, in three scenarios:

- `no target`: the probes send no SLO header, as every request did before: they wait their turn behind the flood
  (what the target would have judged: late);
- `fifo`: `x-slo-ttft-ms: 1500` on an API in open mode (no fair lanes: the flood is ahead of every probe): refused at
  once with a 503 when they cannot start in time;
- `lanes`: the same header on an API with keys (one tenant sends the flood and the probes): the tokenizer's fair lane
  puts each probe before its tenant's flood, earliest deadline first, so they are served in time.

Per scenario: probes met (first token within the target, finished), late (first token past it), refused at once,
ended for missing it (`slo_missed`), their TTFT p50 and max, how long a refusal took, and the goodput (probes that
met their target per second of the probing window) with the API's `rsinfer_slo_requests_total` counters.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import BenchStack  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "slo.json"
STEP_MS, MAX_RUNNING = 50, 8
FLOOD, FLOOD_TOKENS = 40, 30
PROBES, PROBE_TOKENS, PROBE_EVERY_S = 10, 4, 0.3
TTFT_MS = 1500
KEY = "sk-bench-slo-" + "0" * 24
SCENARIOS = ("no target", "fifo", "lanes")
Say = Callable[[str], None]


def env(keys_file: str | None) -> dict[str, dict[str, str]]:
    engine = {"RSINFER_ENGINE": "synthetic", "RSINFER_STEP_MS": str(STEP_MS), "RSINFER_MAX_RUNNING": str(MAX_RUNNING),
              "RSINFER_HEARTBEAT_INTERVAL_S": "0.5"}
    api = {"RSINFER_API_KEYS_FILE": keys_file} if keys_file else {}
    return {"scheduler": engine, "tokenizer": {"RSINFER_FAIR_WATERMARK": "1"}, "api": api}


def body(name: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": name, "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


async def probe(client: httpx.AsyncClient, name: str, headers: dict) -> dict:
    """One streamed probe: its status, error code, TTFT (s) and how long it took in all."""
    sent, first, code = time.monotonic(), None, None
    async with client.stream("POST", "/v1/completions", json=body(name, PROBE_TOKENS, True), headers=headers) as resp:
        if resp.status_code != 200:
            code = json.loads(await resp.aread())["error"].get("code")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                code = chunk["error"].get("code")
            elif first is None:
                first = time.monotonic() - sent
    return {"status": resp.status_code, "code": code, "ttft_s": first, "took_s": time.monotonic() - sent}


async def scenario(url: str, name: str, headers: dict, auth: dict) -> dict:
    """The flood, then the probes once a flood request finished; the flood is dropped at the end."""
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=auth,
                                 limits=httpx.Limits(max_connections=FLOOD + PROBES + 4)) as client:
        flood = [asyncio.create_task(client.post("/v1/completions", json=body(name, FLOOD_TOKENS)))
                 for _ in range(FLOOD)]
        try:
            await asyncio.wait(flood, return_when=asyncio.FIRST_COMPLETED)  # the API measured a service time
            started = time.monotonic()
            probes = []
            for _ in range(PROBES):
                probes.append(asyncio.create_task(probe(client, name, headers)))
                await asyncio.sleep(PROBE_EVERY_S)
            got = await asyncio.gather(*probes)
            window = time.monotonic() - started
        finally:
            for t in flood:
                t.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
        metrics = (await client.get("/metrics")).text
    return figures(got, window, metrics)


def figures(got: list[dict], window: float, metrics: str) -> dict:
    target = TTFT_MS / 1000
    ttfts = [g["ttft_s"] for g in got if g["ttft_s"] is not None]
    met = sum(1 for g in got if g["status"] == 200 and g["code"] is None and g["ttft_s"] is not None
              and g["ttft_s"] <= target)
    refusals = [g["took_s"] for g in got if g["code"] == "slo_unattainable"]
    counters = {o: _counter(metrics, o) for o in ("met", "missed", "refused")}
    return {"probes": len(got), "met": met, "late": sum(1 for t in ttfts if t > target), "refused": len(refusals),
            "ended_missed": sum(1 for g in got if g["code"] == "slo_missed"),
            "ttft_p50_ms": round(statistics.median(ttfts) * 1000) if ttfts else None,
            "ttft_max_ms": round(max(ttfts) * 1000) if ttfts else None,
            "refusal_p50_ms": round(statistics.median(refusals) * 1000) if refusals else None,
            "goodput_per_s": round(met / window, 2), "window_s": round(window, 2), "counters": counters}


def _counter(metrics: str, outcome: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("rsinfer_slo_requests_total{") and f'outcome="{outcome}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def section(model_dir: str, name: str, say: Say = print) -> dict:
    """The three scenarios (module doc), each on a fresh stack; the section's figures."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out: dict = {"measured": f"{when}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
                 "step_ms": STEP_MS, "max_running": MAX_RUNNING, "flood": FLOOD, "flood_tokens": FLOOD_TOKENS,
                 "probes": PROBES, "probe_every_s": PROBE_EVERY_S, "ttft_ms": TTFT_MS, "scenarios": {}}
    with tempfile.TemporaryDirectory() as tmp:
        keys_file = Path(tmp) / "keys.json"
        keys_file.write_text(json.dumps([{"key": KEY, "tenant": "bench", "admin": True}]))
        for label in SCENARIOS:
            keyed = label == "lanes"
            stack = BenchStack(model_dir, name, env=env(str(keys_file) if keyed else None))
            stack.api_key = KEY if keyed else None
            headers = {} if label == "no target" else {"x-slo-ttft-ms": str(TTFT_MS)}
            auth = {"Authorization": f"Bearer {KEY}"} if keyed else {}
            with stack:
                got = asyncio.run(scenario(stack.urls[0], name, headers, auth))
            out["scenarios"][label] = got
            say(f"  {label:9}: met {got['met']}/{got['probes']}, late {got['late']}, refused {got['refused']} "
                f"(in {got['refusal_p50_ms']} ms p50), ended {got['ended_missed']}; TTFT p50 {got['ttft_p50_ms']} ms, "
                f"max {got['ttft_max_ms']} ms; goodput {got['goodput_per_s']}/s; /metrics {got['counters']}")
    return out


def main() -> int:
    from shared.demo_model import ensure_demo_model
    from shared.settings import DEMO_MODEL_NAME

    print(f"SLO admission: {FLOOD} requests of {FLOOD_TOKENS} tokens queued ({STEP_MS} ms steps, {MAX_RUNNING} at a "
          f"time), then {PROBES} probes with a {TTFT_MS} ms TTFT target")
    out = section(str(ensure_demo_model()), DEMO_MODEL_NAME)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
