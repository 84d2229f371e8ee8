"""The tokenizer worker against a real redis-server: an entry is kept alive while it is being encoded, so no
peer (nor this worker's own claimer) takes it and encodes it again; and a heavy job is encoded apart, so the
small jobs of its read are forwarded without waiting for it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from services.tokenizer.main import HEAVY_JOB_CHARS, TokenizerWorker
from shared.messages import ReplyError, SamplingParams, TokenizeJob, TokenizerAnswer, TokenizerQuery, decode, encode
from shared.settings import TokenizerSettings
from shared.streams import FIELD
from tests.support.helpers import async_wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def worker(redis_server, random_model_dir):
    settings = TokenizerSettings(redis_url=redis_server.url, namespace=f"t{uuid.uuid4().hex[:8]}", worker_id="t1",
                                 claim_idle_ms=1000)
    w = TokenizerWorker(settings, str(random_model_dir), "demo")
    await w.source.ensure_group()
    yield w
    await w.close()


def job(uid: str, prompt: str) -> TokenizeJob:
    return TokenizeJob(uid=uid, model="demo", pod="p", created_at=time.time(), deadline=time.time() + 60,
                       params=SamplingParams(max_tokens=4), prompt=prompt)


async def read(w: TokenizerWorker, *jobs: TokenizeJob) -> list[tuple[str, dict[bytes, bytes]]]:
    for j in jobs:
        await w.redis.xadd(w.source.key, {FIELD: encode(j)})
    resp = await w.redis.xreadgroup(w.group, w.id, {w.source.key: ">"}, count=len(jobs))
    return [(eid.decode(), f) for eid, f in resp[0][1]]


@contextlib.contextmanager
def held_encoding(w: TokenizerWorker, only_heavy: bool = False) -> Iterator[threading.Event]:
    """Encoding (of the heavy jobs only, or of all) blocks in its thread until the event yielded is set: a slow
    encode, however slow the test needs, and released on the way out whatever happens."""
    encode_jobs, release = w.encoder.encode, threading.Event()

    def held(jobs):
        if not only_heavy or any(w.encoder.job_bytes(j) > HEAVY_JOB_CHARS for j in jobs):
            release.wait(30)
        return encode_jobs(jobs)

    w.encoder.encode = held
    try:
        yield release
    finally:
        release.set()


async def scheduled(w: TokenizerWorker) -> set[str]:
    from shared.messages import ScheduleJob, decode

    return {decode(f[FIELD], ScheduleJob).uid for _, f in await w.redis.xrange(w.keys.schedule("demo"))}


async def test_an_entry_being_encoded_is_kept_alive_against_claims(worker):
    """A job still being encoded past the 1 s claim idle: a peer's claim finds nothing to take (before, it took the
    entry after 1 s and encoded it a second time)."""
    w = worker
    touches, touch = [], w.source.touch

    async def counted(ids):
        touches.extend(ids)
        return await touch(ids)

    w.source.touch = counted
    with held_encoding(w) as release:
        keep_alive = asyncio.create_task(w.keep_alive())
        entries = await read(w, job("slow", "hello there"))
        handling = asyncio.create_task(w._deliver(entries, claimed=False))
        # touched every claim_idle / 3: the 5th touch comes over 1 s after the read, as the encode still runs
        await async_wait_for(lambda: touches.count(entries[0][0]) >= 5)
        _, claimed, _ = await w.redis.xautoclaim(w.source.key, w.group, "peer", min_idle_time=1000, count=10)
        assert claimed == []
        release.set()
        await asyncio.wait_for(handling, 30)
    keep_alive.cancel()
    assert await scheduled(w) == {"slow"}
    assert (await w.redis.xpending(w.source.key, w.group))["pending"] == 0


async def test_a_heavy_job_does_not_hold_back_the_small_ones_of_its_read(worker):
    w = worker
    with held_encoding(w, only_heavy=True) as release:
        entries = await read(w, job("big", "word " * (HEAVY_JOB_CHARS // 5 + 100)), job("small", "hi"))
        await asyncio.wait_for(w._deliver(entries, claimed=False), 30)  # done while the big one is still encoded
        assert await scheduled(w) == {"small"} and w._heavy
        assert w.held_entries() == [entries[0][0]]  # kept alive while it is encoded
        release.set()
        await async_wait_for(lambda: not w._heavy)
    # (past the demo model's 4,096-token context: its answer is a 400, written once it is encoded)
    assert (await w.redis.hget(w.keys.request("big"), "status")) == b"failed"
    assert (await w.redis.xpending(w.source.key, w.group))["pending"] == 0


def query(uid: str, **kw) -> TokenizerQuery:
    return TokenizerQuery(uid=uid, model="demo", pod="p", created_at=time.time(),
                          deadline=kw.pop("deadline", time.time() + 60), **kw)


async def replies(w: TokenizerWorker, uid: str) -> list:
    return [decode(f[FIELD], TokenizerAnswer | ReplyError) for _, f in await w.redis.xrange(w.keys.reply(uid))]


async def test_queries_are_answered_on_their_reply_streams_and_never_forwarded(worker):
    """A read with a job and queries: the job goes to the schedulers; each query gets its answer (or its 400)
    on its reply stream and its record's end; an aborted or expired query is skipped; every key has a TTL and
    every entry is acknowledged."""
    w = worker
    await w.redis.set(w.keys.abort("gone"), "client_disconnected")
    entries = await read(w, job("gen", "hello there"), query("tok", prompt="hello there"),
                         query("detok", op="detokenize", tokens=[1, 2, 3]),
                         query("bad", op="detokenize", tokens=[10**6]), query("gone", prompt="x"),
                         query("late", prompt="x", deadline=time.time() - 1))
    await w._deliver(entries, claimed=False)
    assert await scheduled(w) == {"gen"}
    (tok,) = await replies(w, "tok")
    assert tok.tokens == w.encoder.tokenizer.encode("hello there") and tok.count == len(tok.tokens)
    assert (await replies(w, "detok"))[0].prompt == w.encoder.tokenizer.decode([1, 2, 3])
    (bad,) = await replies(w, "bad")
    assert isinstance(bad, ReplyError) and (bad.status, bad.param) == (400, "tokens")
    assert await replies(w, "gone") == []
    (late,) = await replies(w, "late")
    assert isinstance(late, ReplyError) and late.status == 504
    statuses = {u: (await w.redis.hget(w.keys.request(u), "status")).decode()
                for u in ("tok", "detok", "bad", "gone", "late")}
    assert statuses == {"tok": "finished", "detok": "finished", "bad": "failed", "gone": "aborted", "late": "failed"}
    for uid in ("tok", "detok", "bad", "late"):
        assert await w.redis.ttl(w.keys.reply(uid)) > 0 and await w.redis.ttl(w.keys.request(uid)) > 0
    assert (await w.redis.xpending(w.source.key, w.group))["pending"] == 0


async def test_a_claimed_query_already_answered_is_not_answered_again(worker):
    w = worker
    entries = await read(w, query("once", prompt="hi"))
    await w._deliver(entries, claimed=False)
    await w.redis.xclaim(w.source.key, w.group, w.id, 0, [entries[0][0]], force=True)  # as a peer's claim would
    await w._deliver(entries, claimed=True)
    assert len(await replies(w, "once")) == 1


@pytest.fixture
async def fair_worker(redis_server, random_model_dir):
    settings = TokenizerSettings(redis_url=redis_server.url, namespace=f"t{uuid.uuid4().hex[:8]}", worker_id="t1",
                                 claim_idle_ms=1000, fair_queueing=True, fair_watermark=2)
    w = TokenizerWorker(settings, str(random_model_dir), "demo")
    await w.source.ensure_group()
    await w.redis.xgroup_create(w.keys.schedule("demo"), "scheduler", id="0", mkstream=True)
    yield w
    await w.close()


def of(tenant: str, uid: str, weight: int = 1) -> TokenizeJob:
    import msgspec

    return msgspec.structs.replace(job(uid, "hello"), tenant=tenant, weight=weight)


async def take(w: TokenizerWorker, count: int = 100) -> list[str]:
    """What a scheduler reads now from the shared schedule stream (it is delivered: no longer backlog)."""
    from shared.messages import ScheduleJob

    resp = await w.redis.xreadgroup("scheduler", "s1", {w.keys.schedule("demo"): ">"}, count=count)
    return [decode(f[FIELD], ScheduleJob).uid for _, f in (resp[0][1] if resp else [])]


async def test_fair_queueing_holds_jobs_pending_and_releases_them_in_turns_up_to_the_watermark(fair_worker):
    """A's five jobs and then B's two are held (tokenized, their entries pending); releases fill the schedule
    stream's backlog up to the watermark (2) only, taking A's and B's in turn, and acknowledge what they send."""
    w = fair_worker
    await w._deliver(await read(w, *(of("a", f"a{i}") for i in range(5))), claimed=False)
    await w._deliver(await read(w, of("b", "b0"), of("b", "b1")), claimed=False)
    assert await scheduled(w) == set() and len(w.fair.queue) == 7
    assert (await w.redis.xpending(w.source.key, w.group))["pending"] == 7  # durable: claimable if we die
    assert await w.redis.hget(w.keys.request("a0"), "status") == b"tokenized"
    assert sorted(w.held_entries()) == sorted(h.entry_id for h in w.fair.queue.items())  # kept alive
    await w.fair.release_some()
    await w.fair.release_some()  # the backlog is at the watermark: nothing more goes
    assert await take(w) == ["a0", "b0"]  # B's lane joined the round before the first release
    order = []
    for _ in range(3):
        await w.fair.release_some()
        order += await take(w)
    assert order == ["a1", "b1", "a2", "a3", "a4"]
    assert len(w.fair.queue) == 0 and (await w.redis.xpending(w.source.key, w.group))["pending"] == 0
    assert w.load()["held"] == 0


async def test_a_job_aborted_while_held_ends_when_its_turn_comes(fair_worker):
    w = fair_worker
    await w._deliver(await read(w, of("a", "gone"), of("a", "kept")), claimed=False)
    await w.redis.set(w.keys.abort("gone"), "client")
    await w.fair.release_some()
    assert await take(w) == ["kept"]
    assert await w.redis.hget(w.keys.request("gone"), "status") == b"aborted"
    assert (await w.redis.xpending(w.source.key, w.group))["pending"] == 0


async def test_held_jobs_a_peer_claimed_are_dropped(fair_worker):
    w = fair_worker
    entries = await read(w, of("a", "a0"), of("a", "a1"))
    await w._deliver(entries, claimed=False)
    w.lost([entries[0][0]])
    assert [h.job.uid for h in w.fair.queue.items()] == ["a1"]
