"""Redis restarted **with** its data in the middle of generation (issue 10): a redis-server with AOF
(`appendfsync everysec`, the way the chart runs it) is stopped with SIGTERM, which writes the AOF out, and started
again on the same port and directory. In-flight streams continue and complete with exactly the text of an
undisturbed run: the streams, groups, pending lists and records survived, so nothing has to fail.

(tests/e2e/test_redis_outage.py covers a Redis that comes back empty: there in-flight requests end with an error.)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import pytest

from rsinfer.redis_server import RedisServer
from shared.keys import STAGES
from tests.support.chaos_kit import Clients, Job, Outcome, reference_texts
from tests.support.helpers import engines_idle, wait_for
from tests.support.stack import MODEL, Stack, new_stack, start_pipeline

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]  # `make test-fast` leaves it out


@pytest.fixture
def aof_redis(tmp_path) -> Iterator[RedisServer]:
    server = RedisServer(aof_dir=tmp_path / "redis-data").start(timeout=30)
    try:
        yield server
    finally:
        server.stop()


async def through_a_restart(s: Stack, server: RedisServer, jobs: list[Job], outage_s: float
                            ) -> tuple[list[Outcome], int, dict[str, int], float]:
    """Stream `jobs`; once every one has text, stop Redis and start it again `outage_s` later. The outcomes, how
    many were in flight when Redis stopped, each reply stream's length then, and the outage's length."""
    clients = Clients([s.base_url])
    tasks = [asyncio.create_task(clients.run(j)) for j in jobs]
    deadline = time.monotonic() + 30
    while not (len(clients.outcomes) == len(jobs) and all(len(o.texts[0]) > 5 for o in clients.outcomes)):
        assert time.monotonic() < deadline, "the streams did not start"
        await asyncio.sleep(0.02)
    r = s.redis()
    lengths = {o.uid: r.xlen(s.keys.reply(o.uid)) for o in clients.outcomes}
    began = time.monotonic()
    await asyncio.to_thread(server.stop)
    in_flight = sum(not o.done for o in clients.outcomes)
    await asyncio.sleep(max(0.0, outage_s - (time.monotonic() - began)))  # the outage itself is the scenario
    server.start(timeout=30)  # from this thread (RedisServer.start says why)
    outage = time.monotonic() - began
    return list(await asyncio.gather(*tasks)), in_flight, lengths, outage


def test_in_flight_requests_survive_redis_restarts_with_their_data(aof_redis, demo_model_dir, tmp_path_factory):
    """A short restart, then a long one (past the heartbeat TTL, tests/support/stack.py), on the same stack."""
    s = new_stack(aof_redis, demo_model_dir, tmp_path_factory, "aof")
    try:
        start_pipeline(s)
        jobs = [Job(key=900 + i, kind="greedy", n=1, max_tokens=m, api=0, background=False, timeout=120)
                for i, m in enumerate((100, 150, 200, 250, 300, 400))]
        expected = asyncio.run(reference_texts(s.base_url, jobs))
        for outage_s in (1.0, 4.0):
            check_a_restart(s, aof_redis, jobs, expected, outage_s)
    finally:
        s.stop()


def check_a_restart(s: Stack, server: RedisServer, jobs: list[Job], expected: dict, outage_s: float) -> None:
    outcomes, in_flight, lengths, outage = asyncio.run(through_a_restart(s, server, jobs, outage_s))
    assert in_flight >= 3, "the requests ended before Redis went away: nothing was tested"

    r = s.redis()
    assert all(r.xlen(s.keys.reply(uid)) >= n for uid, n in lengths.items()), "the reply streams were lost"
    assert [(o.errors, o.finish) for o in outcomes] == [([], ["length"])] * len(jobs), f"{outage:.1f}s outage"
    assert [o.texts for o in outcomes] == [expected[j.key] for j in jobs]
    records = [r.hgetall(s.keys.request(o.uid)) for o in outcomes]
    assert all(rec["status"] == "finished" for rec in records), records
    wait_for(lambda: engines_idle(s), timeout=15)

    def pending() -> dict[str, int]:
        return {role: r.xpending(s.keys.stage_stream(role, MODEL), role)["pending"] for role in STAGES}

    with contextlib.suppress(TimeoutError):  # an entry whose delivery the restart cut waits for a claim
        wait_for(lambda: not any(pending().values()), timeout=10)
    assert not any(pending().values()), (pending(), {role: r.xpending_range(
        s.keys.stage_stream(role, MODEL), role, "-", "+", 10) for role in STAGES})
