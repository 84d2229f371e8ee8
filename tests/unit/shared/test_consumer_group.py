"""A consumer group's consumer (shared/consumer_group.py) against a real redis-server: backlog, dead letters,
claims, touch, hand-back, trimming, departed consumers."""

from __future__ import annotations

import pytest

from shared import streams
from tests.support.helpers import async_wait_for
from tests.unit.shared.schedule_entries import consumer, held_idle, job

pytestmark = pytest.mark.timeout(30)


async def test_backlog_written_before_the_group_is_read(env):
    redis, keys = env
    for i in range(3):
        await streams.add(redis, keys.schedule("m"), job(f"u{i}"))
    c = consumer(redis, keys, "a")
    await c.ensure_group()
    await c.ensure_group()  # idempotent
    got = await c.read(10, None)
    assert [d.msg.uid for d in got] == ["u0", "u1", "u2"]
    raw = await redis.xrange(keys.schedule("m"))
    assert b'"kind":"schedule"' in raw[0][1][b"data"]  # legible JSON for redis-cli


async def test_poison_goes_to_dead_letter_and_is_acked(env):
    redis, keys = env
    c = consumer(redis, keys, "a")
    await c.ensure_group()
    await redis.xadd(keys.schedule("m"), {"data": b"{oops"})
    await redis.xadd(keys.schedule("m"), {"data": b'{"kind": "schedule", "uid": 5}'})
    await streams.add(redis, keys.schedule("m"), job("good"))
    got = await c.read(10, None)
    assert [d.msg.uid for d in got] == ["good"]
    dead = await redis.xrange(keys.dead())
    assert len(dead) == 2 and b"DecodeError" in dead[0][1][b"error"] and dead[0][1][b"raw_data"] == b"{oops"
    assert (await redis.xpending(keys.schedule("m"), "scheduler"))["pending"] == 1  # only the good one


async def test_claim_takes_a_dead_consumers_entries(env):
    redis, keys = env
    dead, peer = consumer(redis, keys, "dead"), consumer(redis, keys, "peer")
    await dead.ensure_group()
    await streams.add(redis, keys.schedule("m"), job("x"))
    assert len(await dead.read(10, None)) == 1
    assert await peer.claim(min_idle_ms=60_000, count=10) == []
    await async_wait_for(lambda: held_idle(redis, keys.schedule("m"), "dead", 100))
    claimed = await peer.claim(min_idle_ms=100, count=10)
    assert [d.msg.uid for d in claimed] == ["x"]
    assert await peer.pending_ids() == [claimed[0].entry_id]


async def test_hand_back_makes_entries_claimable_at_once(env):
    redis, keys = env
    leaving, peer = consumer(redis, keys, "leaving"), consumer(redis, keys, "peer")
    await leaving.ensure_group()
    await streams.add(redis, keys.schedule("m"), job("y"))
    got = await leaving.read(10, None)
    await leaving.hand_back([got[0].entry_id], "handoff")
    assert [d.msg.uid for d in await peer.claim(min_idle_ms=10_000, count=10)] == ["y"]


async def test_trim_keeps_what_is_pending(env):
    redis, keys = env
    c = consumer(redis, keys, "a")
    await c.ensure_group()
    for i in range(300):
        await streams.add(redis, keys.schedule("m"), job(f"u{i}"))
    got = await c.read(300, None)
    await c.ack([d.entry_id for d in got[:250]])
    await c.trim_acknowledged()
    remaining = [e[0].decode() for e in await redis.xrange(keys.schedule("m"))]
    assert all(d.entry_id in remaining for d in got[250:])  # pending entries survive
    assert len(remaining) < 300


async def test_claims_reach_a_dead_consumers_entries_behind_many_live_ones(env):
    """200 entries held by a live peer (kept fresh), then 50 of a dead one: XAUTOCLAIM scans COUNT x 10
    entries per call, so only a claimer that goes on from the returned cursor ever reaches the 50."""
    redis, keys = env
    for i in range(250):
        await streams.add(redis, keys.schedule("m"), job(f"u{i}"))
    live, dead, claimer = (consumer(redis, keys, n) for n in ("live", "dead", "claimer"))
    await live.ensure_group()
    held = [d.entry_id for d in await live.read(200, None)]
    await dead.read(50, None)
    await async_wait_for(lambda: held_idle(redis, keys.schedule("m"), "dead", 200))
    claimed: list[str] = []
    for _ in range(6):
        await live.touch(held)  # the live peer keeps its entries fresh between our claims
        claimed += [d.msg.uid for d in await claimer.claim(min_idle_ms=200, count=16)]
    assert sorted(claimed) == sorted(f"u{i}" for i in range(200, 250))


async def test_touch_keeps_only_our_entries_and_reports_the_ones_a_peer_took(env):
    """A stalled owner that comes back must not take its entry back from the peer that claimed it (the two
    would take it from each other for ever): touch refreshes what is still ours and names what is not."""
    redis, keys = env
    owner, peer, ids = await one_of_two_claimed(redis, keys, "u")
    assert await owner.touch(ids) == ids[:1]  # lost to the peer
    assert await owner.pending_ids() == ids[1:] and await peer.pending_ids() == ids[:1]


async def test_a_stalled_owner_acknowledges_only_what_it_still_holds(env):
    """A scheduler frozen past the claim idle time can finish a request a peer has taken over before it learns of
    the claim: its acknowledgement must leave the peer's entry pending (the peer would otherwise find it gone and
    drop the request, which nobody then finishes), on a pipeline as the scheduler sends it."""
    redis, keys = env
    owner, peer, ids = await one_of_two_claimed(redis, keys, "a")
    async with redis.pipeline(transaction=False) as pipe:
        owner.ack_own_in(pipe, ids)
        await pipe.execute()
    assert await owner.pending_ids() == [] and await peer.pending_ids() == ids[:1]
    async with redis.pipeline(transaction=False) as pipe:
        peer.ack_own_in(pipe, ids)
        await pipe.execute()
    assert await peer.pending_ids() == []


async def test_touch_and_acknowledgement_look_up_the_owner_once_however_many_entries(own_env):
    """A scheduler touches every entry it runs and acknowledges all a step ended: one XPENDING each (of the
    consumer's entries between the lowest and highest id), not one per entry; entries of another consumer in
    that range, before and after ours, stay out."""
    redis, keys = own_env
    owner, peer, ids = await one_of_two_claimed(redis, keys, "x")
    for i in range(40):
        await streams.add(redis, keys.schedule("m"), job(f"y{i}"))
    more = [d.entry_id for d in await owner.read(40, None)]
    await streams.add(redis, keys.schedule("m"), job("z"))
    [last] = [d.entry_id for d in await peer.read(1, None)]

    async def xpending_calls() -> int:
        return (await redis.info("commandstats")).get("cmdstat_xpending", {}).get("calls", 0)

    before = await xpending_calls()
    assert await owner.touch([*ids, *more, last]) == [ids[0], last]  # the peer's, first and last in the range
    async with redis.pipeline(transaction=False) as pipe:
        owner.ack_own_in(pipe, [*ids, *more[:30], last])
        await pipe.execute()
    assert await xpending_calls() - before == 2
    assert await owner.pending_ids() == more[30:] and sorted(await peer.pending_ids()) == sorted([ids[0], last])


async def test_departed_consumers_are_removed_unless_they_hold_entries(env):
    redis, keys = env
    await streams.add(redis, keys.schedule("m"), job("u0"))
    gone, holder, me = (consumer(redis, keys, n) for n in ("gone@1", "holder@2", "me@3"))
    await me.ensure_group()
    await gone.read(1, None)  # creates the consumer (reads nothing further)
    await gone.ack([d for d in await gone.pending_ids()])
    await streams.add(redis, keys.schedule("m"), job("u1"))
    await holder.read(1, None)
    removed = await me.remove_departed(alive={"me@3"}, idle_ms=0)
    assert removed == ["gone@1"]
    names = {c["name"].decode() for c in await redis.xinfo_consumers(keys.schedule("m"), "scheduler")}
    assert names == {"holder@2"}  # it holds an entry: deleting it would lose it


async def test_a_consumer_that_took_an_entry_since_the_look_is_not_removed(env):
    """XGROUP DELCONSUMER drops the pending entries of the consumer it deletes. A frozen process let go may read
    between XINFO CONSUMERS and the delete; its entry must stay claimable, so the delete checks again."""
    redis, keys = env
    late, me = consumer(redis, keys, "late@4"), consumer(redis, keys, "me@3")
    await me.ensure_group()
    await streams.add(redis, keys.schedule("m"), job("u1"))
    [done] = await late.read(1, None)
    await late.ack([done.entry_id])  # the consumer exists, holding nothing
    looked = await redis.xinfo_consumers(keys.schedule("m"), "scheduler")
    assert [(c["name"], c["pending"]) for c in looked] == [(b"late@4", 0)]
    await streams.add(redis, keys.schedule("m"), job("u2"))
    [taken] = await late.read(1, None)  # ... and now holds an entry

    async def stale_look(*_args):
        return looked

    redis.xinfo_consumers = stale_look  # what the remover saw a moment before
    assert await me.remove_departed(alive={"me@3"}, idle_ms=0) == []
    del redis.xinfo_consumers
    assert await late.pending_ids() == [taken.entry_id]


async def one_of_two_claimed(redis, keys, prefix: str):
    """Two entries read by `owner`, idle past 200 ms; `peer` claimed the first. (owner, peer, the two ids)"""
    for i in range(2):
        await streams.add(redis, keys.schedule("m"), job(f"{prefix}{i}"))
    owner, peer = consumer(redis, keys, "owner"), consumer(redis, keys, "peer")
    await owner.ensure_group()
    ids = [d.entry_id for d in await owner.read(2, None)]
    await async_wait_for(lambda: held_idle(redis, keys.schedule("m"), "owner", 200))
    assert [d.entry_id for d in await peer.claim(min_idle_ms=200, count=1)] == ids[:1]
    return owner, peer, ids
