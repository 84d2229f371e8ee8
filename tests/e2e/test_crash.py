"""Crashes: kill -9 of a tokenizer, scheduler, detokenizer or API process with requests in flight.

A process is first frozen (SIGSTOP) so that it holds entries it will never finish, a peer is started,
then the frozen one is killed with SIGKILL. Every request must complete with exactly the text an
uninterrupted run gives (greedy), with no gap and no duplicate.
"""

from __future__ import annotations

import json
import re
import signal

import httpx
import pytest

from rsinfer.launcher import api_ready
from rsinfer.redis_server import free_port
from tests.support.helpers import engines_idle, live_names, sse_payloads, wait_for
from tests.support.stack import LIFECYCLE_ENV, MODEL, running_pipeline
from tests.support.streaming import Streamer, body, reference

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]  # `make test-fast` leaves it out


def test_scheduler_killed_mid_generation_is_resumed_by_a_peer(pipeline):
    s = pipeline
    bodies = [body(i) for i in range(6)]
    expected = reference(s, bodies)
    assert len(set(expected)) > 1
    [old] = live_names(s, "scheduler")
    runs = [Streamer(s.base_url, b) for b in bodies]
    wait_for(lambda: all(len(r.text) > 10 for r in runs), timeout=30)
    s.procs[old].send_signal(signal.SIGSTOP)  # it holds every request and will never finish them
    s.start("scheduler2", "scheduler", **LIFECYCLE_ENV)
    wait_for(lambda: "scheduler2" in live_names(s, "scheduler"), timeout=60)
    s.kill(old)
    assert [r.result() for r in runs] == expected
    records = [s.redis().hgetall(s.keys.request(r.uid)) for r in runs]
    assert all(rec["scheduler"].startswith("scheduler2@") and rec["status"] == "finished" for rec in records)
    wait_for(lambda: engines_idle(s), timeout=10)


def test_a_killed_schedulers_requests_are_resumed_long_before_its_claim_idle(redis_server, demo_model_dir,
                                                                             tmp_path_factory):
    """Its connections, named after it, close with the process: a peer claims at once what it held, instead of
    waiting out --claim-idle-ms (30 s here, on both: with a shorter one a peer would take live requests from a
    replica that touches its entries only every 10 s) as it must for a frozen one."""
    env = {"RSINFER_CLAIM_IDLE_MS": "30000"}
    with running_pipeline(redis_server, demo_model_dir, tmp_path_factory, "gone", **env) as s:
        s.start("scheduler2", "scheduler", **{**LIFECYCLE_ENV, **env})
        wait_for(lambda: len(live_names(s, "scheduler")) == 2, timeout=60)
        bodies = [body(i, 400) for i in range(70, 76)]
        expected = reference(s, bodies)
        runs = [Streamer(s.base_url, b) for b in bodies]
        wait_for(lambda: all(len(r.text) > 10 for r in runs), timeout=30)
        owner = s.redis().hget(s.keys.request(runs[0].uid), "scheduler").partition("@")[0]
        victims = [r for r in runs if s.redis().hget(s.keys.request(r.uid), "scheduler").startswith(f"{owner}@")]
        s.kill(owner)

        def taken_over() -> bool:  # by the peer: each victim's record names it (the claim rewrites the field)
            return all(not s.redis().hget(s.keys.request(r.uid), "scheduler").startswith(f"{owner}@")
                       for r in victims)

        wait_for(taken_over, timeout=20)  # well inside the 30 s claim idle, whatever the machine's load
        assert [r.result() for r in runs] == expected
        records = [s.redis().hgetall(s.keys.request(r.uid)) for r in victims]
        assert all(rec["status"] == "finished" for rec in records), records


def test_a_constrained_request_resumed_by_a_peer_keeps_its_grammar_state(pipeline):
    """The peer replays the tokens already produced into a new matcher: the text goes on exactly as an
    uninterrupted run's, and stays inside the grammar."""
    s = pipeline
    regex = r"[a-z]+( [a-z]+)*"
    bodies = [body(i, 100, regex=regex, min_tokens=100, temperature=0.8, seed=i) for i in range(50, 53)]
    expected = reference(s, bodies)
    assert all(re.fullmatch(regex, text) for text in expected)
    [old] = live_names(s, "scheduler")
    runs = [Streamer(s.base_url, b) for b in bodies]
    wait_for(lambda: all(len(r.text) > 10 for r in runs), timeout=30)
    s.procs[old].send_signal(signal.SIGSTOP)
    s.start("scheduler3", "scheduler", **LIFECYCLE_ENV)
    wait_for(lambda: "scheduler3" in live_names(s, "scheduler"), timeout=60)
    s.kill(old)
    assert [r.result() for r in runs] == expected
    records = [s.redis().hgetall(s.keys.request(r.uid)) for r in runs]
    assert all(rec["scheduler"].startswith("scheduler3@") for rec in records)
    wait_for(lambda: engines_idle(s), timeout=10)


def test_tokenizer_killed_with_pending_entries(pipeline):
    s = pipeline
    bodies = [body(i, 20) for i in range(10, 18)]
    expected = reference(s, bodies)
    [old] = live_names(s, "tokenizer")
    s.procs[old].send_signal(signal.SIGSTOP)
    runs = [Streamer(s.base_url, b) for b in bodies]
    wait_for(lambda: s.redis().xpending(s.keys.tokenize(MODEL), "tokenizer")["pending"] > 0, timeout=10)
    s.start("tokenizer2", "tokenizer", **LIFECYCLE_ENV)
    wait_for(lambda: "tokenizer2" in live_names(s, "tokenizer"), timeout=60)
    s.kill(old)
    assert [r.result() for r in runs] == expected


def test_detokenizer_killed_with_pending_entries(pipeline):
    s = pipeline
    bodies = [body(i, 80) for i in range(20, 24)]
    expected = reference(s, bodies)
    [old] = live_names(s, "detokenizer")
    runs = [Streamer(s.base_url, b) for b in bodies]
    wait_for(lambda: all(len(r.text) > 5 for r in runs), timeout=30)
    s.procs[old].send_signal(signal.SIGSTOP)
    s.start("detokenizer2", "detokenizer", **LIFECYCLE_ENV)
    wait_for(lambda: "detokenizer2" in live_names(s, "detokenizer"), timeout=60)
    s.kill(old)
    assert [r.result() for r in runs] == expected


def test_duplicate_deliveries_never_duplicate_text(pipeline):
    s = pipeline
    r = s.redis()
    b = body(30, 150)
    [expected] = reference(s, [b])
    run = Streamer(s.base_url, b)
    wait_for(lambda: len(run.text) > 20, timeout=30)
    entries = r.xrange(s.keys.detokenize(MODEL), count=2000)
    mine = [f for _, f in entries if run.uid in f["data"]][:10]
    assert mine
    for fields in mine:  # as if a claimed entry was redone by a peer
        r.xadd(s.keys.detokenize(MODEL), fields)
    sched = [f for _, f in r.xrange(s.keys.schedule(MODEL), count=2000) if run.uid in f["data"]]
    r.xadd(s.keys.schedule(MODEL), sched[0])  # a tokenizer that forwarded it twice
    assert run.result() == expected
    assert r.hget(s.keys.request(run.uid), "completion_tokens") == "150"
    wait_for(lambda: engines_idle(s), timeout=10)


def test_api_death_aborts_its_requests_but_not_background_ones(pipeline):
    s = pipeline
    background = body(40, 200, background=True)
    [expected] = reference(s, [background])
    port2 = free_port()
    s.start("api2", "api", RSINFER_PORT=str(port2), **LIFECYCLE_ENV)
    url2 = f"http://127.0.0.1:{port2}"
    wait_for(lambda: api_ready(url2), timeout=60)
    fg = Streamer(url2, body(41, 3000))
    bg = Streamer(url2, background)
    wait_for(lambda: len(fg.text) > 5 and len(bg.text) > 5 and bg.ids, timeout=30)
    s.kill("api2")
    r = s.redis()
    wait_for(lambda: r.hget(s.keys.request(fg.uid), "status") == "aborted", timeout=10)
    assert r.hget(s.keys.request(fg.uid), "error") == "aborted: owner_gone"
    # the background request goes on; reattach from the other API process where the stream broke
    last = bg.ids[-1]
    with httpx.stream("GET", f"{s.base_url}/v1/requests/{bg.uid}/stream", headers={"Last-Event-ID": last},
                      timeout=60) as resp:
        rest = sse_payloads("".join(resp.iter_text()))
    tail = "".join(c["delta"].get("content") or "" for d in rest if d.startswith("{")
                   for c in json.loads(d)["choices"])
    assert bg.text + tail == expected
    assert r.hget(s.keys.request(bg.uid), "status") == "finished"
    wait_for(lambda: engines_idle(s), timeout=10)
