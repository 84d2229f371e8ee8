"""services/api/answer/request/: a request's replies in order (OrderedReplies: per-choice order, duplicates dropped,
gaps held until a peer fills them), read off its subscription; a group's merged."""

from __future__ import annotations

import asyncio
import time
import types

import pytest

from services.api.answer.reply_hub import Inbox
from services.api.answer.request.api_request import RequestInfo
from services.api.answer.request.early_end import EndedEarly
from services.api.answer.request.group import RequestGroup
from services.api.answer.request.requests import Requests
from services.api.answer.request.single import SingleRequest
from services.api.operations.metrics import Metrics
from shared.keys import Keys
from shared.messages import ReplyCheckpoint, ReplyError, ReplyEvent, ReplyFence, encode
from shared.reply_order import OrderedReplies
from shared.settings import ApiSettings


def shared(redis=None) -> types.SimpleNamespace:
    """What requests share (services/api/answer/request/context.py RequestContext), stubbed: no Redis but `redis` (a
    reattach's check of a trimmed head), no hub but one that hands out the subscription given to `reader`."""
    return types.SimpleNamespace(hub=types.SimpleNamespace(register=lambda inbox: shared.sub), metrics=Metrics(None),
                                 redis=redis, keys=Keys("t"))


def reader(sub, n: int = 1, deadline: float | None = None, redis=None, ctx=None) -> SingleRequest:
    """A request reading `sub` (the Inbox surface it uses)."""
    shared.sub = sub
    return SingleRequest(ctx or shared(redis), RequestInfo("u", "m", n, deadline or time.time() + 60))  # type: ignore[arg-type]


class QueueSub(Inbox):
    """The Inbox a request reads, fed by the test instead of a hub: get(wait_s) and drain() over its queue of
    (entry id, raw entry)."""

    def __init__(self):
        super().__init__("u", "k")


def ev(start, end, index=0, finish=None):
    return ReplyEvent(start=start, end=end, text=f"[{start}:{end}]", prompt_tokens=3, index=index,
                      ids=list(range(start, end)), finish_reason=finish)


def texts(events):
    return [e.text for e in events]


def test_in_order_duplicates_and_gaps():
    o = OrderedReplies(1)
    assert texts(o.accept(ev(0, 2))) == ["[0:2]"]
    assert o.accept(ev(0, 2)) == []  # duplicate (a peer redid it)
    assert o.accept(ev(4, 5)) == []  # gap: held
    assert texts(o.accept(ev(2, 4))) == ["[2:4]", "[4:5]"]
    assert o.accept(ev(3, 4)) == []
    assert not o.done
    assert texts(o.accept(ev(5, 6, finish="length"))) == ["[5:6]"]
    assert o.done and o.completion_tokens == 6 and o.prompt_tokens == 3
    assert o.accept(ev(6, 7)) == []  # nothing after the end


def test_choices_are_independent_and_abort_ends_where_it_stands():
    o = OrderedReplies(2)
    o.accept(ev(0, 3, index=1))
    o.accept(ev(0, 1, index=0))
    assert texts(o.accept(ev(1, 1, index=0, finish="abort"))) == ["[1:1]"]
    assert o.finished == {0: "abort"}
    o.accept(ev(0, 0, index=1, finish="abort"))  # an abort marker that lags behind still ends the choice
    assert o.done and o.finished[1] == "abort"


async def test_cancelling_a_reader_is_never_swallowed_by_an_arriving_entry():
    """A request whose client left is cancelled while entries stream in; the cancellation must win
    (asyncio.wait_for on Python 3.11 returns the entry instead and the reader runs on)."""
    import contextlib

    from shared.messages import encode

    for _ in range(200):
        sub = QueueSub()

        async def read(sub: QueueSub) -> None:
            async for _ in reader(sub).replies():
                pass

        task = asyncio.ensure_future(read(sub))
        await asyncio.sleep(0)  # the reader now waits for an entry
        sub.queue.put_nowait(("1-0", encode(ev(0, 1))))  # the entry lands in the same tick as the cancel
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), 1)
        assert task.cancelled(), "the cancellation was swallowed"


async def test_a_reattach_reads_a_stream_trimmed_after_it_looked_whole(redis_server):
    """SingleRequest.attach found the reply stream whole, then MAXLEN trimmed its head before the hub's first
    read: the first range the reader gets starts past 0, so it asks Redis, learns the head is gone and starts
    there (before, it held everything for token 0, which never came, until the deadline)."""
    from shared import streams
    from shared.messages import encode
    from shared.redis_conn import connect

    redis = connect(redis_server.url)
    key = f"t{time.time_ns()}:reply"
    ids = [await redis.xadd(key, {streams.FIELD: encode(ev(i, i + 1, finish="length" if i == 9 else None))})
           for i in range(10)]
    await redis.xtrim(key, maxlen=6, approximate=False)

    sub = QueueSub()  # fed what an XREAD from 0-0 now returns
    sub.key = key
    for eid, fields in await redis.xrange(key):
        sub.queue.put_nowait((eid.decode(), streams.payload(fields)))
    req = reader(sub, deadline=time.time() + 5, redis=redis)
    req.order.head_unsure = True
    got = [ev for batch in [b async for b in req.replies()] for _, ev in batch]
    assert [e.start for e in got] == [4, 5, 6, 7, 8, 9] and req.done
    assert ids[4] == (await redis.xrange(key, count=1))[0][0]
    await redis.aclose()


def ttft_count(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value("rsinfer_time_to_first_token_seconds_count", {"model": "m"}) or 0.0


@pytest.mark.timeout(10)
async def test_a_group_numbers_choices_by_prompt_and_counts_one_first_token():
    ctx = shared()
    subs = [QueueSub(), QueueSub()]
    group = RequestGroup([reader(sub, n=2, ctx=ctx) for sub in subs], per=2)
    for k, sub in enumerate(subs):
        for i in range(2):
            sub.queue.put_nowait((f"{k}-{i}", encode(ev(0, 2, index=i, finish="stop"))))
    got = [(eid, e.index) for batch in [b async for b in group.replies()] for eid, e in batch]
    assert sorted(got) == [("0-0", 0), ("0-1", 1), ("1-0", 2), ("1-1", 3)]  # prompt k's choice i is k * 2 + i
    assert group.done and group.counts.completion_tokens == 8 and group.counts.prompt_tokens == 6
    assert ttft_count(ctx.metrics) == 1  # the group's first token, not one per prompt


@pytest.mark.timeout(10)
async def test_one_prompt_ending_early_ends_the_group_with_its_reason():
    subs = [QueueSub(), QueueSub()]
    group = RequestGroup([reader(sub, ctx=shared()) for sub in subs], per=1)
    subs[1].queue.put_nowait(("1-0", encode(ReplyError("bad regex", 400, "invalid_request_error", param="regex"))))
    with pytest.raises(EndedEarly) as info:
        async for _ in group.replies():
            pass
    assert (info.value.status, info.value.param, info.value.reason) == (400, "regex", "rejected")
    assert [m.end_reason for m in group.members] == ["rejected", "rejected"]


@pytest.mark.timeout(10)
async def test_a_request_past_its_deadline_ends_with_a_504():
    req = reader(QueueSub(), deadline=time.time() + 0.05)
    with pytest.raises(EndedEarly) as info:
        async for _ in req.replies():
            pass
    assert (info.value.status, info.value.code, req.end_reason) == (504, "request_timeout", "timeout")


def slo_reader(sub, ttft_ms: int) -> SingleRequest:
    """A request with a TTFT target of `ttft_ms` (services/api/answer/slo.py), no tolerance."""
    ctx = shared()
    ctx.settings = types.SimpleNamespace(slo_tolerance_ms=0.0)
    shared.sub = sub
    return SingleRequest(ctx, RequestInfo("u", "m", 1, time.time() + 60, slo_ttft_ms=ttft_ms,  # type: ignore[arg-type]
                                          created_at=time.time()))


@pytest.mark.timeout(10)
async def test_no_first_reply_by_its_ttft_target_ends_it_with_a_503_not_served_late():
    req = slo_reader(QueueSub(), ttft_ms=50)
    replies = req.replies(idle_s=5)
    with pytest.raises(EndedEarly) as info:
        await anext(replies)
    assert (info.value.status, info.value.code, req.end_reason) == (503, "slo_missed", "slo_missed")
    assert info.value.retry_after is not None


@pytest.mark.timeout(10)
async def test_once_its_first_reply_came_a_request_runs_past_its_ttft_target():
    sub = QueueSub()
    req = slo_reader(sub, ttft_ms=100)
    replies = req.replies(idle_s=0.05)
    sub.queue.put_nowait(("1-0", encode(ev(0, 1))))
    assert len(await anext(replies)) == 1
    for _ in range(4):  # 0.2 s idle: past the target, and still open
        assert await anext(replies) == []
    sub.queue.put_nowait(("2-0", encode(ev(1, 2, finish="stop"))))
    assert len(await anext(replies)) == 1 and req.done


@pytest.mark.timeout(10)
async def test_the_replies_skip_checkpoints_and_unreadable_entries_refuse_what_a_fence_ends_and_say_when_idle():
    """What `replies(idle_s)` yields of each read: an empty batch when nothing came for `idle_s`, the events in
    order with their entry ids, nothing of a checkpoint or an unreadable entry, nothing of an older epoch after a
    successor's fence."""
    sub = QueueSub()
    req = reader(sub, deadline=time.time() + 5)
    replies = req.replies(idle_s=0.01)
    assert await anext(replies) == []  # idle
    sub.queue.put_nowait(("1-0", encode(ev(0, 1))))
    sub.queue.put_nowait(("2-0", b"not json"))
    sub.queue.put_nowait(("3-0", encode(ReplyCheckpoint(epoch=0, outputs=[[1]]))))
    sub.queue.put_nowait(("4-0", encode(ReplyFence(epoch=1, scheduler="s2"))))
    sub.queue.put_nowait(("5-0", encode(ev(1, 2))))  # epoch 0, after the fence: refused
    sub.queue.put_nowait(("6-0", encode(ReplyEvent(start=1, end=2, text="[1:2]", prompt_tokens=3, ids=[1], epoch=1,
                                                   finish_reason="stop"))))
    got = [(eid, e.text) for eid, e in await anext(replies)]
    assert got == [("1-0", "[0:1]"), ("6-0", "[1:2]")] and req.done


async def test_a_reader_arms_one_timer_per_request_not_one_per_entry(monkeypatch):
    """Every wait for the next entry is bounded (the idle ping, the deadline), but by the inbox's one alarm: a timer
    handle per entry (asyncio.timeout's) was a measurable part of the API's cost per chunk at GPU step rates
    (issue 34). The idle wait still ends on time after many entries."""
    loop = asyncio.get_running_loop()
    timers = []

    def call_at(when, callback, *args, **kwargs):
        timers.append(when)
        return type(loop).call_at(loop, when, callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_at", call_at)
    sub = Inbox("u", "k")
    req = reader(sub, deadline=time.time() + 30)
    replies = req.replies(idle_s=0.2)
    for i in range(100):
        sub.queue.put_nowait((f"{i + 1}-0", encode(ev(i, i + 1))))
        assert [e.text for _, e in await anext(replies)] == [f"[{i}:{i + 1}]"]
    assert len(timers) <= 2, len(timers)
    assert await asyncio.wait_for(anext(replies), 2) == []  # idle: nothing came for 0.2 s


async def test_a_drain_waits_until_the_last_open_request_ends():
    ctx = Requests(ApiSettings(), types.SimpleNamespace(redis=None, keys=None), None, "pod",  # type: ignore[arg-type]
                   tracer=None, metrics=Metrics(None))
    await asyncio.wait_for(ctx.drained(), 1)  # none open
    for uid in ("a", "b"):
        ctx.opened(types.SimpleNamespace(uid=uid))  # type: ignore[arg-type]
    drained = asyncio.ensure_future(ctx.drained())
    ctx.ended("a")
    for _ in range(5):  # the loop runs whatever an end wakes (no timer involved)
        await asyncio.sleep(0)
    assert not drained.done()  # "b" is still open
    ctx.ended("b")
    await asyncio.wait_for(drained, 1)
    assert not ctx.inflight
