"""A request's keys through shared/request_store.py against a real redis-server: the record, the reply stream,
the ends, the abort flags and notifications, and what each write queues on the caller's pipeline."""

from __future__ import annotations

import time

import pytest

from shared import streams
from shared.messages import Reply, ReplyError, ReplyEvent, ReplyFence, decode
from shared.request_states import TERMINAL, EndReason, Finish, Status, status_after
from shared.request_store import PRUNE_AFTER_S, RequestStore, deadline_error, prune_inflight

pytestmark = pytest.mark.timeout(30)
TTL, MAXLEN = 120, 64


@pytest.fixture
def store(env) -> RequestStore:
    redis, keys = env
    return RequestStore(redis, keys, TTL, MAXLEN)


def commands(pipe) -> list[str]:
    return [c[0][0] for c in pipe.command_stack]


async def replies_of(store: RequestStore, uid: str) -> list:
    return [decode(streams.payload(f), Reply) for _, f in await store.redis.xrange(store.keys.reply(uid))]


async def test_the_record_is_written_with_its_ttl_and_read_back(store):
    async with store.redis.pipeline(transaction=False) as pipe:
        store.create(pipe, "u1", time.time() + 300, model="m", n=2, background=0, skipped=None)
        store.attach(pipe, "u1", +1)
        assert commands(pipe) == ["HSET", "EXPIRE", "ZADD", "HINCRBY"]  # queued: no round trip of their own
        await pipe.execute()
    record = await store.record("u1")
    assert record["status"] == "queued" == Status.QUEUED and record["model"] == "m" and record["n"] == "2"
    assert "skipped" not in record and record["attached"] == "1" and float(record["updated_at"]) > 0
    assert 300 + TTL - 2 <= await store.redis.ttl(store.keys.request("u1")) <= 300 + TTL + 1
    assert await store.record("nobody") == {}
    assert await store.field(["u1", "nobody"], "status") == {"u1": "queued", "nobody": None}
    assert await store.fields(["u1"], "model", "n", "gone") == {"u1": ["m", "2", None]}
    assert await store.field([], "status") == {} and await store.fields([], "status") == {}
    assert [await store.raise_epoch("u1") for _ in range(2)] == [1, 2]


async def test_the_records_ttl_is_set_at_its_creation_and_its_end_not_by_the_writes_between(store):
    """Issue 34: one EXPIRE per record at its creation (running past its deadline: every stage drops a request
    past it) and one at its end; the stages' writes between (tokenized, running, marks) add none."""
    redis, key = store.redis, store.keys.request("t1")
    async with redis.pipeline(transaction=False) as pipe:
        store.create(pipe, "t1", time.time() + 30, model="m")
        await pipe.execute()
    assert 30 + TTL - 2 <= await redis.ttl(key) <= 30 + TTL + 1
    async with redis.pipeline(transaction=False) as pipe:
        store.set_status(pipe, "t1", Status.TOKENIZED, prompt_tokens=3)
        store.set_status(pipe, "t1", Status.RUNNING, scheduler="s1")
        store.set_status(pipe, "t1", completion_tokens=16)
        store.note_abort(pipe, "t1", EndReason.API)
        assert commands(pipe) == ["HSET", "HSET", "HSET", "HSET", "EXPIRE"]  # the last: the abort flag's
        await pipe.execute()
    assert 30 + TTL - 3 <= await redis.ttl(key) <= 30 + TTL + 1
    async with redis.pipeline(transaction=False) as pipe:
        store.set_status(pipe, "t1", Status.FINISHED, completion_tokens=20)
        await pipe.execute()
    assert TTL - 2 <= await redis.ttl(key) <= TTL and not await redis.zscore(store.keys.inflight(), "t1")


async def test_reply_entries_refresh_the_stream_ttl_only_where_asked(store):
    redis, keys = store.redis, store.keys
    async with redis.pipeline(transaction=False) as pipe:
        store.reply(pipe, "a", ReplyEvent(start=0, end=1, text="x", prompt_tokens=3))
        store.reply(pipe, "b", ReplyEvent(start=0, end=1, text="y", prompt_tokens=3), refresh_ttl=False)
        assert commands(pipe) == ["XADD", "EXPIRE", "XADD"]
        await pipe.execute()
    assert await redis.ttl(keys.reply("a")) > 0 and await redis.ttl(keys.reply("b")) == -1
    async with redis.pipeline(transaction=False) as pipe:
        store.replies(pipe, [("c", ReplyEvent(start=0, end=1, text="p", prompt_tokens=1), True),
                             ("d", ReplyEvent(start=0, end=1, text="q", prompt_tokens=1), False)])
        assert commands(pipe) == ["EVAL"]  # one script for the whole read (one slot)
        await pipe.execute()
    assert [r.text for r in await replies_of(store, "c")] == ["p"] and [r.text for r in await replies_of(store, "d")]
    assert await redis.ttl(keys.reply("c")) > 0 and await redis.ttl(keys.reply("d")) == -1
    async with redis.pipeline(transaction=False) as pipe:
        for i in range(MAXLEN * 4):
            store.reply(pipe, "e", ReplyEvent(start=i, end=i + 1, text="z", prompt_tokens=1))
        await pipe.execute()
    assert MAXLEN <= await redis.xlen(keys.reply("e")) < MAXLEN * 2  # capped near --reply-maxlen


async def test_a_fence_and_what_came_before_it_in_one_round_trip(store):
    async with store.redis.pipeline(transaction=False) as pipe:
        for i in range(3):
            store.reply(pipe, "f", ReplyEvent(start=i, end=i + 1, text=str(i), prompt_tokens=1))
        await pipe.execute()
    trimmed, before = await store.fence("f", ReplyFence(epoch=1, scheduler="s2"))
    assert not trimmed and [decode(streams.payload(f), Reply).text for _, f in before] == ["0", "1", "2"]
    assert all(isinstance(eid, str) for eid, _ in before)
    assert isinstance((await replies_of(store, "f"))[-1], ReplyFence)


async def test_ends_answer_the_client_and_mark_the_record(store):
    redis, keys = store.redis, store.keys
    await redis.set(keys.abort("ab"), "api")  # no TTL, as an operator might set it
    async with redis.pipeline(transaction=False) as pipe:
        store.end_aborted(pipe, "ab", 2, "api", prompt_tokens=5)
        store.end_failed(pipe, "bad", ReplyError(message="x" * 900, status=400))
        store.end_timed_out(pipe, "late")
        await pipe.execute()
    ends = await replies_of(store, "ab")
    assert [(e.index, e.finish_reason, e.prompt_tokens) for e in ends] == [(0, "abort", 5), (1, "abort", 5)]
    ab = await store.record("ab")
    assert (ab["status"], ab["finish_reason"], ab["error"]) == ("aborted", "abort", "aborted: api")
    assert 0 < await redis.ttl(keys.abort("ab")) <= TTL
    bad = await store.record("bad")
    assert (bad["status"], bad["finish_reason"], len(bad["error"])) == ("failed", "error", 500)
    [late] = await replies_of(store, "late")
    assert isinstance(late, ReplyError) and late.status == 504 and late.code == "request_timeout"
    assert {(await store.record(u))["status"] for u in ("ab", "bad", "late")} <= TERMINAL


async def test_a_dropped_request_notes_its_reason_and_bounds_its_flag(store):
    redis, keys = store.redis, store.keys
    await redis.set(keys.abort("d"), "operator")
    async with redis.pipeline(transaction=False) as pipe:
        store.set_status(pipe, "d", Status.RUNNING)
        store.note_abort(pipe, "d", "operator")
        await pipe.execute()
    d = await store.record("d")
    assert d["status"] == "running" and d["error"] == "aborted: operator"  # the detokenizer writes the end
    assert 0 < await redis.ttl(keys.abort("d")) <= TTL


async def test_abort_flags_and_notifications(store):
    redis, keys = store.redis, store.keys
    await store.abort_now("x", EndReason.CLIENT_GONE, "m")
    async with redis.pipeline(transaction=False) as pipe:
        store.abort(pipe, "y", EndReason.API, None)  # no model: the flag only
        store.stop_choice(pipe, "z", 1, "m")
        await pipe.execute()
    notes = [{k.decode(): v.decode() for k, v in f.items()} for _, f in await redis.xrange(keys.aborts("m"))]
    assert notes == [{"uid": "x", "reason": "client_disconnected"}, {"uid": "z", "reason": "stop", "choice": "1"}]
    assert await store.abort_reasons(["x", "y", "z"]) == {"x": "client_disconnected", "y": "api"}
    assert await store.abort_reasons([]) == {}
    reasons, stopped = await store.ended_elsewhere(["x", "w"], [("z", 0), ("z", 1)])
    assert reasons == {"x": "client_disconnected"} and stopped == {("z", 1)}
    assert 0 < await redis.ttl(keys.choice_stop("z", 1)) <= TTL


async def test_every_write_is_queued_on_the_callers_pipeline_in_order(store):
    """One pipeline holds a whole request's writes, each method's commands in the order it is called (no method
    adds a round trip): the record, replies, a client attaching, the ends, an abort flag and a choice's stop."""
    redis = store.redis
    async with redis.pipeline(transaction=False) as pipe:
        store.set_status(pipe, "o", Status.RUNNING, scheduler="s1")
        store.reply(pipe, "o", ReplyEvent(start=0, end=1, text="a", prompt_tokens=1))
        store.replies(pipe, [("o", ReplyEvent(start=1, end=2, text="b", prompt_tokens=1), False)])
        store.attach(pipe, "o", 1)
        store.end_aborted(pipe, "o", 1, EndReason.API, 1)
        store.end_failed(pipe, "o2", deadline_error())
        store.abort(pipe, "o", EndReason.API, "m")
        store.stop_choice(pipe, "o", 0, "m")
        assert commands(pipe) == ["HSET", "XADD", "EXPIRE", "EVAL", "HINCRBY", "XADD", "EXPIRE", "HSET", "EXPIRE",
                                  "ZREM", "EXPIRE", "XADD", "EXPIRE", "HSET", "EXPIRE", "ZREM", "SET", "XADD", "SET",
                                  "XADD"]
        await pipe.execute()
    await store.abort_now("o3", EndReason.API, None)
    assert await store.abort_reasons(["o", "o3"]) == {"o": "api", "o3": "api"}
    assert await store.ended_elsewhere(["o"], [("o", 0)]) == ({"o": "api"}, {("o", 0)})
    o = await store.record("o")
    assert (o["status"], o["scheduler"], o["attached"]) == ("aborted", "s1", "1")
    assert [r.text for r in await replies_of(store, "o")] == ["a", "b", ""]


def test_the_vocabulary_is_the_strings_on_the_wire():
    assert tuple(Status) == ("queued", "tokenized", "running", "finished", "aborted", "failed")
    assert [s for s in Status if s in TERMINAL] == ["finished", "aborted", "failed"]
    assert [Status(s) for s in ("queued", "running")] == [Status.QUEUED, Status.RUNNING]
    assert "finished" in TERMINAL and "running" not in TERMINAL
    assert [status_after(f) for f in Finish] == [Status.FINISHED, Status.FINISHED, Status.ABORTED, Status.FAILED]
    assert status_after("unknown") == Status.FINISHED
    assert f"{EndReason.CLIENT_GONE}" == "client_disconnected" and str(Finish.STOP) == "stop"
    every = [*Status.__members__.values(), *Finish.__members__.values(), *EndReason.__members__.values()]
    assert len({m.value for m in EndReason.__members__.values()}) == len(EndReason.__members__)  # no aliases
    assert all(isinstance(m, str) for m in every)


async def test_the_index_of_requests_in_flight_follows_their_records(store):
    """A record enters the index with one ZADD on the pipeline that writes it and leaves it with the write that
    ends it (whichever stage's); one whose end was lost is pruned past its deadline."""
    now = time.time()
    async with store.redis.pipeline(transaction=False) as pipe:
        for k, uid in enumerate(("old", "mid", "new", "lost")):
            store.create(pipe, uid, now + 10 + k if uid != "lost" else now - PRUNE_AFTER_S - 1, model="m")
        assert commands(pipe)[:3] == ["HSET", "EXPIRE", "ZADD"]
        await pipe.execute()
    assert (await store.record("old"))["status"] == "queued"
    assert await store.inflight(2) == (4, ["lost", "old"])  # by deadline
    async with store.redis.pipeline(transaction=False) as pipe:
        store.set_status(pipe, "mid", Status.RUNNING)
        store.end_failed(pipe, "old", deadline_error())
        store.set_status(pipe, "new", Status.FINISHED)
        await pipe.execute()
    assert await store.inflight(10) == (2, ["lost", "mid"])
    assert await prune_inflight(store.redis, store.keys) == 1
    assert await store.inflight(10) == (1, ["mid"])
