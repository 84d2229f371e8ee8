"""The stream commands (shared/streams.py) against a real redis-server: trimmed heads, entry ids, and an
acknowledgement that never lands without the output it follows."""

from __future__ import annotations

import pytest

from shared import streams
from tests.unit.shared.schedule_entries import consumer, job

pytestmark = pytest.mark.timeout(30)


async def test_trimmed_head_is_the_first_entry_kept_once_maxlen_cut_the_stream(env):
    redis, keys = env
    key = keys.reply("u1")
    assert await streams.trimmed_head(redis, key) is None  # no stream yet
    ids = [await redis.xadd(key, {"i": i}) for i in range(10)]
    assert await streams.trimmed_head(redis, key) is None
    await redis.xtrim(key, maxlen=4, approximate=False)
    assert await streams.trimmed_head(redis, key) == ids[6].decode()
    assert streams.id_after(ids[7].decode(), ids[6].decode()) and not streams.id_after("5-1", "5-10")


@pytest.mark.parametrize("flagged", [False, True], ids=["multi", "flagged-script"])
async def test_an_entry_whose_output_redis_refused_for_memory_stays_pending(flagged, monkeypatch):
    """maxmemory with noeviction: Redis refuses the output's XADD with OOM but would take a plain XACK, which
    would acknowledge an entry whose result is lost. The acknowledgement is refused with it (in a MULTI of its
    own, or on Redis 7+ a flagged script); once Redis has room the same pipeline lands both."""
    from redis.exceptions import OutOfMemoryError

    from rsinfer.redis_server import RedisServer
    from shared import redis_conn
    from shared.keys import Keys
    from shared.redis_conn import connect

    with RedisServer(maxmemory="4mb") as server:
        redis, keys = connect(server.url), Keys("oom")
        takes_flags = int((await redis.info("server"))["redis_version"].split(".")[0]) >= 7
        # learnt as it connected (scripts_flagged() is this process's answer over every URL it connected to: other
        # tests' servers, one of them down, take part in it)
        assert redis_conn.takes_script_flags(server.url) == takes_flags
        if flagged and not takes_flags:
            pytest.skip("script flags need Redis 7")
        monkeypatch.setattr(streams, "scripts_flagged", lambda: flagged)
        c = consumer(redis, keys, "a")
        await c.ensure_group()
        await streams.add(redis, keys.schedule("m"), job("u"))
        (d,) = await c.read(10, None)
        filler = 0
        with pytest.raises(OutOfMemoryError):
            while True:
                await redis.set(f"fill{filler}", b"x" * 1024)
                filler += 1

        async def handle() -> None:
            async with redis.pipeline(transaction=False) as pipe:
                streams.add(pipe, keys.detokenize("m"), job("u"))
                c.ack_in(pipe, [d.entry_id])
                await pipe.execute()

        for _ in range(3):  # refused for as long as Redis is full
            with pytest.raises(OutOfMemoryError):
                await handle()
            assert await c.pending_ids() == [d.entry_id]
        # at most the first XADD squeezed in (the refused SET's buffer freed): written again below, a duplicate
        assert await redis.xlen(keys.detokenize("m")) <= 1
        await redis.delete(*(f"fill{i}" for i in range(filler)))
        await handle()
        assert await c.pending_ids() == []
        assert await redis.xlen(keys.detokenize("m")) >= 1
        async with redis.pipeline(transaction=True) as pipe:  # inside a transaction: a plain XACK
            c.ack_in(pipe, ["0-1"])
            assert await pipe.execute() == [0]
        await redis.aclose()


async def test_the_newest_id_and_the_length_of_a_stream(env):
    redis, keys = env
    key = keys.schedule("m")
    assert await streams.last_id(redis, key) is None and await streams.length(redis, key) == 0
    ids = [await streams.add(redis, key, job(f"u{i}")) for i in range(3)]
    assert await streams.last_id(redis, key) == ids[-1].decode() and await streams.length(redis, key) == 3


async def test_undelivered_counts_each_streams_lag_up_to_a_cap_even_where_redis_cannot_tell_it(env):
    """The fair queueing backlog (services/tokenizer/fair.py): a group's lag per stream, capped; a stream whose
    lag Redis reports as nil (an XDEL after the group's last delivered entry) counted from its entries; a stream
    without the group counts whole; a missing stream counts nothing."""
    redis, keys = env
    shared, own, fresh = keys.schedule("m"), keys.scheduler_stream("m", "s1"), keys.scheduler_stream("m", "s2")
    for key in (shared, own):
        await redis.xgroup_create(key, "scheduler", id="0", mkstream=True)
    for i in range(5):
        await redis.xadd(shared, {"i": i})
    ids = [await redis.xadd(own, {"i": i}) for i in range(4)]
    await redis.xreadgroup("scheduler", "c", {shared: ">"}, count=2)  # 3 left undelivered
    await redis.xreadgroup("scheduler", "c", {own: ">"}, count=1)
    await redis.xdel(own, ids[2])  # 2 left undelivered, and a tombstone Redis's lag cannot count past
    assert (await redis.xinfo_groups(own))[0]["lag"] is None
    await redis.xadd(fresh, {"i": 0})
    gone = keys.scheduler_stream("m", "gone")
    assert await streams.undelivered(redis, [shared, own, fresh, gone], "scheduler", cap=100) == 3 + 2 + 1
    assert await streams.undelivered(redis, [shared, own], "scheduler", cap=2) == 2 + 2


async def test_each_stream_is_read_on_its_own_and_what_is_acknowledged_is_deleted(env):
    """ack_delete: the stream keeps only what is still to do (read_group_each reads the streams of several
    tenants in one round trip, a missing group reported per stream)."""
    from redis.exceptions import ResponseError

    redis, keys = env
    member = streams.Member("batch", "r1")
    a, b, missing = keys.batch_work("a"), keys.batch_work("b"), keys.batch_work("none")
    for key in (a, b):
        assert await streams.create_group(redis, key, "batch", mkstream=True)
    ids = [await redis.xadd(a, {"i": i}) for i in range(3)]
    got = await streams.read_group_each(redis, {a: 2, b: 2, missing: 2}, member)
    assert [eid for eid, _ in got[a]] == [i.decode() for i in ids[:2]] and got[b] == []
    assert isinstance(got[missing], ResponseError)
    await streams.ack_delete(redis, a, "batch", [ids[0].decode()])
    assert await redis.xlen(a) == 2 and (await redis.xpending(a, "batch"))["pending"] == 1
