"""rsinfer on a Redis Cluster: 3 primaries and 3 replicas, real redis-server processes on free ports.

The core of the end-to-end suite runs here unchanged (the same test functions, imported, with this module's
cluster stack as their `stack`, `pipeline` and `blip_api`): the openai client streaming and not, 32 concurrent
streams equal to solo runs, an operator's abort, a reattach with Last-Event-ID on the other API process, a
scheduler killed with a peer. Then the operator's `redis-cli -c` recipes, the keys of the run spread over every
primary, and a primary killed (kill -9) under load: its replica takes over, every request completes with its
undisturbed text or ends with an error event, none outlives its deadline, and new requests are served after.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from rsinfer.launcher import api_ready
from rsinfer.redis_server import free_port
from tests.e2e import test_concurrency, test_crash, test_openai_api, test_operator, test_resume
from tests.e2e.test_operator import LongStream
from tests.support.helpers import engines_idle, wait_for
from tests.support.redis_cluster import LocalCluster
from tests.support.stack import MODEL, Stack, start_pipeline
from tests.support.streaming import Streamer, body, reference

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]  # `make test-fast` leaves it out
# Heartbeats outlive a failover (about 3 s with a 2 s node timeout), else schedulers would take the requests of an
# API process whose heartbeat lapsed during it for orphans (docs/design.md, "Redis Cluster").
CLUSTER_ENV = {"RSINFER_HEARTBEAT_TTL_S": "6"}
DEADLINE_S = 60


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """A cluster of this module's own: its last test kills one of its primaries."""
    with LocalCluster(primaries=3, node_timeout_ms=2000) as c:
        yield c


@pytest.fixture(scope="module")
def cluster_stack(cluster, random_model_dir, tmp_path_factory) -> Iterator[Stack]:
    """A tokenizer, scheduler, detokenizer and API, each its own process, on the cluster (they find out by
    themselves that it is one), serving the demo checkpoint's random twin (tests/conftest.py), as the imported
    tests of long greedy streams that differ by prompt want."""
    s = Stack(cluster.url, random_model_dir, "clu", tmp_path_factory.mktemp("logs-cluster"), cluster=True)
    try:
        yield start_pipeline(s, **CLUSTER_ENV)
    finally:
        s.stop()


@pytest.fixture(scope="module")
def stack(cluster_stack) -> Stack:
    return cluster_stack


@pytest.fixture(scope="module")
def pipeline(cluster_stack) -> Stack:
    return cluster_stack


@pytest.fixture(scope="module")
def blip_api(cluster_stack) -> Iterator[Stack]:
    """A second API process (short pings, a resume window): the one a client reattaches away from."""
    s = Stack(cluster_stack.redis_url, cluster_stack.model_dir, cluster_stack.namespace, cluster_stack.log_dir,
              cluster=True)
    s.port = free_port()
    try:
        s.start("api-blip", "api", RSINFER_SSE_PING_S=str(test_resume.PING_S),
                RSINFER_RESUME_WINDOW_S=str(test_resume.WINDOW_S), **CLUSTER_ENV)
        wait_for(lambda: api_ready(s.base_url), timeout=60)
        yield s
    finally:
        s.stop()


# -- the core of the end-to-end suite, as on a standalone Redis ------------------------------------------------


def test_openai_client_non_stream(stack):
    test_openai_api.test_chat_non_stream_has_usage_and_length_finish(stack)


def test_openai_client_stream(stack):
    test_openai_api.test_chat_stream_matches_non_stream(stack)
    test_openai_api.test_completions_stream_and_not(stack)


async def test_32_concurrent_streams_equal_solo_runs(stack):
    await test_concurrency.test_concurrent_streams_equal_solo_runs(stack)


def test_operator_finds_reads_and_cancels_a_request(stack):
    test_operator.test_operator_can_find_read_and_cancel_a_request(stack)


def test_reattach_with_last_event_id_on_the_other_api_process(stack, blip_api):
    test_resume.test_reattach_within_the_window_gets_exactly_the_rest(stack, blip_api)


def test_scheduler_killed_with_a_peer(pipeline, monkeypatch):
    monkeypatch.setitem(test_crash.LIFECYCLE_ENV, "RSINFER_HEARTBEAT_TTL_S", CLUSTER_ENV["RSINFER_HEARTBEAT_TTL_S"])
    test_crash.test_scheduler_killed_mid_generation_is_resumed_by_a_peer(pipeline)


# -- what only a cluster has ------------------------------------------------------------------------------------


def redis_cli(cluster: LocalCluster, *args: str) -> str:
    out = subprocess.run([cluster.cli, "-c", "-p", str(cluster.ports[0]), *args], capture_output=True, text=True,
                         timeout=10, check=True)
    return out.stdout


def test_the_operator_recipes_work_with_redis_cli_c(stack, cluster):
    """The recipes of docs/operator-guide.md with `-c` (follow redirections): read a running request and cancel
    it."""
    k = stack.keys
    run = LongStream(stack)
    uid = run.uid
    assert "running" in redis_cli(cluster, "HGETALL", k.request(uid))
    assert '"kind":"delta"' in redis_cli(cluster, "XRANGE", k.reply(uid), "-", "+", "COUNT", "3")
    assert "scheduler" in redis_cli(cluster, "XINFO", "GROUPS", k.schedule(MODEL))
    assert redis_cli(cluster, "SET", k.abort(uid), "admin", "EX", "300").strip() == "OK"
    assert run.wait() < 5
    assert run.finish == "abort"
    assert "aborted" in redis_cli(cluster, "HGET", k.request(uid), "status")


def test_the_keys_of_the_run_are_spread_over_every_primary(stack, cluster):
    """Counted on each primary: the stage streams spread by their names, and each API process's requests over
    its hub shards, one per primary."""
    ns = stack.namespace
    counts = {}
    for node in cluster.nodes():
        if node["role"] == "master" and node["slots"]:
            with redis.Redis(port=node["port"], decode_responses=True) as r:
                keys = list(r.scan_iter(match=f"{ns}:*", count=1000))
            counts[node["port"]] = (len(keys), sum(key.startswith(f"{ns}:req:") for key in keys))
    print(f"keys (all, request records) per primary: {counts}")
    assert len(counts) == 3
    assert all(records > 0 for _, records in counts.values()), counts


def test_a_primary_killed_under_load_fails_over(stack, cluster):
    """kill -9 of the primary that holds the busiest stage stream (detokenize: one entry per engine step) during
    32 concurrent generations; its replica is promoted and every process finds it by itself. The pause clients
    see is the cluster's failover, give or take the processes' retry intervals."""
    s = stack
    bodies = [body(i, 200, timeout=DEADLINE_S) for i in range(100, 132)]
    expected = reference(s, bodies)
    runs = [Streamer(s.base_url, b) for b in bodies]
    wait_for(lambda: all(len(r.text) > 5 for r in runs), timeout=30)
    victim = cluster.primary_of(s.keys.detokenize(MODEL))
    failover = cluster.fail_over(victim)
    killed = failover.killed
    probes = []  # new requests sent during the failover, one after another: (sent, status, seconds taken)
    while time.monotonic() - killed < 30:
        sent = time.monotonic()
        resp = httpx.post(f"{s.base_url}/v1/chat/completions", json=body(200, 4, timeout=DEADLINE_S), timeout=90)
        probes.append((sent - killed, resp.status_code, time.monotonic() - sent))
        if resp.status_code == 200:
            break
        time.sleep(0.1)
    failover_s = failover.seconds(30)
    assert failover_s is not None, "the cluster did not recover"

    for r in runs:
        r.join(max(0.0, killed + DEADLINE_S + 5 - time.monotonic()))
    assert not any(r.is_alive() for r in runs), "a request outlived its deadline"
    completed = [r for r, want in zip(runs, expected, strict=True)
                 if r.error is None and r.finish == "length" and r.text == want]
    failed = [r for r in runs if r.error is not None]
    assert len(completed) + len(failed) == len(runs), [(r.finish, r.error) for r in runs]
    served = next(sent + took for sent, status, took in probes if status == 200)
    pause = max(r.longest_gap() for r in completed) if completed else 0.0
    print(f"failover: cluster healthy {failover_s:.1f} s after the kill; {len(completed)} of {len(runs)} streams "
          f"completed unchanged, {len(failed)} ended with an error event; longest pause in a stream {pause:.1f} s; "
          f"a new request served {served:.1f} s after the kill ({len(probes)} sent)")
    assert pause < failover_s + 4 and served < failover_s + 4

    new = httpx.post(f"{s.base_url}/v1/chat/completions", json=bodies[0], timeout=60)
    assert new.status_code == 200 and new.json()["choices"][0]["message"]["content"] == expected[0]
    wait_for(lambda: engines_idle(s), timeout=20)
