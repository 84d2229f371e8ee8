"""Prefix-aware routing's parts against a real redis-server: the tokenizer's choice (leading pages, load weight,
fallback) in one round trip, what a scheduler publishes of its cache, a consumer's lanes (own stream before the
shared one, claims, keep-alive, hand-back across streams), and the end of a departed scheduler's stream."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from services.scheduler.lanes import SchedulerLanes
from services.tokenizer.router import (
    MAX_SCORED_PAGES,
    Candidate,
    Policy,
    Router,
    choose,
    choose_for_adapter,
    leading,
    prompt_pages,
)
from shared import streams
from shared.consumer_group import GroupConsumer
from shared.keys import Keys
from shared.messages import SamplingParams, ScheduleJob
from shared.pages import chain_digest
from shared.redis_conn import connect
from shared.slots import key_slot
from shared.streams import Member
from tests.support.helpers import async_wait_for
from tests.unit.shared.schedule_entries import held_idle

pytestmark = pytest.mark.timeout(30)
MODEL = "m"
IDLE_MS = 300  # a claim's min-idle: wide enough that no pause between a touch and the next claim reaches it


def job(uid: str, ids: list[int] | None = None, adapter: str | None = None) -> ScheduleJob:
    return ScheduleJob(uid=uid, model=MODEL, pod="p", created_at=0.0, deadline=1.0, params=SamplingParams(),
                       input_ids=ids or [1, 2], adapter=adapter)


def consumer(redis, keys: Keys, name: str) -> GroupConsumer:
    c = GroupConsumer(redis, keys.schedule(MODEL), Member("scheduler", name), ScheduleJob, keys.dead())
    c.lane_key = lambda lane: keys.scheduler_stream(MODEL, lane)
    return c


async def blocked_reads(redis) -> int:
    """Clients of the redis-server blocked in an XREADGROUP now."""
    return sum(c["cmd"] == "xreadgroup" and "b" in c["flags"] for c in await redis.client_list())


# ---- keys and digests


def test_routing_keys_share_the_slot_of_the_models_schedule_stream():
    keys = Keys("ns")
    for model in ("rsinfer-demo", "Qwen3-0.6B", "m"):
        slot = key_slot(keys.schedule(model))
        assert key_slot(keys.scheduler_stream(model, "sched@1.ab")) == slot
        assert key_slot(keys.cached_pages(model, "sched@1.ab")) == slot
        assert key_slot(keys.routed(model)) == slot
        assert key_slot(keys.prefix_routing(model)) == slot
        assert keys.scheduler_stream(model, "a") != keys.scheduler_stream(model, "b")


def test_prompt_pages_are_the_pages_an_engine_could_read_from_its_cache():
    ids = list(range(100, 137))  # 37 tokens, page size 4: 9 full pages, the last token's page computed
    pages = prompt_pages(ids, 4)
    assert len(pages) == 9
    assert pages[0] == chain_digest(b"", ids[:4]).hex()
    assert pages[1] == chain_digest(bytes.fromhex(pages[0]), ids[4:8]).hex()
    assert len(prompt_pages(list(range(36)), 4)) == 8  # a prompt ending on a page boundary: its last is computed
    assert prompt_pages([1, 2, 3], 4) == []
    assert len(prompt_pages(list(range(4 * (MAX_SCORED_PAGES + 10))), 4)) == MAX_SCORED_PAGES


# ---- the choice


def test_leading_pages_stop_at_the_first_page_not_held():
    assert leading(["a", "b", "c"], {"a", "b", "c"}) == 3
    assert leading(["a", "b", "c"], {"a", "c"}) == 1
    assert leading(["a", "b", "c"], {"b", "c"}) == 0


def test_choose_weighs_cached_tokens_against_load_and_falls_back_to_the_shared_stream():
    assert choose({"s1": 512, "s2": 0}, {"s1": 0, "s2": 0}, 64) == "s1"
    assert choose({"s1": 512, "s2": 256}, {"s1": 0, "s2": 0}, 64) == "s1"
    assert choose({"s1": 512, "s2": 256}, {"s1": 5, "s2": 0}, 64) == "s2"  # 512 - 320 < 256
    assert choose({"s1": 512, "s2": 0}, {"s1": 9, "s2": 0}, 64) is None  # an idle one without it beats it: shared
    assert choose({"s1": 0, "s2": 0}, {"s1": 0, "s2": 3}, 64) is None  # no hit anywhere: shared
    assert choose({}, {}, 64) is None
    assert choose({"s1": 64, "s2": 64}, {"s1": 2, "s2": 1}, 0) == "s2"  # a tie goes to the less loaded


async def test_router_sends_each_job_to_the_scheduler_holding_its_prefix_in_one_round_trip(env):
    redis, keys = env
    shared_prefix = list(range(1000, 1064))  # 4 pages of 16
    other = list(range(2000, 2064))
    await redis.sadd(keys.cached_pages(MODEL, "s1"), *prompt_pages([*shared_prefix, 7], 16))
    await redis.sadd(keys.cached_pages(MODEL, "s2"), *prompt_pages([*other, 7], 16)[:2])
    router = Router(redis, keys, MODEL, heartbeat_ttl_s=5, policy=Policy(16))
    router.candidates = [Candidate("s1", 16, 0.0), Candidate("s2", 16, 0.0)]
    jobs = [job("a", [*shared_prefix, 1, 2]), job("b", [*other, 3]), job("c", [5] * 40), job("d", [9]),
            job("e", shared_prefix[:16] + other)]  # e: one page on s1 (the next differs), none on s2
    pipelines = 0
    real = redis.pipeline

    def counted(*a, **kw):
        nonlocal pipelines
        pipelines += 1
        return real(*a, **kw)

    redis.pipeline = counted
    try:
        assert await router.route(jobs) == ["s1", "s2", None, None, "s1"]
    finally:
        redis.pipeline = real
    assert pipelines == 1
    assert [router.load(c) for c in router.candidates] == [2.0, 1.0]  # what it sent counts until their next beat
    router.candidates[0].beat_at = time.time() + 1  # s1 beat since, counting them itself
    assert [router.load(c) for c in router.candidates] == [0.0, 1.0]


async def test_router_bounds_skew_by_the_unfinished_jobs_of_each_schedulers_own_stream(env):
    """Its heartbeat says s1 is idle, but its own stream holds 5 jobs it has not finished (3 unread, 2 read and
    not acknowledged): past a skew of 4 over idle s2, its cached prefix goes to the shared stream; once it
    finished them, to s1 again (jobs that ended since its beat are no backlog)."""
    redis, keys = env
    prefix = list(range(1000, 1064))
    await redis.sadd(keys.cached_pages(MODEL, "s1"), *prompt_pages([*prefix, 7], 16))
    lane = keys.scheduler_stream(MODEL, "s1")
    await redis.xgroup_create(lane, "scheduler", id="0", mkstream=True)
    for i in range(5):
        await redis.xadd(lane, {"n": i})
    read = await redis.xreadgroup("scheduler", "s1", {lane: ">"}, count=2)
    router = Router(redis, keys, MODEL, heartbeat_ttl_s=5, policy=Policy(16, max_skew=4))
    router.candidates = [Candidate("s1", 16, 0.0), Candidate("s2", 16, 0.0)]
    assert await router.route([job("a", [*prefix, 1])]) == [None]
    await redis.xack(lane, "scheduler", *(entry_id for entry_id, _ in read[0][1]))
    await redis.xreadgroup("scheduler", "s1", {lane: ">"})  # read the 3 others: 3 pending, within the bound
    batch = [job("b", [*prefix, 2]), job("c", [*prefix, 3]), job("d", [*prefix, 4])]
    assert await router.route(batch) == ["s1", "s1", None]  # 3, then 4, then 5 with the batch's own


async def test_router_takes_live_schedulers_that_publish_from_their_heartbeats(env):
    redis, keys = env
    now = time.time()
    for wid, model, load in (("s1", MODEL, {"prefix_page_size": 16, "running": 3, "waiting": 1}),
                             ("s2", MODEL, {"prefix_page_size": 0, "running": 0}),  # no prefix cache
                             ("s3", "other", {"prefix_page_size": 16})):
        await redis.hset(keys.worker("scheduler", wid), mapping={"role": "scheduler", "id": wid, "model": model,
                                                                 "updated_at": now, "load": _json(load)})
        await redis.zadd(keys.workers(), {f"scheduler:{wid}": now})
    router = Router(redis, keys, MODEL, heartbeat_ttl_s=5, policy=Policy(16))
    await router.refresh()
    assert router.candidates == [Candidate("s1", 16, 4.0, now)]


def test_an_adapter_goes_where_it_is_loaded_then_where_a_slot_is_free_then_to_the_shared_stream():
    a = Candidate("a", 16, 5.0, adapters=frozenset({"sql"}), free_slots=0)
    b = Candidate("b", 16, 0.0, adapters=frozenset({"chat"}), free_slots=1)
    c = Candidate("c", 16, 1.0, adapters=frozenset({"sql"}), free_slots=2)
    load = {"a": 5.0, "b": 0.0, "c": 1.0}
    assert choose_for_adapter("sql", [a, b, c], load) == "c"  # both hold it: the less loaded
    assert choose_for_adapter("chat", [a, b, c], load) == "b"
    assert choose_for_adapter("kv", [a, b, c], load) == "b"  # none holds it: a free slot, the less loaded
    assert choose_for_adapter("kv", [a], load) is None  # nowhere to load it without evicting: shared stream


async def test_router_routes_adapter_jobs_by_adapter_and_the_rest_by_prefix(env):
    redis, keys = env
    prefix = list(range(1000, 1064))
    await redis.sadd(keys.cached_pages(MODEL, "s1"), *prompt_pages([*prefix, 7], 16))
    router = Router(redis, keys, MODEL, heartbeat_ttl_s=5, policy=Policy(16))
    router.candidates = [Candidate("s1", 16, 0.0, adapters=frozenset({"sql"})),
                         Candidate("s2", 16, 0.0, free_slots=1)]
    jobs = [job("a", [*prefix, 1], adapter="chat"), job("b", [*prefix, 2]), job("c", [*prefix, 3], adapter="sql"),
            job("d", [5], adapter="chat"), job("e", [6], adapter="kv")]
    # a: nobody holds chat, s2 has a slot (and holds it from then on: d follows it); b: its prefix is on s1;
    # c: s1 holds sql (its prefix pages are the base model's, never scored for an adapter); e: no slot left
    assert await router.route(jobs) == ["s2", "s1", "s1", "s2", None]
    assert await router.route([job("f", [1], adapter="chat")]) == ["s2"]


async def test_router_reads_the_adapters_and_free_slots_of_each_scheduler_from_its_heartbeat(env):
    redis, keys = env
    now = time.time()
    load = {"prefix_page_size": 16, "lora_slots": 3, "lora_resident": 2, "lora_adapters": ["sql@1a2b", "o/x@9"]}
    await redis.hset(keys.worker("scheduler", "s1"), mapping={"role": "scheduler", "id": "s1", "model": MODEL,
                                                              "updated_at": now, "load": _json(load)})
    await redis.zadd(keys.workers(), {"scheduler:s1": now})
    router = Router(redis, keys, MODEL, heartbeat_ttl_s=5, policy=Policy(16))
    await router.refresh()
    assert router.candidates == [Candidate("s1", 16, 0.0, now, frozenset({"sql", "o/x"}), 1)]


async def test_an_adapter_sent_to_a_scheduler_counts_as_loaded_there_until_its_heartbeat_can_say_so(env):
    redis, keys = env
    now = time.time()
    for wid in ("s1", "s2"):
        load = {"prefix_page_size": 16, "lora_slots": 1, "lora_resident": 0, "lora_adapters": []}
        await redis.hset(keys.worker("scheduler", wid), mapping={"role": "scheduler", "id": wid, "model": MODEL,
                                                                 "updated_at": now, "load": _json(load)})
        await redis.zadd(keys.workers(), {f"scheduler:{wid}": now})
    router = Router(redis, keys, MODEL, heartbeat_ttl_s=5, policy=Policy(16))
    await router.refresh()
    assert await router.route([job("a", adapter="sql")]) == ["s1"]
    await router.refresh()  # s1's heartbeat does not show sql loaded yet
    assert await router.route([job("b", adapter="chat"), job("c", adapter="sql")]) == ["s2", "s1"]
    assert await router.route([job("d", adapter="kv")]) == [None]  # every slot taken: the shared stream


def _json(d: dict) -> str:
    import json

    return json.dumps(d)


# ---- what a scheduler publishes


async def beat(redis, hook) -> None:
    """One heartbeat's pipeline with `hook`'s commands on it (shared/heartbeats.py Heartbeat.extra)."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.ping()  # the heartbeat's own commands come first
        then = hook(pipe)
        replies = await pipe.execute()
    if then is not None:
        then(replies[1:])


async def test_a_scheduler_joins_routing_only_once_a_tokenizer_routes(env):
    """Without the flag a routing tokenizer sets with its heartbeat, a scheduler opens no stream of its own, says
    no page size and publishes nothing; it joins at its first adopt after a beat that sees the flag, or at start."""
    redis, keys = env
    c = consumer(redis, keys, "s1")
    lanes = SchedulerLanes(redis, keys, MODEL, c, page_size=16, heartbeat_ttl_s=5)
    await lanes.start()
    await lanes.adopt()
    asked: list[bool] = []
    assert not lanes.joined and lanes.advertised_page_size == 0 and c.lanes == {}
    assert lanes.pages_due(lambda: asked.append(True) or ([b"\x01" * 16], []), lambda: []) is None
    assert asked == []  # the engine's changes are not even asked for
    assert await redis.smembers(keys.routed(MODEL)) == set()
    await beat(redis, Router(redis, keys, MODEL, heartbeat_ttl_s=5, policy=Policy(16), tokenizer_id="t1").on_beat)
    assert 0 < await redis.pttl(keys.prefix_routing(MODEL)) <= 5000  # the flag lives as long as that heartbeat
    await beat(redis, lanes.on_beat)
    assert not lanes.joined  # joined by the next adopt, in the loop, not in the heartbeat
    await lanes.adopt()
    assert lanes.joined and lanes.advertised_page_size == 16 and c.lanes == {"s1": True}
    assert await redis.smembers(keys.routed(MODEL)) == {b"s1"}
    later = SchedulerLanes(redis, keys, MODEL, consumer(redis, keys, "s2"), page_size=16, heartbeat_ttl_s=5)
    await later.start()  # a scheduler that starts while a tokenizer routes joins before its first heartbeat
    assert later.joined and await redis.smembers(keys.routed(MODEL)) == {b"s1", b"s2"}
    cacheless = SchedulerLanes(redis, keys, MODEL, consumer(redis, keys, "s3"), page_size=0,
                               heartbeat_ttl_s=5)
    await cacheless.start()  # no prefix cache: nothing to route to it, but it drains departed peers' streams
    assert not cacheless.joined and cacheless.others


async def test_a_scheduler_publishes_its_cache_changes_with_a_ttl_and_again_after_the_set_is_lost(env):
    redis, keys = env
    c = consumer(redis, keys, "s1")
    await redis.set(keys.prefix_routing(MODEL), "t1")
    lanes = SchedulerLanes(redis, keys, MODEL, c, page_size=16, heartbeat_ttl_s=5)
    await lanes.start()
    assert await redis.smembers(keys.routed(MODEL)) == {b"s1"}
    a, b, d = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16

    def due(cached: list[bytes], evicted: list[bytes], everything: list[bytes]):
        return lanes.pages_due(lambda: (cached, evicted), lambda: everything)

    async def send(changes) -> None:
        async with redis.pipeline(transaction=False) as pipe:
            lanes.write_pages(pipe, changes)
            await pipe.execute()

    assert due([], [], []) is None  # joined: the whole cache is due, and it is empty
    await beat(redis, lanes.on_beat)  # no set yet (nothing cached): a resync of nothing writes nothing
    assert due([], [], []) is None
    await send(due([a, b], [], []))
    assert await redis.smembers(lanes.pages_key) == {a.hex().encode(), b.hex().encode()}
    assert 0 < await redis.pttl(lanes.pages_key) <= 5000
    await send(due([d], [a], []))
    assert await redis.smembers(lanes.pages_key) == {b.hex().encode(), d.hex().encode()}
    assert due([], [], []) is None  # nothing changed: nothing on the step's pipeline
    await redis.delete(lanes.pages_key)  # Redis lost it (restarted empty, or the TTL passed in a partition)
    await beat(redis, lanes.on_beat)
    await send(due([], [], [b, d]))
    assert await redis.smembers(lanes.pages_key) == {b.hex().encode(), d.hex().encode()}
    await lanes.release()
    assert not await redis.exists(lanes.pages_key, keys.scheduler_stream(MODEL, "s1"))
    assert await redis.smembers(keys.routed(MODEL)) == set()


# ---- lanes


async def test_lanes_are_read_first_and_never_past_the_count(env):
    redis, keys = env
    c = consumer(redis, keys, "s1")
    await c.add_lane("s1", create=True)
    await c.ensure_group()
    for i in range(3):
        await streams.add(redis, keys.schedule(MODEL), job(f"shared{i}"))
        await streams.add(redis, keys.scheduler_stream(MODEL, "s1"), job(f"own{i}"))
    got = await c.read(4, None)
    assert [d.msg.uid for d in got] == ["own0", "own1", "own2", "shared0"]
    assert got[0].entry_id.startswith("s1/") and "/" not in got[3].entry_id
    assert [d.msg.uid for d in await c.read(10, None)] == ["shared1", "shared2"]
    began = time.monotonic()
    assert await c.read(10, 100) == []  # blocks over every stream, then gives up
    assert time.monotonic() - began >= 0.09

    blocked_before = await blocked_reads(redis)

    async def blocked() -> bool:
        return await blocked_reads(redis) > blocked_before

    async def later() -> None:  # once the read below blocks
        await async_wait_for(blocked)
        await streams.add(redis, keys.scheduler_stream(MODEL, "s1"), job("own3"))

    task = asyncio.create_task(later())
    assert [d.msg.uid for d in await c.read(10, 2000)] == ["own3"]  # a blocked read wakes on a lane too
    await task
    await c.ack([d.entry_id for d in got])
    assert (await redis.xpending(keys.scheduler_stream(MODEL, "s1"), "scheduler"))["pending"] == 1  # own3
    assert (await redis.xpending(keys.schedule(MODEL), "scheduler"))["pending"] == 2  # shared1, shared2


async def test_entries_of_a_lane_are_claimed_kept_alive_and_handed_back_like_the_main_streams(env):
    redis, keys = env
    dead, peer = consumer(redis, keys, "dead"), consumer(redis, keys, "peer")
    await dead.add_lane("dead", create=True)
    await dead.ensure_group()
    await streams.add(redis, keys.scheduler_stream(MODEL, "dead"), job("x"))
    await streams.add(redis, keys.schedule(MODEL), job("y"))
    held = await dead.read(10, None)
    assert len(held) == 2
    assert await peer.add_lane("dead", create=False)
    both = (keys.schedule(MODEL), keys.scheduler_stream(MODEL, "dead"))

    async def idle(ms: int) -> bool:
        return all([await held_idle(redis, key, "dead", ms) for key in both])

    await async_wait_for(lambda: idle(IDLE_MS))
    assert await dead.touch([d.entry_id for d in held]) == []  # still its own: reset, not lost
    assert await peer.claim(min_idle_ms=IDLE_MS, count=10) == []
    await async_wait_for(lambda: idle(IDLE_MS))
    claimed = await peer.claim(min_idle_ms=IDLE_MS, count=10)
    assert sorted(d.msg.uid for d in claimed) == ["x", "y"]
    assert sorted(await peer.pending_ids()) == sorted(d.entry_id for d in claimed)
    assert sorted(await dead.touch([d.entry_id for d in held])) == sorted(d.entry_id for d in held)  # lost
    await peer.hand_back(await peer.pending_ids(), "handoff")
    assert await peer.pending_ids() == []
    again = await peer.claim(min_idle_ms=1000, count=10)  # handed back: idle maxed, claimable at once
    assert sorted(d.msg.uid for d in again) == ["x", "y"]


async def test_a_lane_whose_stream_is_gone_is_let_go(env):
    redis, keys = env
    c = consumer(redis, keys, "s1")
    assert not await c.add_lane("nobody", create=False)
    await streams.add(redis, keys.scheduler_stream(MODEL, "gone"), job("z"))
    assert await c.add_lane("gone", create=False)
    await redis.delete(keys.scheduler_stream(MODEL, "gone"))
    assert await c.read(10, None) == []  # NOGROUP: the group is not made again on a stream not ours
    assert "gone" not in c.lanes and not await redis.exists(keys.scheduler_stream(MODEL, "gone"))


async def test_a_departed_schedulers_stream_ends_only_when_nothing_in_it_is_left_to_run(env):
    redis, keys = env
    key, pages, routed = keys.scheduler_stream(MODEL, "d"), keys.cached_pages(MODEL, "d"), keys.routed(MODEL)
    c = consumer(redis, keys, "peer")

    async def end() -> int:
        return await streams.end_if_drained(redis, key, "scheduler", companion=pages, registry=routed, member="d")

    await redis.sadd(routed, "d", "other")
    await redis.sadd(pages, "ab")
    await streams.add(redis, key, job("u"))
    assert await end() == 0  # no group yet: a tokenizer wrote to it after it was ended once
    assert await c.add_lane("d", create=False)
    assert await end() == 0  # undelivered
    [d] = await c.read(10, None)
    assert await end() == 0  # pending
    await c.ack([d.entry_id])
    assert await end() == 1
    assert not await redis.exists(key, pages)
    assert await redis.smembers(routed) == {b"other"}
    assert await end() == 1  # already gone: only its name, if any, to remove


async def test_on_a_redis_cluster_lanes_routing_and_ending_name_keys_of_one_slot(redis_cluster):
    """Every multi-key command routing adds (the ordered read, the blocking read over all streams, the end
    script) works on a real cluster: the keys share the slot of the model's schedule stream."""
    redis = connect(redis_cluster.url)
    keys = Keys(f"c{uuid.uuid4().hex[:6]}")
    try:
        c = consumer(redis, keys, "s1")
        await c.add_lane("s1", create=True)
        await c.ensure_group()
        await streams.add(redis, keys.schedule(MODEL), job("shared"))
        await streams.add(redis, keys.scheduler_stream(MODEL, "s1"), job("own"))
        assert [d.msg.uid for d in await c.read(10, None)] == ["own", "shared"]
        assert await c.read(10, 50) == []  # XREADGROUP BLOCK over both streams
        ids = prompt_pages(list(range(100, 140)), 16)
        await redis.sadd(keys.cached_pages(MODEL, "s1"), *ids)
        router = Router(redis, keys, MODEL, heartbeat_ttl_s=5, policy=Policy(16))
        router.candidates = [Candidate("s1", 16, 0.0)]
        assert await router.route([job("a", list(range(100, 140)))]) == ["s1"]
        await redis.sadd(keys.routed(MODEL), "s1")
        await c.ack(await c.pending_ids())
        assert await streams.end_if_drained(redis, keys.scheduler_stream(MODEL, "s1"), "scheduler",
                                            companion=keys.cached_pages(MODEL, "s1"), registry=keys.routed(MODEL),
                                            member="s1") == 1
        assert not await redis.exists(keys.scheduler_stream(MODEL, "s1"))
    finally:
        await redis.aclose()
