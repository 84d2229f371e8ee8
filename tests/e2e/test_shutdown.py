"""Graceful shutdown for rolling updates: SIGTERM hands in-flight work to a peer at once; an API process
drains its open streams; a rolling restart of every stage under load loses no request."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time

import httpx
import pytest

from rsinfer.launcher import api_ready
from rsinfer.redis_server import free_port
from services.api.edge.admin import admin_socket_path
from tests.support.helpers import engines_idle, live_names, wait_for
from tests.support.stack import LIFECYCLE_ENV
from tests.support.streaming import Streamer, body, reference

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]  # `make test-fast` leaves it out

KEY = "sk-api-key-of-this-test-" + "0" * 16  # keys have at least 32 characters
NO_CLAIMS = {**LIFECYCLE_ENV, "RSINFER_CLAIM_IDLE_MS": "600000"}  # only a hand-back can move work


def test_sigterm_scheduler_hands_requests_to_a_peer_at_once(pipeline):
    s = pipeline
    [current] = live_names(s, "scheduler")
    # No grace at all: with two requests the tiny model makes hundreds of tokens a second, and any grace
    # would let the old scheduler finish them itself.
    s.start("scheduler-old", "scheduler", **{**LIFECYCLE_ENV, "RSINFER_GRACE_PERIOD_S": "0"})
    bodies = [body(i, 300) for i in range(50, 52)]
    expected = reference(s, bodies)
    wait_for(lambda: "scheduler-old" in live_names(s, "scheduler"), timeout=60)
    s.procs[current].send_signal(signal.SIGTERM)
    assert s.procs.pop(current).wait(30) == 0
    runs = [Streamer(s.base_url, b) for b in bodies]  # the old scheduler is the only one: it takes both
    wait_for(lambda: all(len(r.text) > 5 for r in runs), timeout=30)
    s.procs["scheduler-old"].send_signal(signal.SIGSTOP)  # hold the generation mid-way while the peer starts
    s.start("scheduler-peer", "scheduler", **NO_CLAIMS)
    wait_for(lambda: "scheduler-peer" in live_names(s, "scheduler"), timeout=60)
    s.procs["scheduler-old"].send_signal(signal.SIGCONT)
    s.procs["scheduler-old"].send_signal(signal.SIGTERM)  # no grace: hand back at once
    assert s.procs.pop("scheduler-old").wait(30) == 0
    # The peer claims idle entries only after 600 s: within result()'s 60 s only the hand-back can have moved them.
    assert [r.result(timeout=60) for r in runs] == expected
    assert all(s.redis().hget(s.keys.request(r.uid), "scheduler").startswith("scheduler-peer@") for r in runs)
    wait_for(lambda: engines_idle(s), timeout=10)


def test_sigterm_api_lets_open_streams_finish(pipeline):
    s = pipeline
    port = free_port()
    s.start("api-drain", "api", RSINFER_PORT=str(port), **{**LIFECYCLE_ENV, "RSINFER_GRACE_PERIOD_S": "60"})
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: api_ready(url), timeout=60)
    b = body(60, 1000)  # long enough to be open when the drain starts and when the refused request comes
    [expected] = reference(s, [b])
    run = Streamer(url, b)
    wait_for(lambda: len(run.text) > 5, timeout=30)
    s.procs["api-drain"].send_signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(f"{url}/ready", timeout=5).status_code == 503, timeout=30)  # it drains
    refused = httpx.post(f"{url}/v1/chat/completions", json=body(61, 5), timeout=5)
    assert refused.status_code == 503 and refused.headers["Retry-After"]
    assert run.result() == expected  # the open stream finished within the grace period
    assert s.procs.pop("api-drain").wait(30) == 0


def test_a_stream_open_past_the_grace_period_ends_with_an_error_event_and_done(pipeline):
    """What the grace period leaves open ends as a stream ends, with the reason: an error event, [DONE] and the
    response's last chunk (not a connection cut mid-response); the request is aborted."""
    s = pipeline
    port = free_port()
    s.start("api-short", "api", RSINFER_PORT=str(port), **{**LIFECYCLE_ENV, "RSINFER_GRACE_PERIOD_S": "1"})
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: api_ready(url), timeout=60)
    run = Streamer(url, body(63, 3000))
    wait_for(lambda: len(run.text) > 5, timeout=30)
    s.procs["api-short"].send_signal(signal.SIGTERM)
    run.join(30)
    assert run.reply.done and run.error["code"] == "server_shutdown", run.error
    assert s.procs.pop("api-short").wait(30) == 0
    log = (s.log_dir / "api-short.log").read_text()
    assert "ASGI callable returned" not in log and "Traceback" not in log, log
    wait_for(lambda: engines_idle(s), timeout=10)


def test_drain_is_the_pods_own_and_is_undone_without_sigterm(pipeline):
    """`rsinfer drain` (the preStop hook) drains through the API's control socket, which only this user on this
    machine can open; no HTTP request drains, from loopback or with the key. A drain that no SIGTERM follows
    within --drain-timeout-s is undone: the API goes back in service."""
    s = pipeline
    port = free_port()
    env = {**LIFECYCLE_ENV, "RSINFER_PORT": str(port), "RSINFER_DRAIN_TIMEOUT_S": "4", "RSINFER_API_KEY": KEY}
    s.start("api-drained", "api", **env)
    url, key = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {KEY}"}
    wait_for(lambda: api_ready(url), timeout=60)
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{url}/drain?wait=1", headers=key, timeout=5).status_code in (404, 405)
    assert api_ready(url), "an HTTP request drained the API"
    sock = admin_socket_path("", port)
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600 and stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o700

    t0 = time.monotonic()  # before the drain begins: the time to its undoing is --drain-timeout-s at least
    hook = subprocess.run([sys.executable, "-m", "rsinfer.cli", "drain", "--wait", "0"], env=s.env(**env),
                          capture_output=True, text=True, timeout=30)
    assert hook.returncode == 0, hook.stdout + hook.stderr
    assert json.loads(hook.stdout)["draining"] is True
    assert httpx.get(f"{url}/ready", timeout=5).status_code == 503
    refused = httpx.post(f"{url}/v1/chat/completions", json=body(62, 5), headers=key, timeout=5)
    assert refused.status_code == 503 and refused.headers["Retry-After"]
    wait_for(lambda: api_ready(url), timeout=15)  # nobody sent SIGTERM: back in service
    assert time.monotonic() - t0 >= 3
    served = httpx.post(f"{url}/v1/chat/completions", json=body(62, 5), headers=key, timeout=30)
    assert served.status_code == 200
    proc = s.procs.pop("api-drained")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert not sock.exists(), "the control socket is removed on exit"


def test_rolling_restart_of_every_stage_under_load_loses_nothing(pipeline):
    s = pipeline
    prompts = [body(i, 40) for i in range(70, 76)]
    expected = dict(zip(range(len(prompts)), reference(s, prompts), strict=True))
    results: list[tuple[float, str, int, str | None, str]] = []  # (began, url, prompt, error, text) per stream
    target = {"url": s.base_url}
    stop = threading.Event()

    def client(k: int) -> None:
        while not stop.is_set():
            i, url, began = k % len(prompts), target["url"], time.monotonic()
            run = Streamer(url, prompts[i])
            run.join(60)
            results.append((began, url, i, run.error, run.text if run.finish == "length" else f"finish={run.finish}"))
            k += 3

    def served_after(since: float, url: str = "", count: int = 3) -> None:
        """Until `count` streams begun after `since` (through `url`, when given) have ended."""
        wait_for(lambda: sum(b > since and (not url or u == url) for b, u, *_ in results) >= count, timeout=60)

    clients = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for c in clients:
        c.start()
    served_after(0, count=6)  # under load before anything restarts
    new_port = free_port()
    old = {role: live_names(s, role) for role in ("tokenizer", "scheduler", "detokenizer")}
    for role in old:
        s.start(f"{role}-new", role, **LIFECYCLE_ENV)
    s.start("api-new", "api", RSINFER_PORT=str(new_port), **LIFECYCLE_ENV)
    new_url = f"http://127.0.0.1:{new_port}"
    wait_for(lambda: api_ready(new_url) and all(f"{r}-new" in live_names(s, r) for r in old), timeout=90)
    for names in old.values():  # one stage at a time, as a Deployment's rolling update does
        for name in names:
            s.procs[name].send_signal(signal.SIGTERM)
            assert s.procs.pop(name).wait(30) == 0
        served_after(time.monotonic())  # the stage's new worker alone serves, before the next stage goes
    old_api = next(n for n in s.procs if n.startswith("api") and n != "api-new")
    switched = time.monotonic()
    target["url"] = new_url  # the Service now points at the new API; the old one drains
    served_after(switched, new_url)  # as a preStop hook waits for endpoints to update
    s.procs[old_api].send_signal(signal.SIGTERM)
    assert s.procs.pop(old_api).wait(30) == 0
    served_after(time.monotonic())  # none of the old processes is left
    stop.set()
    for c in clients:
        c.join(90)
    s.port = new_port
    assert len(results) > 20
    failures = [(i, err, text) for _, _, i, err, text in results if err is not None or text != expected[i]]
    assert not failures, failures[:3]
    wait_for(lambda: engines_idle(s), timeout=10)
