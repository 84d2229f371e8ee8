"""Poison schedule entries: a job the engine raises on fails alone (its client gets a 500 at once, the scheduler
serves on), and one that kills every scheduler that takes it is dead-lettered after --max-deliveries, its client
answered at once, instead of a pool that crash-loops on it while the client waits for its deadline.

The schedulers run tests/support/poison_scheduler.py: the real scheduler, whose engine fails on one seed."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.helpers import live_names, wait_for
from tests.support.stack import LIFECYCLE_ENV, MODEL, Stack, new_stack

pytestmark = pytest.mark.timeout(240)
RAISE_SEED, EXIT_SEED = 424242, 737373
ENV = {**LIFECYCLE_ENV, "POISON_RAISE_SEED": str(RAISE_SEED), "POISON_EXIT_SEED": str(EXIT_SEED),
       "RSINFER_MAX_DELIVERIES": "2"}


@pytest.fixture(scope="module")
def poisoned(redis_server, demo_model_dir, tmp_path_factory) -> Iterator[Stack]:
    s = new_stack(redis_server, demo_model_dir, tmp_path_factory, "poison")
    try:
        for role in ("tokenizer", "detokenizer", "api"):
            s.start(f"{role}1", role, **ENV)
        s.start("scheduler1", "scheduler", module="tests.support.poison_scheduler", **ENV)
        s.wait_ready()
        yield s
    finally:
        s.stop()


def complete(s: Stack, seed: int | None = None, timeout: float = 30) -> httpx.Response:
    body = {"model": MODEL, "prompt": "poison", "max_tokens": 8, "temperature": 0, "timeout": timeout}
    if seed is not None:
        body["seed"] = seed
    return httpx.post(f"{s.base_url}/v1/completions", json=body, timeout=timeout + 30)


def test_a_job_the_engine_raises_on_fails_alone_and_the_scheduler_serves_on(poisoned):
    s = poisoned
    pid = s.procs["scheduler1"].pid
    began = time.monotonic()
    resp = complete(s, RAISE_SEED)
    assert resp.status_code == 500, resp.text
    assert "could not start the request" in resp.json()["error"]["message"]
    assert time.monotonic() - began < 10  # at once, not at the deadline (30 s)
    assert complete(s).status_code == 200  # the same scheduler serves the next request
    assert s.procs["scheduler1"].poll() is None and s.procs["scheduler1"].pid == pid


def test_a_job_that_kills_each_scheduler_is_dead_lettered_and_its_client_answered(poisoned):
    s = poisoned
    s.start("scheduler2", "scheduler", module="tests.support.poison_scheduler", **ENV)
    wait_for(lambda: len(live_names(s, "scheduler")) == 2, timeout=90)
    result: dict = {}

    def poison() -> None:
        result["resp"] = complete(s, EXIT_SEED, timeout=120)

    client = threading.Thread(target=poison)
    client.start()
    # whichever scheduler reads it dies (delivery 1); its peer claims it and dies too (2)
    wait_for(lambda: all(p.poll() is not None for n, p in s.procs.items() if n.startswith("scheduler")), timeout=60)
    assert {p.returncode for n, p in s.procs.items() if n.startswith("scheduler")} == {70}
    s.start("scheduler3", "scheduler", module="tests.support.poison_scheduler", **ENV)  # a restart, as Kubernetes does
    started = time.monotonic()
    client.join(60)
    resp = result["resp"]
    assert resp.status_code == 500 and resp.json()["error"]["code"] == "request_dead_lettered", resp.text
    assert time.monotonic() - started < 60  # once a scheduler is back, not at the deadline (120 s)
    r = s.redis()
    dead = [f for _, f in r.xrange(s.keys.dead()) if f.get("stream") == s.keys.schedule(MODEL)]
    assert dead and "delivered 3 times" in dead[-1]["error"]
    assert s.procs["scheduler3"].poll() is None  # it did not run it
    assert complete(s).status_code == 200
