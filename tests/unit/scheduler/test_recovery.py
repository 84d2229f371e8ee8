"""The scheduler worker against a real redis-server (synthetic engine: no model compute): duplicates are
acknowledged, a takeover fences the old owner out, a resume past the reply stream's cap starts from a
checkpoint, and a stop string ends one choice of an n > 1 request in the engine."""

from __future__ import annotations

import uuid

import pytest

from services.detokenizer.main import DetokenizerWorker
from services.scheduler.main import SWEEP_EVERY_S, build_worker
from shared import streams
from shared.consumer_group import Delivery
from shared.messages import Reply, ReplyCheckpoint, ReplyEvent, ReplyFence, SamplingParams, ScheduleJob, decode
from shared.reply_order import OrderedReplies, ProducedTokens
from shared.settings import DetokenizerSettings, SchedulerSettings
from tests.support.helpers import async_wait_for
from tests.unit.shared.schedule_entries import held_idle

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def make(redis_server, random_model_dir):
    namespace = f"rec{uuid.uuid4().hex[:6]}"
    workers = []

    async def make(name: str, **kw):
        # a delta per step (no --stream-flush-ms) unless a test says otherwise: the tests count steps' ranges
        settings = SchedulerSettings(redis_url=redis_server.url, namespace=namespace, worker_id=name,
                                     engine="synthetic", step_ms=0, claim_idle_ms=200, **{"stream_flush_ms": 0, **kw})
        w = await build_worker(settings, str(random_model_dir), "demo")
        await w.source.ensure_group()
        workers.append(w)
        return w

    def detokenizer(**kw) -> DetokenizerWorker:
        settings = DetokenizerSettings(redis_url=redis_server.url, namespace=namespace, worker_id="detok", **kw)
        w = DetokenizerWorker(settings, str(random_model_dir), "demo")
        workers.append(w)
        return w

    make.detokenizer = detokenizer
    yield make
    for w in workers:
        await w.close()


def job(uid: str, max_tokens: int, **params) -> ScheduleJob:
    return ScheduleJob(uid=uid, model="demo", pod="api-x", created_at=0.0, deadline=1e12, background=True,
                       params=SamplingParams(max_tokens=max_tokens, **params), input_ids=[5, 6, 7])


async def claimable(w) -> None:
    """Wait until the schedule stream's pending entries are idle past the claims' min-idle below (200 ms)."""
    await async_wait_for(lambda: held_idle(w.redis, w.source.key, None, 200))


async def run_until_idle(w, steps: int = 1000) -> None:
    for _ in range(steps):
        if not w.engine.has_work():
            break
        await w.work()
    await w.flush()


async def detokenize(d: DetokenizerWorker) -> None:
    """What the detokenizer does with every step published so far: ranges appended to the reply streams."""
    await d.source.ensure_group()
    while batch := await d.source.read(100, None):
        await d.handle(batch, claimed=False)


def delivered(messages: list, n: int = 1) -> OrderedReplies:
    """What the API's reader delivers of these reply entries, in this order."""
    order = OrderedReplies(n)
    for m in messages:
        if isinstance(m, ReplyFence):
            order.fence(m.epoch)
        elif isinstance(m, ReplyEvent):
            order.accept(m)
    return order


async def replies(w, uid: str) -> list:
    return [decode(streams.payload(f), Reply) for _, f in await w.redis.xrange(w.keys.reply(uid))]


async def test_a_duplicate_schedule_entry_is_acknowledged_not_resumed(make):
    """A second entry of an admitted request, claimed from a dead consumer, must not take the request from
    its live owner (and would be claimed again every interval if left pending)."""
    owner, peer = await make("owner"), await make("peer")
    await streams.add(owner.redis, owner.source.key, job("u1", 50))
    await owner.admit(await owner.source.read(1, None), claimed=False)
    dup = await streams.add(owner.redis, owner.source.key, job("u1", 50))
    await peer.admit([Delivery(dup.decode(), job("u1", 50))], claimed=True)
    assert "u1" not in peer.book.running and "u1" in owner.book.running
    pending = await owner.redis.xpending_range(owner.source.key, "scheduler", "-", "+", 10)
    assert dup.decode() not in {p["message_id"].decode() for p in pending}  # acknowledged


async def test_a_takeover_fences_the_old_owner_and_resumes_past_the_cap(make):
    """The reply stream is capped at 16 entries and holds 200 tokens' worth: the peer resumes from the newest
    checkpoint plus the ranges after it, after its fence; what the stalled owner publishes later is refused."""
    owner, peer = await make("owner", reply_maxlen=16), await make("peer", reply_maxlen=16)
    detok = make.detokenizer(reply_maxlen=16)
    await running_for(owner, detok, "u2", 200, max_tokens=300)
    entry = owner.book.running["u2"].entry_id
    info = await owner.redis.xinfo_stream(owner.keys.reply("u2"))
    assert streams.was_trimmed(info) and info["length"] <= 40  # the head is gone
    written = list(owner.book.running["u2"].outputs[0])
    await claimable(owner)  # the owner stalls (no keep-alive): the peer claims its entry
    [claimed] = await peer.source.claim(200, 1)
    assert claimed.entry_id == entry
    await peer.admit([claimed], claimed=True)
    resumed = peer.book.running["u2"]
    assert resumed.epoch == 1 and resumed.outputs[0] == written  # the ranges reached the last token made
    await owner.work()  # the stalled owner's last steps, made before it noticed ...
    await owner.flush()
    await detokenize(detok)
    assert await owner.source.touch([entry]) == [entry]  # ... which it notices now
    order = ProducedTokens(1, trimmed=True)
    for m in await replies(peer, "u2"):
        order.add(m)
    assert any(isinstance(m, ReplyFence) and m.epoch == 1 for m in await replies(peer, "u2"))
    assert order.outputs[0] == written  # nothing of the owner after the fence


async def test_a_successor_resumes_where_the_client_stands_not_at_a_checkpoint_ahead_of_it(make):
    """The owner's last step wrote its checkpoint straight into the reply stream, but the detokenizer appends
    that step's range only after the peer's fence, where the client refuses it (older epoch). The peer must
    make that step's tokens again: resuming at the checkpoint left the client at a gap until its deadline."""
    owner, peer = await make("owner", reply_maxlen=400), await make("peer", reply_maxlen=400)
    detok = make.detokenizer(reply_maxlen=400)
    await streams.add(owner.redis, owner.source.key, job("u4", 160, n=2))
    await owner.admit(await owner.source.read(1, None), claimed=False)
    while True:
        checkpointed = owner.book.running["u4"].checkpointed
        await owner.work()
        await owner.flush()
        if owner.book.running["u4"].checkpointed > checkpointed:
            break  # this step's checkpoint is in the reply stream; its ranges are not
        await detokenize(detok)
    made = [list(o) for o in owner.book.running["u4"].outputs]
    await claimable(owner)
    [claimed] = await peer.source.claim(200, 1)
    await peer.admit([claimed], claimed=True)
    client = delivered(await replies(peer, "u4"), n=2)
    assert peer.book.running["u4"].outputs == [o[:k] for o, k in zip(made, client.next, strict=True)]
    assert client.next == [len(o) - 1 for o in made]  # one token each is in the detokenizer's hands
    await detokenize(detok)  # the owner's step lands after the fence: refused
    await run_until_idle(peer)
    await detokenize(detok)
    entries = await replies(peer, "u4")
    assert any(isinstance(m, ReplyCheckpoint) for m in entries)
    client = delivered(entries, n=2)
    assert client.done and client.next == [160, 160] and client.refused == 2


async def test_tokens_merging_held_back_are_made_again_by_the_successor_once_each(make):
    """With --stream-flush-ms the owner holds tokens it has not published; when it dies holding them, its
    successor resumes where the client stands (after what was published) and makes them again: the client gets
    every token once, in order, as a delta per step gives them (the synthetic engine's token at a position is a
    function of the request)."""
    owner, peer = await make("owner", stream_flush_ms=1000, stream_entry_rate=0), await make("peer")
    detok = make.detokenizer()
    await running_for(owner, detok, "u8", 20)
    made = list(owner.book.running["u8"].outputs[0])
    assert len(made) >= 20 and owner.book.unsent.holds("u8", 1)
    assert delivered(await replies(owner, "u8")).next == [1]  # the first token went at once; the rest wait
    await claimable(owner)  # the owner stalls for good, its merged tokens unsent
    [claimed] = await peer.source.claim(200, 1)
    await peer.admit([claimed], claimed=True)
    await run_until_idle(peer)
    await detokenize(detok)
    entries = await replies(peer, "u8")
    client, tokens = delivered(entries), ProducedTokens(1)
    for m in entries:
        tokens.add(m)
    assert client.done and client.next == [60] and client.refused == 0
    assert len(tokens.outputs[0]) == 60 and tokens.outputs[0][:len(made)] == made


async def test_a_stop_string_ends_one_choice_of_two_in_the_engine(make):
    w = await make("solo")
    await streams.add(w.redis, w.source.key, job("u3", 500, n=2, stop=["zz"]))
    await w.admit(await w.source.read(1, None), claimed=False)
    for _ in range(5):
        await w.work()
    async with w.redis.pipeline(transaction=False) as pipe:
        w.requests.stop_choice(pipe, "u3", 0, "demo")  # as the detokenizer does for choice 0
        await pipe.execute()
    await w.work()
    assert w.book.running["u3"].done == {0}
    assert {s.index for s in w.engine.running if s.uid == "u3"} == {1}  # choice 0 no longer generated
    await run_until_idle(w)
    assert "u3" not in w.book.running and w.engine.stats()["running"] == 0


async def pump(w, detok: DetokenizerWorker) -> None:
    """Step `w` until its engine is idle, the detokenizer rendering each step."""
    while w.engine.has_work():
        await w.work()
        await w.flush()
        await detokenize(detok)


async def running_for(w, detok: DetokenizerWorker, uid: str, steps: int, max_tokens: int = 60) -> None:
    """Admit a request on `w` and run it `steps` steps, each rendered."""
    await streams.add(w.redis, w.source.key, job(uid, max_tokens))
    await w.admit(await w.source.read(1, None), claimed=False)
    for _ in range(steps):
        await w.work()
        await w.flush()
        await detokenize(detok)


async def a_peer_took_over_and_died(w, uid: str, to: str | None = "ghost") -> None:
    """What a peer does before it records itself as the owner (services/scheduler/recovery.py `take_over`): claim the
    entry (unless `to` is None), raise the epoch, fence. Then it is SIGKILLed."""
    if to is not None:
        await w.redis.xclaim(w.source.key, "scheduler", to, 0, [w.book.running[uid].entry_id], justid=True)
    epoch = await w.redis.hincrby(w.keys.request(uid), "epoch", 1)
    async with w.redis.pipeline(transaction=False) as pipe:
        w.requests.reply(pipe, uid, ReplyFence(epoch=epoch, scheduler="ghost"))
        await pipe.execute()


async def test_an_owner_that_claims_back_its_own_entry_resumes_it_under_a_new_epoch(make):
    """The owner stalled; a peer claimed its entry, fenced, and died before recording itself; the owner, awake,
    claims the dead peer's entry before its keep-alive notices the loss. Running on at its old epoch, every step
    it made would be refused after the fence and the client would wait until its deadline."""
    owner, detok = await make("owner"), make.detokenizer()
    await running_for(owner, detok, "u5", steps=10)
    await a_peer_took_over_and_died(owner, "u5")
    await claimable(owner)
    [claimed] = await owner.source.claim(200, 1)
    await owner.admit([claimed], claimed=True)
    assert owner.book.running["u5"].epoch == 2
    await pump(owner, detok)
    client = delivered(await replies(owner, "u5"))
    assert client.done and client.next == [60]


async def test_an_owner_whose_request_a_peer_fenced_drops_it_and_it_is_resumed(make):
    """As above, but the owner holds the entry still (the peer died between its fence and its claim being seen):
    the owner's sweep sees the newer epoch, drops the request, and the idle entry is claimed and resumed."""
    owner, detok = await make("owner"), make.detokenizer()
    await running_for(owner, detok, "u6", steps=10)
    await a_peer_took_over_and_died(owner, "u6", to=None)
    sweep_due(owner)
    await owner.work()
    assert "u6" not in owner.book.running
    await claimable(owner)
    [claimed] = await owner.source.claim(200, 1)
    await owner.admit([claimed], claimed=True)
    await pump(owner, detok)
    client = delivered(await replies(owner, "u6"))
    assert client.done and client.next == [60]


async def test_the_sweep_refreshes_a_running_requests_ttls_a_few_times_per_ttl_not_every_second(make):
    w, detok = await make("solo", request_ttl_s=600), make.detokenizer()
    await streams.add(w.redis, w.source.key, job("u7", 500))
    await w.admit(await w.source.read(1, None), claimed=False)
    await w.work()
    await w.flush()
    await detokenize(detok)
    keys = [w.keys.request("u7"), w.keys.reply("u7")]
    for key in keys:
        await w.redis.expire(key, 100)
    sweep_due(w)
    await w.work()
    assert [0 < await w.redis.ttl(k) <= 100 for k in keys] == [True, True]  # checked (owner, epoch), not refreshed
    w.book.running["u7"].refreshed -= 61
    sweep_due(w)
    await w.work()
    await w.flush()  # the sweep's refresh goes with the outbox
    assert [await w.redis.ttl(k) > 500 for k in keys] == [True, True]


async def test_an_engine_step_that_raises_fails_its_requests_and_the_scheduler_serves_on(make):
    """The engine cannot say whose fault a failed step was: its requests get a 500 each, the worker stays up
    (a process that exits would have a peer claim the same requests, and fail the same way)."""
    w = await make("s-step")
    for uid in ("a1", "a2"):
        await streams.add(w.redis, w.source.key, job(uid, 500))
    await w.admit(await w.source.read(2, None), claimed=False)
    real = w.engine.step
    w.engine.step = lambda: (_ for _ in ()).throw(RuntimeError("kernel fault"))
    await w.work()
    await w.flush()
    assert not w.book.running and not w.engine.has_work()
    for uid in ("a1", "a2"):
        [(_, fields)] = [e for e in await w.redis.xrange(w.keys.reply(uid))]
        err = decode(streams.payload(fields), Reply)
        assert err.status == 500 and "kernel fault" in err.message
        assert (await w.redis.hget(w.keys.request(uid), "status")) == b"failed"
    w.engine.step = real
    await streams.add(w.redis, w.source.key, job("b1", 5))
    await w.admit(await w.source.read(1, None), claimed=False)
    await run_until_idle(w)
    assert not w.book.running and await w.source.pending_ids() == []  # served to its end and acknowledged


def sweep_due(w) -> None:
    """The once-a-second sweep due now, over every request running (admitted a sweep ago or more)."""
    w._last.pop("sweep", None)
    for r in w.book.running.values():
        r.admitted -= SWEEP_EVERY_S
