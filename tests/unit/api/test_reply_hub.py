"""The reply hub against a real redis-server: many streams over few connections, sharding, backpressure."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from services.api.answer import reply_hub
from services.api.answer.reply_hub import HubLimits, Inbox, ReplyHub
from shared import slots, streams
from shared.keys import Keys
from shared.messages import ReplyEvent, decode, encode
from shared.redis_conn import connect
from tests.support.helpers import async_wait_for

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def hub_env(redis_server):
    redis = connect(redis_server.url)
    keys = Keys(f"h{uuid.uuid4().hex[:8]}")
    hub = ReplyHub(redis_server.url, {}, redis, keys, "pod-1", limits=HubLimits(shard_keys=8, high_water=16))
    yield hub, redis, keys
    await hub.close()
    await redis.aclose()


async def subscribe(hub: ReplyHub, uid: str) -> Inbox:
    """What a request does: its own inbox, registered with the hub (services/api/answer/request/single.py)."""
    return await hub.subscribe(Inbox(uid, hub.keys.reply(uid)))


def event(i: int) -> ReplyEvent:
    return ReplyEvent(start=i, end=i + 1, text=str(i), prompt_tokens=1)


async def test_many_streams_are_sharded_and_each_gets_its_own_entries(hub_env):
    hub, redis, keys = hub_env
    subs = [await subscribe(hub, f"u{i}") for i in range(20)]
    assert len(hub.shards) == 3 and hub.subscriptions == 20
    for i in range(20):
        # written after the subscription: the blocked read must wake for it
        await streams.add(redis, keys.reply(f"u{i}"), event(i))
    for i, sub in enumerate(subs):
        _, raw = await asyncio.wait_for(sub.get(), 5)
        assert decode(raw, ReplyEvent).start == i
    hub.unsubscribe(subs[0])
    assert hub.subscriptions == 19


async def test_entries_written_before_subscribing_are_not_missed(hub_env):
    hub, redis, keys = hub_env
    await streams.add(redis, keys.reply("early"), event(0))
    sub = await subscribe(hub, "early")
    _, raw = await asyncio.wait_for(sub.get(), 5)
    assert decode(raw, ReplyEvent).start == 0


async def test_a_wake_refreshes_the_control_streams_ttl_once_a_while_not_per_request(hub_env):
    """Issue 34: a request's subscription wakes its shard with one XADD; the control stream's EXPIRE goes with
    the first wake and then once CONTROL_REFRESH_S passed, not with every request's."""
    hub, redis, _ = hub_env
    await subscribe(hub, "w0")
    shard = hub.shards[0]
    assert 0 < await redis.ttl(shard.control) <= reply_hub.CONTROL_TTL_S
    queued = []
    for i in range(3):
        async with redis.pipeline(transaction=False) as pipe:
            hub.register(Inbox(f"w{i + 1}", hub.keys.reply(f"w{i + 1}")), wake_in=pipe)
            queued.append([c[0][0] for c in pipe.command_stack])
            await pipe.execute()
    assert queued == [["XADD"]] * 3
    shard.refreshed_at -= reply_hub.CONTROL_REFRESH_S
    async with redis.pipeline(transaction=False) as pipe:
        shard.wake_in(pipe)
        assert [c[0][0] for c in pipe.command_stack] == ["XADD", "EXPIRE"]


async def test_slow_reader_is_paused_not_buffered(hub_env):
    hub, redis, keys = hub_env
    sub = await subscribe(hub, "slow")
    for i in range(100):
        await streams.add(redis, keys.reply("slow"), event(i))
    await async_wait_for(lambda: sub.paused)  # from then on nothing more is delivered to it
    assert sub.queue.qsize() < 2 * 16  # the rest waits in Redis, not in this process
    got = [decode((await asyncio.wait_for(sub.get(), 5))[1], ReplyEvent).start for _ in range(100)]
    assert got == list(range(100))


async def test_a_reader_that_drains_a_full_queue_is_resumed(hub_env):
    """A reattach to a long finished stream fills the queue past high water in one read; the reader takes it
    all with get() + drain(), and its next get() must resume reading rather than wait forever."""
    hub, redis, keys = hub_env
    for i in range(100):
        await streams.add(redis, keys.reply("long"), event(i))
    sub = await subscribe(hub, "long")
    got: list[int] = []
    while len(got) < 100:
        first = await asyncio.wait_for(sub.get(), 5)
        got += [decode(raw, ReplyEvent).start for _, raw in [first, *sub.drain()]]
    assert got == list(range(100))


@pytest.mark.parametrize("protocol", [2, 3])
async def test_a_shards_read_gives_each_entrys_payload_as_redis_sent_it(redis_server, protocol):
    """The hub's reads skip redis-py's dict of every entry's fields (issue 34: a sixth of the API's CPU at GPU step
    rates): each entry comes as its id and its payload, over either protocol, an entry without the field as b""."""
    from redis.asyncio import Redis

    writer, reader = connect(redis_server.url), Redis.from_url(redis_server.url, protocol=protocol)
    streams.lean_reads(reader)
    try:
        a, b = f"ra{protocol}", f"rb{protocol}"
        ids = [streams.as_str(await streams.add(writer, a, event(i))) for i in range(2)]
        other = streams.as_str(await streams.add_fields(writer, b, {"op": "wake"}))
        got = await streams.read(reader, {a: "0-0", b: "0-0"}, 10, None)
        assert dict(got) == {a: [(ids[0], encode(event(0))), (ids[1], encode(event(1)))], b: [(other, b"")]}
        assert await streams.read(reader, {a: ids[1]}, 10, None) == []
    finally:
        await writer.aclose()
        await reader.aclose()


async def test_two_readers_of_one_stream_in_one_process_each_get_every_entry(hub_env):
    """A request's own inbox and a second reader of its stream (a reattach, or the read that rebuilds a response's
    final object) read side by side; either leaving does not stop the other."""
    hub, redis, keys = hub_env
    own = await subscribe(hub, "twice")
    for i in range(3):
        await streams.add(redis, keys.reply("twice"), event(i))
    assert [decode((await asyncio.wait_for(own.get(), 5))[1], ReplyEvent).start for _ in range(3)] == [0, 1, 2]
    again = await subscribe(hub, "twice")  # from the stream's start
    assert hub.subscriptions == 2
    await streams.add(redis, keys.reply("twice"), event(3))
    got = [decode((await asyncio.wait_for(again.get(), 5))[1], ReplyEvent).start for _ in range(4)]
    assert got == [0, 1, 2, 3]
    assert decode((await asyncio.wait_for(own.get(), 5))[1], ReplyEvent).start == 3
    hub.unsubscribe(again)
    await streams.add(redis, keys.reply("twice"), event(4))
    assert decode((await asyncio.wait_for(own.get(), 5))[1], ReplyEvent).start == 4
    assert own.queue.empty() and hub.subscriptions == 1


async def test_a_reader_registered_during_a_blocked_read_still_gets_the_stream_from_its_start(hub_env):
    """A resume (or a cancel's rebuild) registers while the shard is blocked reading the request's own inbox past
    what it has; the next entry ends that read, and the new reader must not take it as its first."""
    hub, redis, keys = hub_env
    own = await subscribe(hub, "late")
    for i in range(3):
        await streams.add(redis, keys.reply("late"), event(i))
    assert [decode((await asyncio.wait_for(own.get(), 5))[1], ReplyEvent).start for _ in range(3)] == [0, 1, 2]
    await async_wait_for(lambda: blocked_reads(redis))  # the shard waits past entry 2
    again = hub.register(Inbox("late", keys.reply("late")))  # no wake: the blocked read goes on as it was
    await streams.add(redis, keys.reply("late"), event(3))
    got = [decode((await asyncio.wait_for(again.get(), 5))[1], ReplyEvent).start for _ in range(4)]
    assert got == [0, 1, 2, 3]
    assert decode((await asyncio.wait_for(own.get(), 5))[1], ReplyEvent).start == 3 and own.queue.empty()


async def blocked_reads(redis) -> bool:
    return any(c.get("cmd") == "xread" and "b" in c.get("flags", "") for c in await redis.client_list())


@pytest.fixture
async def cluster_hub(redis_cluster):
    redis = connect(redis_cluster.url)
    await redis.ping()  # loads the topology the hub places its shards by
    keys = Keys(f"h{uuid.uuid4().hex[:8]}")
    hub = ReplyHub(redis_cluster.url, {}, redis, keys, "pod-1", limits=HubLimits(shard_keys=8, high_water=16))
    yield hub, redis, keys
    await hub.close()
    await redis.aclose()


async def test_on_a_cluster_each_shard_reads_one_slot_and_shards_spread_over_the_primaries(cluster_hub):
    hub, redis, keys = cluster_hub
    assert hub.cluster
    uids = [hub.new_uid() for _ in range(30)]
    subs = [await subscribe(hub, uid) for uid in uids]  # 30 streams in XREADs that name one slot each
    for i, uid in enumerate(uids):
        await streams.add(redis, keys.reply(uid), event(i))
    for i, sub in enumerate(subs):
        _, raw = await asyncio.wait_for(sub.get(), 5)
        assert decode(raw, ReplyEvent).start == i
    primaries = {redis.nodes_manager.get_node_from_slot(s.slot).name for s in hub.shards}
    assert len(primaries) == 3 and len(hub.shards) >= 3
    for shard in hub.shards:
        assert {slots.key_slot(key) for key in [shard.control, *shard.subs]} == {shard.slot}


async def test_on_a_cluster_a_request_from_another_process_is_read_by_a_guest_shard(cluster_hub):
    hub, redis, keys = cluster_hub
    own = await subscribe(hub, hub.new_uid())
    foreign = slots.uid_in_slot(next(s for s in range(slots.SLOTS) if s not in {x.slot for x in hub.shards}))
    await streams.add(redis, keys.reply(foreign), event(5))
    sub = await subscribe(hub, foreign)  # a reattach: its slot is none of this process's own shards'
    assert sub.shard.guest and sub.shard.slot == slots.key_slot(keys.reply(foreign))
    _, raw = await asyncio.wait_for(sub.get(), 5)
    assert decode(raw, ReplyEvent).start == 5
    guest = sub.shard
    hub.unsubscribe(sub)
    assert guest not in hub.shards  # an empty guest shard goes away with its connection and control stream
    await asyncio.gather(*hub.closing)
    assert guest.task.done() and not await redis.exists(guest.control)
    assert own.shard in hub.shards


def test_a_timed_wait_already_due_under_uvloop_leaves_an_alarm_the_next_wait_can_read():
    """uvloop (the API's loop) answers call_at for a time already past with a plain Handle, which has no `when()`:
    a wait set while such an alarm is pending (a request whose deadline was already due, then waiting again) must
    not fail (it did: AttributeError, a 500 to the client)."""
    import uvloop

    async def main() -> None:
        inbox, loop = Inbox("u", "k"), asyncio.get_running_loop()
        inbox._wait_until(loop.time() - 1)  # due at once: the alarm is a Handle
        inbox._wait_until(loop.time() + 0.01)
        assert await inbox.get(0.01) is None
        inbox.queue.put_nowait(("1-0", b"x"))
        assert await inbox.get(5) == ("1-0", b"x")
        inbox.close()

    uvloop.run(main())
