"""Slow clients, admission control, and a soak of a few hundred requests that end every possible way,
after which every process-side count is zero, every KV page is free, and (after the TTL) no
per-request key is left in Redis."""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time
from collections import Counter

import httpx
import pytest

from tests.support.helpers import engines_idle, raw_post, wait_for, workers
from tests.support.stack import MODEL, running_pipeline
from tests.support.streaming import Streamer, body, reference

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]  # `make test-fast` leaves it out
REQUEST_TTL_S = 6


@pytest.fixture(scope="module")
def loaded(redis_server, demo_model_dir, tmp_path_factory):
    with running_pipeline(redis_server, demo_model_dir, tmp_path_factory, "load",
                          RSINFER_REQUEST_TTL_S=str(REQUEST_TTL_S), RSINFER_MAX_QUEUED="20") as s:
        yield s


def test_slow_client_is_aborted_and_slows_nobody(loaded):
    s = loaded
    r = s.redis()
    probe = body(1, 20)
    [expected] = reference(s, [probe])
    # Big chunks (20 top logprobs each) so that what it does not read overflows the kernel's socket
    # buffers (up to 4 MiB here) and the server's sends block.
    sock = raw_post(s.port, "/v1/chat/completions", {**body(2, 3500), "stream": True, "logprobs": True,
                                                     "top_logprobs": 20}, rcvbuf=2048)
    try:
        head = sock.recv(512)  # the response starts; from now on this client reads nothing
        uid = head.split(b"chatcmpl-")[1][:32].decode() if b"chatcmpl-" in head else None
        t0 = time.monotonic()
        fast = httpx.post(f"{s.base_url}/v1/chat/completions", json=probe, timeout=30)
        assert fast.json()["choices"][0]["message"]["content"] == expected
        assert time.monotonic() - t0 < 5, "a stuck client slowed another request"
        if uid is None:  # the id was not in the first bytes: find the running request
            records = s.keys.request_pattern()
            uid = wait_for(lambda: next((s.keys.uid_of_request_key(k) for k in r.scan_iter(match=records)
                                         if r.hget(k, "status") == "running"), None))
        wait_for(lambda: r.get(s.keys.abort(uid)) == "slow_client", timeout=60, every=0.1)
        wait_for(lambda: r.hget(s.keys.request(uid), "status") == "aborted", timeout=10)
        wait_for(lambda: engines_idle(s), timeout=10)
    finally:
        sock.close()


def test_backlog_past_max_queued_gets_429(loaded):
    s = loaded
    [tok] = [w.name for w in workers(s, "tokenizer")]
    queued = s.keys.queued(MODEL)  # the model's queued jobs, counted at admission (shared/queued.py)
    wait_for(lambda: s.redis().zcard(queued) == 0, timeout=30, every=0.1)  # earlier tests'
    s.procs[tok].send_signal(signal.SIGSTOP)  # nothing gets tokenized: the backlog grows
    runs = []
    try:
        runs = [Streamer(s.base_url, body(100 + i, 3)) for i in range(26)]
        probes_taken = []

        def rejected() -> httpx.Response | None:
            try:  # an accepted probe just waits in the backlog too
                resp = httpx.post(f"{s.base_url}/v1/chat/completions", json=body(200, 3), timeout=1)
            except httpx.ReadTimeout:
                probes_taken.append(1)
                return None
            return resp if resp.status_code == 429 else None

        resp = wait_for(rejected, timeout=15, every=0.2)
        assert resp.headers["Retry-After"] == "1" and resp.json()["error"]["code"] == "overloaded"
    finally:
        s.procs[tok].send_signal(signal.SIGCONT)
    # The queue is counted atomically: exactly --max-queued requests are taken (the 26 and the probes that got
    # in before them), and every one is served once there is room.
    for run in runs:
        run.join(60)
    refused = [r for r in runs if r.error and r.error.get("status") == 429]
    assert len(runs) - len(refused) + len(probes_taken) == 20
    assert all(len(r.result()) > 0 for r in runs if r not in refused)
    wait_for(lambda: httpx.post(f"{s.base_url}/v1/chat/completions", json=body(201, 1)).status_code == 200)


def test_tokenizer_skips_requests_aborted_while_queued(loaded):
    s = loaded
    r = s.redis()
    [tok] = [w.name for w in workers(s, "tokenizer")]
    s.procs[tok].send_signal(signal.SIGSTOP)
    try:
        run = Streamer(s.base_url, body(300, 50))

        def queued_uid() -> str | None:
            for key in r.scan_iter(match=s.keys.request_pattern(), count=1000):
                if r.hget(key, "status") == "queued":
                    return s.keys.uid_of_request_key(key)
            return None

        uid = wait_for(queued_uid, timeout=10)
        r.set(s.keys.abort(uid), "admin", ex=60)
    finally:
        s.procs[tok].send_signal(signal.SIGCONT)
    run.join(30)
    assert run.finish == "abort" and run.text == "" and run.uid == uid
    assert r.hget(s.keys.request(uid), "status") == "aborted"
    assert not [f for _, f in r.xrange(s.keys.schedule(MODEL), count=5000) if uid in f["data"]]


def _disconnect(s, i: int) -> str:
    sock = raw_post(s.port, "/v1/chat/completions", {**body(i, 400), "stream": random.random() < 0.5})
    time.sleep(random.uniform(0.0, 0.4))
    sock.close()
    return "disconnected"


def _abort(s, i: int) -> str:
    run = Streamer(s.base_url, body(i, 400))
    wait_for(lambda: run.uid, timeout=30, every=0.01)
    time.sleep(random.uniform(0.0, 0.2))
    if random.random() < 0.5:
        httpx.delete(f"{s.base_url}/v1/requests/{run.uid}", timeout=10)
    else:
        s.redis().set(s.keys.abort(run.uid), "admin", ex=300)
    run.join(30)
    assert run.finish in ("abort", "length"), run.finish
    if run.finish == "length":  # the flag came after the request ended: nothing shortens an operator's EX 300
        s.redis().delete(s.keys.abort(run.uid))
    return f"abort:{run.finish}"


def _deadline(s, i: int) -> str:
    resp = httpx.post(f"{s.base_url}/v1/chat/completions", json={**body(i, 2000), "timeout": 0.5}, timeout=30)
    assert resp.status_code == 504
    return "deadline"


def _error(s, i: int) -> str:
    bad = random.choice([{"max_tokens": 10**6}, {"model": "nope"}, {"temperature": -1},
                         {"messages": [{"role": "user", "content": "x " * 5000}]}])
    resp = httpx.post(f"{s.base_url}/v1/chat/completions", json={**body(i, 5), **bad}, timeout=30)
    assert resp.status_code in (400, 404)
    return "error"


def _normal(s, i: int) -> str:
    if random.random() < 0.5:
        return "ok" if Streamer(s.base_url, body(i, random.randint(1, 30))).result() is not None else "bad"
    resp = httpx.post(f"{s.base_url}/v1/chat/completions", json=body(i, random.randint(1, 30)), timeout=60)
    return "ok" if resp.status_code == 200 else f"status {resp.status_code}"


def test_soak_leaves_nothing_behind(loaded):
    s = loaded
    random.seed(0)
    kinds = [_normal] * 4 + [_disconnect, _abort, _deadline, _error]
    outcomes: Counter[str] = Counter()
    failures: list[str] = []
    todo = list(range(240))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            kind = kinds[i % len(kinds)]
            try:
                outcome = kind(s, 1000 + i)
            except (AssertionError, httpx.HTTPError, TimeoutError, OSError) as e:
                outcome = f"{kind.__name__} failed"
                failures.append(f"{kind.__name__}: {e!r}")
            with lock:
                outcomes[outcome] += 1

    threads = [threading.Thread(target=worker) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert not failures, failures[:5]
    assert sum(outcomes.values()) == 240 and outcomes["ok"] == 120

    def drained() -> bool:
        apis = [w.load for w in workers(s, "api")]
        return engines_idle(s) and all(a["inflight"] == 0 and a["subscriptions"] == 0 for a in apis)

    wait_for(drained, timeout=20)
    r = s.redis()

    def left() -> list[str]:
        return [k for pattern in (s.keys.request_pattern(), s.keys.reply("*"), s.keys.abort("*"))
                for k in r.scan_iter(match=pattern, count=1000)]

    # A scheduler sends a drop's writes (the abort flag's TTL set again) with its next pipeline, up to its 1 s read
    # block after the engines went idle, and Redis expires keys by sampling: a few seconds' slack, no more.
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: not left(), timeout=REQUEST_TTL_S + 4, every=0.2)
    keys = left()
    assert keys == [], f"{len(keys)} per-request keys outlived their TTL, e.g. {[(k, r.ttl(k)) for k in keys[:3]]}"

