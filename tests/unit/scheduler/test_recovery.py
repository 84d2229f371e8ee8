"""The scheduler worker against a real redis-server (synthetic engine: no model compute): duplicates are
acknowledged, a takeover fences the old owner out, a resume past the reply stream's cap starts from a
checkpoint, and a stop string ends one choice of an n > 1 request in the engine."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from services.scheduler.main import build_worker
from shared import records, streams
from shared.messages import Reply, ReplyFence, SamplingParams, ScheduleJob, decode
from shared.replies import ProducedTokens
from shared.settings import SchedulerSettings
from shared.streams import Delivery

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def make(redis_server, demo_model_dir):
    namespace = f"rec{uuid.uuid4().hex[:6]}"
    workers = []

    async def make(name: str, **kw):
        settings = SchedulerSettings(redis_url=redis_server.url, namespace=namespace, worker_id=name,
                                     engine="synthetic", step_ms=0, claim_idle_ms=200, **kw)
        w = await build_worker(settings, str(demo_model_dir), "demo")
        await w.source.ensure_group()
        workers.append(w)
        return w

    yield make
    for w in workers:
        await w.close()


def job(uid: str, max_tokens: int, **params) -> ScheduleJob:
    return ScheduleJob(uid=uid, model="demo", pod="api-x", created_at=0.0, deadline=1e12, background=True,
                       params=SamplingParams(max_tokens=max_tokens, **params), input_ids=[5, 6, 7])


async def run_until_idle(w, steps: int = 1000) -> None:
    for _ in range(steps):
        if not w.engine.has_work():
            break
        await w.work()
    await w.flush()


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
    assert "u1" not in peer.running and "u1" in owner.running
    pending = await owner.redis.xpending_range(owner.source.key, "scheduler", "-", "+", 10)
    assert dup.decode() not in {p["message_id"].decode() for p in pending}  # acknowledged


async def test_a_takeover_fences_the_old_owner_and_resumes_past_the_cap(make):
    """The reply stream is capped at 16 entries and holds 200 tokens' worth: the peer resumes from the newest
    checkpoint plus what follows, after its fence; what the stalled owner publishes later is refused."""
    owner, peer = await make("owner", reply_maxlen=16), await make("peer", reply_maxlen=16)
    await streams.add(owner.redis, owner.source.key, job("u2", 300))
    await owner.admit(await owner.source.read(1, None), claimed=False)
    for _ in range(200):
        await owner.work()
    entry = owner.running["u2"].entry_id
    assert await owner.redis.xlen(owner.keys.reply("u2")) <= 40  # trimmed: the head is gone
    written = list(owner.running["u2"].outputs[0])
    await asyncio.sleep(0.3)  # the owner stalls (no keep-alive): the peer claims its entry
    [claimed] = await peer.source.claim(200, 1)
    assert claimed.entry_id == entry
    await peer.admit([claimed], claimed=True)
    resumed = peer.running["u2"]
    assert resumed.epoch == 1 and resumed.outputs[0] == written[:len(resumed.outputs[0])]
    assert len(resumed.outputs[0]) >= 160  # from the checkpoint, not from token 0
    await owner.work()  # the stalled owner's last steps, made before it noticed ...
    await owner.flush()
    assert await owner.source.touch([entry]) == [entry]  # ... which it notices now
    order = ProducedTokens(1)
    for m in await replies(peer, "u2"):
        order.add(m)
    assert any(isinstance(m, ReplyFence) and m.epoch == 1 for m in await replies(peer, "u2"))
    assert order.outputs[0] == written[:len(order.outputs[0])]  # nothing of the owner after the fence


async def test_a_stop_string_ends_one_choice_of_two_in_the_engine(make):
    w = await make("solo")
    await streams.add(w.redis, w.source.key, job("u3", 500, n=2, stop=["zz"]))
    await w.admit(await w.source.read(1, None), claimed=False)
    for _ in range(5):
        await w.work()
    async with w.redis.pipeline(transaction=False) as pipe:
        records.stop_choice(pipe, w.keys, "u3", 0, 60, "demo")  # as the detokenizer does for choice 0
        await pipe.execute()
    await w.work()
    assert w.running["u3"].done == {0}
    assert {s.index for s in w.engine.running if s.uid == "u3"} == {1}  # choice 0 no longer generated
    await run_until_idle(w)
    assert "u3" not in w.running and w.engine.stats()["running"] == 0
