"""A scheduler's side of prefix-aware routing against a real redis-server: off until a tokenizer routes (one
XREADGROUP, nothing published), then the paged engine's cached pages are published on the step pipeline (the same
digests the tokenizer computes), its own stream is read and handed back, and a departed scheduler's stream, read
or not, is drained by a peer and then ended; a live one's is left alone."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from services.scheduler.main import build_worker
from services.tokenizer.router import Policy, Router, prompt_pages
from shared import streams
from shared.consumer_group import GroupConsumer
from shared.messages import SamplingParams, ScheduleJob
from shared.settings import SchedulerSettings
from shared.streams import Member

pytestmark = pytest.mark.timeout(60)
MODEL = "demo"
UNTIL_S = 20.0


@pytest.fixture
async def make(redis_server, random_model_dir):
    namespace = f"route{uuid.uuid4().hex[:6]}"
    workers = []

    async def make(name: str, **kw):
        base = dict(engine="synthetic", step_ms=0) if kw.pop("synthetic", True) else dict(threads=1)
        settings = SchedulerSettings(redis_url=redis_server.url, namespace=namespace, worker_id=name,
                                     claim_idle_ms=200, heartbeat_ttl_s=2, **{**base, **kw})
        w = await build_worker(settings, str(random_model_dir), MODEL)
        workers.append(w)
        return w

    yield make
    for w in workers:
        await w.close()


def job(uid: str, max_tokens: int, ids: list[int] | None = None) -> ScheduleJob:
    return ScheduleJob(uid=uid, model=MODEL, pod="api-x", created_at=0.0, deadline=1e12, background=True,
                       params=SamplingParams(max_tokens=max_tokens), input_ids=ids or [5, 6, 7])


async def a_tokenizer_routes(w) -> None:
    """What a tokenizer with --prefix-routing does with every heartbeat: set the model's routing flag."""
    async with w.redis.pipeline(transaction=False) as pipe:
        Router(w.redis, w.keys, MODEL, heartbeat_ttl_s=60, policy=Policy(64)).on_beat(pipe)
        await pipe.execute()


async def ran(w, uid: str) -> bool:
    """The worker admitted the request and it has ended there (its entry acknowledged)."""
    owner = await w.redis.hget(w.keys.request(uid), "scheduler")
    return owner == w.id.encode() and uid not in w.book.running


def brisk(w) -> None:
    """An idle iteration's read blocks 50 ms, not a second: these tests step a worker until a condition holds, and
    an idle read waits only for entries that nobody will write."""
    read = w.source.read
    w.source.read = lambda count, block_ms: read(count, None if block_ms is None else min(block_ms, 50))


async def until(check) -> None:
    """Poll `check` (state in Redis and in the worker, which no event announces) for up to UNTIL_S."""
    deadline = time.monotonic() + UNTIL_S
    while not await check():
        assert time.monotonic() < deadline, "condition not met"
        await asyncio.sleep(0.01)


async def test_a_plain_scheduler_reads_with_one_xreadgroup_and_publishes_nothing(make, monkeypatch):
    w = await make("plain", synthetic=False, max_kv_tokens=1024, page_size=8)
    await w.start()
    assert w.load()["prefix_page_size"] == 0 and w.source.lanes == {}  # no tokenizer routes to it
    ordered_reads = []
    monkeypatch.setattr(GroupConsumer, "_read_lanes", lambda *a: ordered_reads.append(a))
    await streams.add(w.redis, w.source.key, job("q1", 4, list(range(40, 81))))
    w._last.pop("claim", None)  # a claim round (and its adopt) is due too
    batch, claimed = await w.work(receive=True)
    assert [d.msg.uid for d in batch] == ["q1"] and not ordered_reads
    await w.admit(batch, claimed)
    while w.engine.has_work():
        await w.work()
    await w.flush()
    assert await ran(w, "q1") and w.engine.stats()["cached_pages"] > 0
    assert not await w.redis.exists(w.keys.cached_pages(MODEL, w.id), w.keys.scheduler_stream(MODEL, w.id))
    assert await w.redis.smembers(w.keys.routed(MODEL)) == set()


async def test_a_running_scheduler_joins_routing_when_a_tokenizer_starts_routing(make):
    w = await make("joins", synthetic=False, max_kv_tokens=1024, page_size=8)
    await w.start()
    prompt = list(range(40, 81))
    await streams.add(w.redis, w.source.key, job("j1", 4, prompt))
    batch, claimed = await w.work(receive=True)
    await w.admit(batch, claimed)
    while w.engine.has_work():
        await w.work()
    await w.flush()
    await a_tokenizer_routes(w)
    await w.heartbeat.beat()  # its heartbeat's pipeline sees the flag ...
    w._last.pop("claim", None)
    await w.receive(block_ms=None)  # ... and the next claim round joins
    assert w.source.lanes == {w.id: True} and w.load()["prefix_page_size"] == 8
    assert await w.redis.smembers(w.keys.routed(MODEL)) == {w.id.encode()}
    await streams.add(w.redis, w.keys.scheduler_stream(MODEL, w.id), job("j2", 2, [1, 2, 3]))
    batch, claimed = await w.work(receive=True)
    assert [d.msg.uid for d in batch] == ["j2"]  # read from its own stream
    await w.admit(batch, claimed)
    while w.engine.has_work():
        await w.work()
    await w.flush()
    published = {d.decode() for d in await w.redis.smembers(w.keys.cached_pages(MODEL, w.id))}
    assert set(prompt_pages(prompt, 8)) <= published  # what it cached before it joined: published at once


async def test_the_pages_a_step_caches_are_published_on_its_pipeline_as_the_tokenizer_names_them(make):
    w = await make("paged", synthetic=False, max_kv_tokens=1024, page_size=8)
    await a_tokenizer_routes(w)
    await w.start()
    assert w.load()["prefix_page_size"] == 8
    assert w.source.lanes == {w.id: True}  # its own stream, read before the shared one
    assert await w.redis.smembers(w.keys.routed(MODEL)) == {w.id.encode()}
    prompt = list(range(40, 81))  # 41 tokens: 5 full pages
    await streams.add(w.redis, w.keys.scheduler_stream(MODEL, w.id), job("p1", 4, prompt))
    batch, claimed = await w.work(receive=True)
    assert [d.msg.uid for d in batch] == ["p1"] and batch[0].entry_id.startswith(f"{w.id}/")
    await w.admit(batch, claimed)
    while w.engine.has_work():
        await w.work()
    await w.flush()
    published = {d.decode() for d in await w.redis.smembers(w.keys.cached_pages(MODEL, w.id))}
    assert set(prompt_pages(prompt, 8)) <= published  # what a tokenizer asks for this prompt: all there
    assert 0 < await w.redis.pttl(w.keys.cached_pages(MODEL, w.id)) <= 2000
    assert (await w.redis.xpending(w.keys.scheduler_stream(MODEL, w.id), "scheduler"))["pending"] == 0  # acked
    await w.close()
    assert not await w.redis.exists(w.keys.cached_pages(MODEL, w.id), w.keys.scheduler_stream(MODEL, w.id))
    assert await w.redis.smembers(w.keys.routed(MODEL)) == set()


async def test_a_departed_schedulers_stream_is_drained_by_a_peer_then_ended(make):
    peer = await make("peer")
    await peer.start()
    brisk(peer)
    r, keys = peer.redis, peer.keys
    # "dead@1" read u1 (pending to it), never read u2, and died; "alive@1" is alive and has u3 waiting
    dead = GroupConsumer(r, keys.schedule(MODEL), Member("scheduler", "dead@1"), ScheduleJob, keys.dead(),
                         lane_key=lambda lane: keys.scheduler_stream(MODEL, lane))
    await dead.add_lane("dead@1", create=True)
    await streams.add(r, keys.scheduler_stream(MODEL, "dead@1"), job("u1", 20))
    assert [d.msg.uid for d in await dead.read(1, None)] == ["u1"]
    await streams.add(r, keys.scheduler_stream(MODEL, "dead@1"), job("u2", 20))
    await r.xgroup_create(keys.scheduler_stream(MODEL, "alive@1"), "scheduler", id="0", mkstream=True)
    await streams.add(r, keys.scheduler_stream(MODEL, "alive@1"), job("u3", 20))
    await r.zadd(keys.workers(), {"scheduler:alive@1": time.time() + 60})
    await r.sadd(keys.routed(MODEL), "dead@1", "alive@1")

    async def both_done() -> bool:
        await peer.iteration()
        return await ran(peer, "u1") and await ran(peer, "u2")

    await until(both_done)
    assert "dead@1" in peer.source.lanes and "alive@1" not in peer.source.lanes
    records = [await r.hgetall(keys.request(u)) for u in ("u1", "u2")]
    assert [rec[b"entry"].decode().split("/")[0] for rec in records] == ["dead@1", "dead@1"]

    async def ended() -> bool:
        await peer.iteration()
        return not await r.exists(keys.scheduler_stream(MODEL, "dead@1"))

    await until(ended)
    assert await r.smembers(keys.routed(MODEL)) == {b"alive@1"}
    assert "dead@1" not in peer.source.lanes
    assert await r.xlen(keys.scheduler_stream(MODEL, "alive@1")) == 1  # a live scheduler's: not read by a peer
    assert not await r.hget(keys.request("u3"), "scheduler")


async def test_on_shutdown_what_it_holds_of_its_own_stream_is_handed_back_and_a_peer_ends_it(make):
    leaving, peer = await make("leaving", synthetic=False, max_kv_tokens=2048), await make("peer")
    await a_tokenizer_routes(leaving)
    await leaving.start()
    await peer.start()
    r, keys = leaving.redis, leaving.keys
    own = keys.scheduler_stream(MODEL, leaving.id)
    await streams.add(r, own, job("h1", 300))
    batch, claimed = await leaving.work(receive=True)
    await leaving.admit(batch, claimed)
    await leaving.work()
    leaving.settings = leaving.settings.model_copy(update={"grace_period_s": 0.0})
    await leaving.drain()  # hands back what it holds of every stream it reads, its own included
    assert (await r.xpending_range(own, "scheduler", "-", "+", 10))[0]["consumer"] == b"handoff"
    await leaving.close()
    assert await r.exists(own)  # something is left in it: its peers end it once drained
    brisk(peer)

    async def taken() -> bool:
        await peer.iteration()
        return "h1" in peer.book.running

    await until(taken)
    assert (await r.hgetall(keys.request("h1")))[b"scheduler"] == peer.id.encode()
