"""Redis full (`maxmemory` with `noeviction`): new requests get 503 with Retry-After (nothing queued), the work
each stage holds waits while Redis refuses its writes, and once Redis has room again (the filler deleted) every
stream finishes with exactly the text an undisturbed run gives, and new requests are served again. No process
exits, nothing is dead-lettered.

Each test parks work at stages (SIGSTOP) before Redis fills, and lets it go while Redis is full, for longer than
a claim idle times the dead-letter limit and than the heartbeat TTL."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from rsinfer.redis_server import RedisServer
from tests.support.helpers import engines_idle, wait_for
from tests.support.stack import MODEL, Stack, running_pipeline
from tests.support.streaming import Streamer, body, reference

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]  # `make test-fast` leaves it out

HEADROOM = 16 << 20  # maxmemory: what the stack uses when Redis is filled, plus this
FULL_FOR_S = 8.0
FILLER = "oomfill:"
STAGES = ("tokenizer", "scheduler", "detokenizer")


@pytest.fixture(scope="module")
def oom_stack(demo_model_dir, tmp_path_factory) -> Iterator[Stack]:
    server = RedisServer(maxmemory="1gb").start()  # what `rsinfer up` gives its redis-server (bounded)
    try:
        with running_pipeline(server, demo_model_dir, tmp_path_factory, "oom") as s:
            yield s
    finally:
        server.stop()


class Filler(threading.Thread):
    """Holds Redis at its maxmemory: bursts of SETs until Redis refuses one, then one SET at a time every few
    milliseconds (the stages' XTRIMs, XACKs and expiries free memory their writes would take back; a refused
    burst's buffer, once freed, would let them in for a while)."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.r = redis.Redis.from_url(url)
        self.stopping, self.full = threading.Event(), threading.Event()
        self.count = 0
        self.start()

    def run(self) -> None:
        value, burst = b"x" * 512, 256
        while not self.stopping.is_set():
            try:
                with self.r.pipeline(transaction=False) as pipe:
                    for _ in range(burst):
                        pipe.set(f"{FILLER}{self.count}", value)
                        self.count += 1
                    pipe.execute()
            except redis.exceptions.OutOfMemoryError:
                self.full.set()
                burst = 1
                time.sleep(0.005)

    def stop_and_delete(self) -> None:
        self.stopping.set()
        self.join(10)
        for i in range(0, self.count, 1000):
            self.r.delete(*(f"{FILLER}{j}" for j in range(i, min(i + 1000, self.count))))


def probe(url: str, payload: dict) -> tuple:
    """(status, Retry-After, error code) of a refused request; (200,) for a stream that started, ("waiting",) for a
    request taken but unanswered within 3 s."""
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=payload, timeout=3) as resp:
            if resp.status_code == 200:
                return (200,)
            resp.read()
            return resp.status_code, resp.headers.get("retry-after"), resp.json()["error"]["code"]
    except httpx.ReadTimeout:
        return ("waiting",)


def records(s: Stack) -> set[str]:
    return set(s.redis().scan_iter(match=s.keys.request_pattern(), count=1000))


def new_statuses(s: Stack, known: set[str]) -> list[str | None]:
    """The statuses of the requests whose records are not in `known`."""
    return [s.redis().hget(key, "status") for key in records(s) - known]


def lag(s: Stack, stream: str, group: str) -> int:
    return next(int(g["lag"] or 0) for g in s.redis().xinfo_groups(stream) if g["name"] == group)


def park(s: Stack, role: str, payload: dict, status: str) -> Streamer:
    """Freeze `role` and send a request that reaches it: its record says `status` (the previous stage is done)."""
    s.procs[f"{role}1"].send_signal(signal.SIGSTOP)
    known = records(s)
    run = Streamer(s.base_url, payload)
    wait_for(lambda: new_statuses(s, known) == [status], timeout=20)
    return run


def while_full(s: Stack, frozen: list[str], runs: list[Streamer]) -> list[tuple]:
    """Fill Redis, let the frozen stages go, keep it full for FULL_FOR_S while new requests come; then empty it.
    What the new requests got."""
    r = s.redis()
    r.config_set("maxmemory", int(r.info("memory")["used_memory"]) + HEADROOM)
    filler = Filler(s.redis_url)
    answers: list[tuple] = []
    try:
        assert filler.full.wait(20), "Redis never refused a write"
        for role in frozen:
            s.procs[f"{role}1"].send_signal(signal.SIGCONT)
        deadline = time.monotonic() + FULL_FOR_S
        while time.monotonic() < deadline:
            for stream in (False, True):
                answers.append(probe(s.base_url, {**body(390, 5), "stream": stream}))
            time.sleep(0.3)
        assert all(run.is_alive() for run in runs), "a stream ended while Redis was full"
    finally:
        for role in frozen:
            s.procs[f"{role}1"].send_signal(signal.SIGCONT)
        filler.stop_and_delete()
        r.config_set("maxmemory", 1 << 30)
    return answers


def check_recovered(s: Stack, answers: list[tuple], runs: list[Streamer], expected: list[str], dead: int) -> None:
    # Redis frees a little now and then (trims, acknowledgements): a request that got in then waits (no answer
    # within the probe's timeout, or a stream's 200); the others are refused, every one with a 503.
    assert len([a for a in answers if a[0] == 503]) >= len(answers) // 2, answers
    assert all(a in (("waiting",), (200,)) or (a[0] == 503 and int(a[1]) >= 1 and a[2] == "broker_full")
               for a in answers), answers
    assert [run.result(120) for run in runs] == expected  # paused, then finished: no gap, no duplicate
    assert httpx.post(f"{s.base_url}/v1/chat/completions", json=body(391, 5), timeout=30).status_code == 200
    assert s.redis().xlen(s.keys.dead()) == dead, s.redis().xrange(s.keys.dead())
    assert not [n for n, p in s.procs.items() if p.poll() is not None], "a process exited"
    wait_for(lambda: engines_idle(s), timeout=30)


def test_streams_in_flight_ride_out_a_full_redis(oom_stack):
    """Streams a scheduler is generating, and their steps waiting for the (frozen) detokenizer, when Redis fills."""
    s = oom_stack
    r = s.redis()
    assert r.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    assert int(r.config_get("maxmemory")["maxmemory"]) == 1 << 30
    bodies = [body(i, 600) for i in range(300, 303)]  # frozen mid-way, then held by the full Redis: they outlast it
    expected = reference(s, bodies)
    dead = r.xlen(s.keys.dead())
    runs = [Streamer(s.base_url, b) for b in bodies]
    wait_for(lambda: all(len(run.text) > 10 for run in runs), timeout=30)
    s.procs["detokenizer1"].send_signal(signal.SIGSTOP)
    wait_for(lambda: lag(s, s.keys.detokenize(MODEL), "detokenizer") >= 3, timeout=10)
    s.procs["scheduler1"].send_signal(signal.SIGSTOP)  # mid-generation, its next steps still to write
    answers = while_full(s, ["detokenizer", "scheduler"], runs)
    check_recovered(s, answers, runs, expected, dead)


def test_jobs_waiting_for_a_stage_ride_out_a_full_redis(oom_stack):
    """A job at an idle scheduler (its admission refused) and one at the tokenizer, when Redis fills."""
    s = oom_stack
    bodies = [body(i, 200) for i in (320, 321)]
    expected = reference(s, bodies)
    dead = s.redis().xlen(s.keys.dead())
    wait_for(lambda: engines_idle(s), timeout=30)
    runs = [park(s, "scheduler", bodies[0], "tokenized"), park(s, "tokenizer", bodies[1], "queued")]
    answers = while_full(s, ["tokenizer", "scheduler"], runs)
    check_recovered(s, answers, runs, expected, dead)
