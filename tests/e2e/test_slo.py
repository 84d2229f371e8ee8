"""SLO-aware admission (issue 35, item 4; services/api/answer/slo.py) under a flood: a request with
`x-slo-ttft-ms: 1500` behind 40 queued requests gets its first token within twice its target, or a 503 at once, never
a late answer; the goodput counters in /metrics say which.

One stack for the module: a tokenizer, a scheduler on the synthetic engine (50 ms steps, 8 requests at a time, so 40
requests of 30 tokens queue for ~7 s) and a detokenizer; two API processes: `api1` in open mode (no fair queueing:
the flood is ahead of everything, so an SLO request is refused at once) and `api2` with keys (the tokenizer's fair
lanes put a tenant's SLO request before its own flood, earliest deadline first, so it is served in time).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from rsinfer.launcher import api_ready
from rsinfer.redis_server import free_port
from tests.support.helpers import async_wait_for
from tests.support.stack import LIFECYCLE_ENV, MODEL, Stack, new_stack

pytestmark = pytest.mark.timeout(120)
A_KEY, OPS_KEY = "sk-slo-team-a-" + "0" * 24, "sk-slo-ops-" + "0" * 24
FLOOD, FLOOD_TOKENS = 40, 30  # 1.5 s each at 50 ms a step, 8 at a time: ~7.5 s to drain
TTFT_MS = 1500
ENV = {**LIFECYCLE_ENV, "RSINFER_ENGINE": "synthetic", "RSINFER_STEP_MS": "50", "RSINFER_MAX_RUNNING": "8",
       "RSINFER_FAIR_WATERMARK": "1"}


@pytest.fixture(scope="module")
def slo(redis_server, demo_model_dir, tmp_path_factory) -> Iterator[tuple[Stack, str, str]]:
    s = new_stack(redis_server, demo_model_dir, tmp_path_factory, "slo")
    keys_file = s.log_dir / "api-keys.json"
    keys_file.write_text(json.dumps([{"key": A_KEY, "tenant": "team-a"},
                                     {"key": OPS_KEY, "tenant": "ops", "admin": True}]))
    try:
        for role in ("tokenizer", "scheduler", "detokenizer"):
            s.start(f"{role}1", role, **ENV)
        s.start("api1", "api", **ENV)
        keyed = free_port()
        s.start("api2", "api", **ENV, RSINFER_PORT=str(keyed), RSINFER_API_KEYS_FILE=str(keys_file))
        s.wait_ready()
        s.wait_until(lambda: api_ready(f"http://127.0.0.1:{keyed}"), 60, "api2")
        yield s, s.base_url, f"http://127.0.0.1:{keyed}"
    finally:
        s.stop()


def body(max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, **extra}


def queued(s: Stack) -> int:
    return s.redis().zcard(s.keys.queued(MODEL))


@contextlib.asynccontextmanager
async def flooded(s: Stack, client: httpx.AsyncClient) -> AsyncIterator[None]:
    """40 requests queued through `client`; once one has finished (the API measured a request's service time) with
    most still queued, the block runs; then they are dropped (their client gone: aborted) and the queue drains."""
    flood = [asyncio.create_task(client.post("/v1/completions", json=body(FLOOD_TOKENS))) for _ in range(FLOOD)]
    try:
        await async_wait_for(lambda: any(t.done() for t in flood), timeout=60, every=0.05)
        assert queued(s) >= FLOOD // 2
        yield
    finally:
        for t in flood:
            t.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        await async_wait_for(lambda: queued(s) == 0, timeout=30, every=0.1)


def slo_count(base: str, outcome: str, key: str | None = None) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10, headers={"Authorization": f"Bearer {key}"} if key else {}).text
    found = re.search(rf'rsinfer_slo_requests_total{{model="{MODEL}",outcome="{outcome}"}} ([0-9.]+)', text)
    return float(found.group(1)) if found else 0.0


async def test_without_fair_lanes_an_slo_request_behind_the_flood_is_refused_at_once(slo):
    s, base, _ = slo
    async with httpx.AsyncClient(base_url=base, timeout=60) as client, flooded(s, client):
        for headers, extra in (({"x-slo-ttft-ms": str(TTFT_MS)}, {}), ({"x-llm-d-slo-ttft-ms": str(TTFT_MS)}, {}),
                               ({}, {"slo": {"ttft_ms": TTFT_MS}})):
            sent = time.monotonic()
            resp = await client.post("/v1/completions", json=body(4, **extra), headers=headers)
            took = time.monotonic() - sent
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"]["code"] == "slo_unattainable" and int(resp.headers["retry-after"]) >= 1
            assert took < 2 * TTFT_MS / 1000, "at once, not after waiting its turn"
        for header in ("x-slo-ttft-ms", "x-llm-d-slo-tpot-ms"):
            resp = await client.post("/v1/completions", json=body(4), headers={header: "0"})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == header, resp.text
        resp = await client.post("/v1/completions", json=body(4, slo={"ttft_ms": -1}))
        assert resp.status_code == 400 and "slo" in resp.json()["error"]["param"], resp.text
    assert slo_count(base, "refused") == 3


async def first_token_s(client: httpx.AsyncClient, headers: dict) -> tuple[float, str]:
    """A streamed request's time to its first token, and its uid."""
    sent, first = time.monotonic(), None
    async with client.stream("POST", "/v1/completions", json=body(4, stream=True), headers=headers) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():  # read to its end, so that it finished before the metrics are read
            if line.startswith("data: {") and first is None:
                first = (time.monotonic() - sent, json.loads(line[6:])["id"].removeprefix("cmpl-"))
    assert first is not None, "no token"
    return first


async def test_in_its_fair_lane_an_slo_request_goes_before_its_tenants_flood_and_meets_its_target(slo):
    s, _, keyed = slo
    auth = {"Authorization": f"Bearer {A_KEY}"}
    async with httpx.AsyncClient(base_url=keyed, timeout=60, headers=auth) as client, flooded(s, client):
        took, uid = await first_token_s(client, {"x-slo-ttft-ms": str(TTFT_MS), "x-slo-tpot-ms": "1000"})
        assert took < 2 * TTFT_MS / 1000, f"first token after {took:.2f}s behind {FLOOD} queued"
        print(f"\nan SLO request's first token behind {FLOOD} queued of its own tenant: {took:.2f}s")
    # what its job carried to the stages (the TPOT target is recorded with it)
    job = next(json.loads(f["data"]) for _, f in s.redis().xrange(s.keys.tokenize(MODEL)) if uid in f["data"])
    assert (job["slo_ttft_ms"], job["slo_tpot_ms"], job["tenant"]) == (TTFT_MS, 1000, "team-a")
    assert slo_count(keyed, "met", OPS_KEY) == 1 and slo_count(keyed, "missed", OPS_KEY) == 0
