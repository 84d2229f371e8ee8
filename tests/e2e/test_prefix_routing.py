"""Prefix-aware routing with real processes: a tokenizer with --prefix-routing and two schedulers (with and
without --fair-queueing).

Requests sharing a long prefix go to the scheduler that holds it (their cached_tokens show the hit), through that
scheduler's own stream. A request routed to a scheduler that dies, while it runs the request or before it has read
it, is run by a peer with exactly the text an undisturbed run gives (greedy), and the dead one's stream ends.
"""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest

from rsinfer.launcher import api_ready
from rsinfer.redis_server import free_port
from services.tokenizer.router import prompt_pages
from shared.pages import isolation_salt
from tests.support.helpers import wait_for, worker_name, workers
from tests.support.stack import LIFECYCLE_ENV, MODEL, Stack, new_stack
from tests.support.streaming import Streamer

pytestmark = pytest.mark.timeout(300)
PAGE = 16
# A small load weight: requests sent one after the other count as load until the scheduler's next heartbeat.
ENV = {**LIFECYCLE_ENV, "RSINFER_PAGE_SIZE": str(PAGE), "RSINFER_MAX_KV_TOKENS": "8192",
       "RSINFER_PREFIX_ROUTING_LOAD_TOKENS": "8"}


def prefix(seed: int, pages: int = 16) -> list[int]:
    return [(seed * 7919 + i * 31) % 900 + 50 for i in range(pages * PAGE)]


def body(ids: list[int], max_tokens: int = 4, **extra) -> dict:
    return {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def complete(s: Stack, ids: list[int], max_tokens: int = 4) -> dict:
    resp = httpx.post(f"{s.base_url}/v1/completions", json=body(ids, max_tokens), timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def record(s: Stack, response_id: str) -> dict:
    return s.redis().hgetall(s.keys.request(response_id.removeprefix("cmpl-")))


def schedulers(s: Stack) -> list[str]:
    return [w.id for w in workers(s, "scheduler")]


def routing_among(s: Stack, n: int) -> bool:
    """n schedulers live, and the tokenizer routes among them (its heartbeat says how many it knows)."""
    return len(schedulers(s)) == n and [w.load.get("routing_to") for w in workers(s, "tokenizer")] == [n]


@pytest.fixture(scope="module", params=["fifo", "fair"])
def routed(request, redis_server, demo_model_dir, tmp_path_factory):
    """fair: the tokenizer with --fair-queueing too, which routes each job when it releases it."""
    s = new_stack(redis_server, demo_model_dir, tmp_path_factory, "route")
    fair = {"RSINFER_FAIR_QUEUEING": "true"} if request.param == "fair" else {}
    try:
        # a skew bound above the 4 requests sent together below, which all go to their prefix's holder (the bound
        # itself: tests/unit/tokenizer/test_router.py, tests/unit/shared/test_routing.py)
        s.start("tokenizer1", "tokenizer", RSINFER_PREFIX_ROUTING="true", RSINFER_PREFIX_ROUTING_MAX_SKEW="8", **fair,
                **ENV)
        for name in ("sa", "sb"):
            s.start(name, "scheduler", **ENV)
        s.start("detokenizer1", "detokenizer", **ENV)
        s.start("api1", "api", **ENV)
        s.wait_ready()
        wait_for(lambda: routing_among(s, 2), timeout=60)
        yield s
    finally:
        s.stop()


def holder_of(s: Stack, ids: list[int]) -> str:
    """Send a first request with this prefix; the scheduler that ran it, once its pages are published."""
    first = complete(s, ids)
    holder = record(s, first["id"])["scheduler"]
    published = set(prompt_pages(ids, PAGE))
    wait_for(lambda: published <= s.redis().smembers(s.keys.cached_pages(MODEL, holder)), timeout=10)
    return holder


def test_requests_sharing_a_prefix_go_to_the_scheduler_that_holds_it(routed):
    s = routed
    p = prefix(1)
    holder = holder_of(s, [*p, 7, 8, 9])
    answers = [complete(s, [*p, 10 + i, 11, 12]) for i in range(4)]  # one at a time
    out: list[dict] = [{}] * 4

    def one(i: int) -> None:
        out[i] = complete(s, [*p, 20 + i, 21])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]  # and together
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a in answers + out:
        rec = record(s, a["id"])
        assert rec["scheduler"] == holder, rec
        assert rec["entry"].startswith(f"{holder}/")  # through the holder's own stream
        assert a["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(p) - PAGE
    # a prompt no scheduler holds goes to the shared stream
    other = complete(s, prefix(99))
    assert "/" not in record(s, other["id"])["entry"]


TENANT_KEYS = {t: f"sk-{t}-{'0' * 28}" for t in ("team-a", "team-b", "team-c", "team-d")}


@pytest.mark.parametrize("routed", ["fifo"], indirect=True)
def test_tenants_never_read_each_others_cached_prefix_unless_their_policies_share_a_salt(routed, tmp_path):
    """Issue 35, item 3: an API process with keys (team-c and team-d name one `cache_salt`); one long prefix sent by
    each tenant in turn. Each first request of a scope reports cached_tokens 0, a repeat in its scope > 0 on the
    scheduler routing chose for it (routing names the pages as the engine does: salted)."""
    s, p = routed, prefix(50)
    entries = [{"key": k, "tenant": t, **({"cache_salt": "docs"} if t in ("team-c", "team-d") else {})}
               for t, k in TENANT_KEYS.items()]
    (tmp_path / "keys.json").write_text(json.dumps(entries))
    port = free_port()
    s.start("api-keyed", "api", **ENV, RSINFER_PORT=str(port), RSINFER_API_KEYS_FILE=str(tmp_path / "keys.json"))
    base = f"http://127.0.0.1:{port}"

    def cached(tenant: str, tail: int, salt: str | None = None) -> int:
        extra = {"cache_salt": salt} if salt else {}
        resp = httpx.post(f"{base}/v1/completions", json=body([*p, tail, tail + 1], **extra), timeout=60,
                          headers={"Authorization": f"Bearer {TENANT_KEYS[tenant]}"})
        assert resp.status_code == 200, resp.text
        holder = record(s, resp.json()["id"])["scheduler"]
        scope = isolation_salt("salt:docs" if tenant in ("team-c", "team-d") else f"tenant:{tenant}", salt)
        pages = set(prompt_pages(p, PAGE, scope))  # published before the next request routes
        wait_for(lambda: pages <= s.redis().smembers(s.keys.cached_pages(MODEL, holder)), timeout=10)
        return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    try:
        s.wait_until(lambda: api_ready(base), 60, "api with keys")
        assert complete(s, [*p, 1, 2])["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # open mode's scope
        assert cached("team-a", 10) == 0
        assert cached("team-a", 20) >= len(p) - PAGE, "A's repeat reads A's pages"
        assert cached("team-b", 30) == 0, "B's first request reads none of A's pages"
        assert cached("team-c", 40) == 0
        assert cached("team-d", 50) >= len(p) - PAGE, "D's policy names C's salt: they share"
        assert cached("team-a", 60, salt="user-1") == 0, "a cache_salt of its own within A's scope"
        assert cached("team-a", 70, salt="user-1") >= len(p) - PAGE
        assert cached("team-a", 80, salt="user-2") == 0
    finally:
        s.kill("api-keyed")


# A scheduler's death is the same to both tokenizers (they differ in when they route, which the test above checks):
# the takeovers run once, with the fifo one.
@pytest.mark.parametrize("routed", ["fifo"], indirect=True)
def test_a_routed_request_whose_scheduler_is_killed_mid_generation_finishes_on_a_peer(routed):
    s = routed
    two_routing(s, "sc")
    p = [*prefix(2), 5, 6]
    holder = holder_of(s, p)
    expected = complete(s, p, 200)["choices"][0]["text"]
    run = Streamer(s.base_url, path="/v1/completions", payload=body(p, 200))
    wait_for(lambda: len(run.text) > 10, timeout=30)
    rec = s.redis().hgetall(s.keys.request(run.uid))
    assert rec["scheduler"] == holder and rec["entry"].startswith(f"{holder}/")
    s.kill(worker_name(holder))
    assert run.result(90) == expected
    rec = s.redis().hgetall(s.keys.request(run.uid))
    assert rec["scheduler"] != holder and rec["entry"].startswith(f"{holder}/")  # claimed from the dead one's stream
    ended(s, holder)


@pytest.mark.parametrize("routed", ["fifo"], indirect=True)
def test_a_request_routed_to_a_scheduler_that_dies_before_reading_it_is_run_by_a_peer(routed):
    """The holder runs a long request (so it reads without blocking), is frozen, and a second request is routed to
    it (alive to the tokenizer for a heartbeat TTL more) and stays undelivered in its stream; then it is killed.
    A peer claims the first (pending to the dead one) and reads the second (never delivered)."""
    s = routed
    two_routing(s, "sd")
    p = [*prefix(3), 5, 6]
    holder = holder_of(s, p)
    long_one, routed_late = body(p, 300), body(p, 120, seed=424242)  # the seed marks its entry (greedy: no effect)
    expected = [complete(s, p, 300)["choices"][0]["text"], complete(s, p, 120)["choices"][0]["text"]]
    first = Streamer(s.base_url, path="/v1/completions", payload=long_one)
    wait_for(lambda: len(first.text) > 10, timeout=30)
    assert s.redis().hget(s.keys.request(first.uid), "scheduler") == holder
    s.procs[worker_name(holder)].send_signal(signal.SIGSTOP)
    second = Streamer(s.base_url, path="/v1/completions", payload=routed_late)
    lane = s.keys.scheduler_stream(MODEL, holder)
    wait_for(lambda: any("424242" in f["data"] for _, f in s.redis().xrange(lane)), timeout=10)
    assert s.redis().xpending(lane, "scheduler")["pending"] == 1  # the long one; the late one never delivered
    s.kill(worker_name(holder))
    assert [first.result(90), second.result(90)] == expected
    for run in (first, second):
        rec = s.redis().hgetall(s.keys.request(run.uid))
        assert rec["scheduler"] != holder and rec["entry"].startswith(f"{holder}/")  # from the dead one's stream
    ended(s, holder)


def ended(s: Stack, dead: str) -> None:
    """The dead scheduler's stream, its page set and its name in the routed set are gone."""
    r = s.redis()
    wait_for(lambda: not r.exists(s.keys.scheduler_stream(MODEL, dead), s.keys.cached_pages(MODEL, dead))
             and dead not in r.smembers(s.keys.routed(MODEL)), timeout=20)


def two_routing(s: Stack, name: str) -> None:
    """Two schedulers to route among: a test that killed one left one (a new one, `name`, starts then; not at the
    end of that test, which may be the stack's last)."""
    if not routing_among(s, 2):
        s.start(name, "scheduler", **ENV)
    wait_for(lambda: routing_among(s, 2), timeout=60)
