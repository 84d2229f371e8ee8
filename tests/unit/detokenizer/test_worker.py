"""The detokenizer worker against a real redis-server: what it writes for deltas that arrive out of order."""

from __future__ import annotations

import uuid

import pytest

from services.detokenizer.main import DetokenizerWorker
from shared.consumer_group import Delivery
from shared.messages import DetokenizeBatch, ReplyEvent, TokenDelta, decode
from shared.settings import DetokenizerSettings
from shared.streams import FIELD

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def worker(redis_server, random_model_dir):
    settings = DetokenizerSettings(redis_url=redis_server.url, namespace=f"d{uuid.uuid4().hex[:8]}", worker_id="d1")
    w = DetokenizerWorker(settings, str(random_model_dir), "demo")
    yield w
    await w.close()


def delta(start: int, ids: list[int], finish: str | None = None) -> TokenDelta:
    return TokenDelta(uid="u", start=start, ids=ids, prompt_tokens=3, finish=finish)


async def test_a_claimed_earlier_step_is_rendered_after_its_choice_finished(worker):
    """Claims and new entries are handled concurrently, so the step a dead peer held can come after the
    choice's last step: it must still reach the reply stream (only steps after a stop are dropped)."""
    late = DetokenizeBatch("s", 2, [delta(1, [70, 71], "length")])
    early = DetokenizeBatch("s", 1, [delta(0, [69])])
    await worker.handle([Delivery("2-0", late)], claimed=False)
    await worker.handle([Delivery("1-0", early)], claimed=True)
    entries = await worker.redis.xrange(worker.keys.reply("u"))
    ranges = sorted((ev.start, ev.end) for ev in (decode(f[FIELD], ReplyEvent) for _, f in entries))
    assert ranges == [(0, 1), (1, 3)]


async def test_steps_after_a_stop_string_are_dropped(worker):
    first = DetokenizeBatch("s", 1, [TokenDelta(uid="u", start=0, ids=[69, 70], prompt_tokens=3, stop=["\x00"])])
    await worker.handle([Delivery("1-0", first)], claimed=False)
    worker._remember(delta(0, [69, 70]), 2)  # as a stop string found in [0, 2) does
    await worker.handle([Delivery("2-0", DetokenizeBatch("s", 2, [delta(2, [71])]))], claimed=False)
    entries = await worker.redis.xrange(worker.keys.reply("u"))
    assert [decode(f[FIELD], ReplyEvent).start for _, f in entries] == [0]


async def test_a_successors_steps_after_a_taken_over_schedulers_end_still_render(worker):
    """A stop string a taken-over scheduler's tokens hit says nothing of its successor's (epoch 1) tokens."""
    worker._remember(delta(0, [69, 70]), 2)
    late = DetokenizeBatch("s2", 1, [TokenDelta(uid="u", start=2, ids=[71], prompt_tokens=3, epoch=1)])
    await worker.handle([Delivery("3-0", late)], claimed=False)
    entries = await worker.redis.xrange(worker.keys.reply("u"))
    assert [(e.start, e.epoch) for e in (decode(f[FIELD], ReplyEvent) for _, f in entries)] == [(2, 1)]


async def test_a_replica_that_never_saw_the_first_delta_reads_the_stop_strings_from_the_record(worker,
                                                                                              random_model_dir):
    """Stop strings travel on a choice's first delta only; a replica that gets a later one (a peer rendered the
    first, it restarted, or a successor resumed the request) reads them from the record the scheduler wrote,
    with one round trip per read, then keeps them: it cuts the text where any replica would."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(random_model_dir)
    ids = tok.encode("hello world, and more", add_special_tokens=False)
    cut = len(tok.encode("hello", add_special_tokens=False))
    await worker.redis.hset(worker.keys.request("u"), mapping={"stop": '["world"]', "status": "running"})
    commands = []
    execute = type(worker.redis.pipeline()).execute

    async def counted(pipe, *a, **kw):
        commands.append([c[0][0] for c in pipe.command_stack])
        return await execute(pipe, *a, **kw)

    import unittest.mock

    later = TokenDelta(uid="u", start=cut, ids=ids[cut:], prompt_tokens=3, context=ids[:cut], stops=1)
    with unittest.mock.patch.object(type(worker.redis.pipeline()), "execute", counted):
        await worker.handle([Delivery("1-0", DetokenizeBatch("s", 1, [later]))], claimed=True)
    assert ["HMGET"] in commands  # the record, read once for the read
    entries = await worker.redis.xrange(worker.keys.reply("u"))
    ev = decode(entries[-1][1][FIELD], ReplyEvent)
    assert ev.finish_reason == "stop" and "world" not in ev.text, ev
    assert worker.stops.get("u") is None  # its last range: forgotten (a redone range reads the record again)
    # another request's later delta, its stop strings cached from its first delta: no lookup
    first = TokenDelta(uid="v", start=0, ids=ids[:1], prompt_tokens=3, stop=["zzz"], stops=1)
    second = TokenDelta(uid="v", start=1, ids=ids[1:2], prompt_tokens=3, context=ids[:1], stops=1)
    commands.clear()
    with unittest.mock.patch.object(type(worker.redis.pipeline()), "execute", counted):
        await worker.handle([Delivery("2-0", DetokenizeBatch("s", 2, [first]))], claimed=False)
        await worker.handle([Delivery("3-0", DetokenizeBatch("s", 3, [second]))], claimed=False)
    assert not any("HGET" in c for c in commands) and worker.stops.get("v") == ["zzz"]


async def test_a_one_choice_end_writes_its_generated_tokens_with_its_status(worker):
    """Issue 34: a request of one choice has its `generated_tokens` (what its tenant is charged) written by the
    HSET of its end, not an HINCRBY more; choices of an n > 1 request still sum theirs."""
    r = worker.redis
    before = (await r.info("commandstats")).get("cmdstat_hincrby", {}).get("calls", 0)
    batch = DetokenizeBatch("s", 1, [TokenDelta(uid="one", start=0, ids=[69, 70, 71], prompt_tokens=3,
                                                finish="length"),
                                     *(TokenDelta(uid="two", start=0, ids=[69] * (i + 1), prompt_tokens=3, index=i,
                                                  n=2, finish="length") for i in range(2))])
    await worker.handle([Delivery("1-0", batch)], claimed=False)
    after = (await r.info("commandstats")).get("cmdstat_hincrby", {}).get("calls", 0)
    assert after - before == 2  # the two choices of "two"
    one, two = [await r.hmget(worker.keys.request(u), "status", "generated_tokens") for u in ("one", "two")]
    assert one == [b"finished", b"3"] and two[1] == b"3"


async def test_a_running_choice_writes_its_progress_by_time_not_by_tokens(worker, monkeypatch):
    """Issue 34: the record's completion_tokens and the stream's TTL go with a choice's first entry, then at most
    once every PROGRESS_EVERY_S (however many tokens pass: at a GPU's rates 64 tokens take a fraction of a
    second), and with its end."""
    from services.detokenizer import main

    clock = [1000.0]
    monkeypatch.setattr(main.time, "monotonic", lambda: clock[0])
    r, key = worker.redis, worker.keys.request("p")

    async def step(start: int, n: int, finish: str | None = None) -> int | None:
        batch = DetokenizeBatch("s", start, [TokenDelta(uid="p", start=start, ids=[69] * n, prompt_tokens=3,
                                                        finish=finish)])
        await worker.handle([Delivery(f"{start + 1}-0", batch)], claimed=False)
        value = await r.hget(key, "completion_tokens")
        return int(value) if value is not None else None

    assert await step(0, 1) is None and await r.ttl(worker.keys.reply("p")) > 0  # the first entry: the TTL
    await r.persist(worker.keys.reply("p"))
    assert await step(1, 200) is None  # 200 tokens within PROGRESS_EVERY_S: nothing written
    assert await r.ttl(worker.keys.reply("p")) == -1
    clock[0] += main.PROGRESS_EVERY_S
    assert await step(201, 1) == 202 and await r.ttl(worker.keys.reply("p")) > 0
    assert await step(202, 1) == 202  # not again at once
    await r.expire(worker.keys.reply("p"), 77)
    # the end: its status and count, but no EXPIRE (the TTL was set less than PROGRESS_EVERY_S before)
    assert await step(203, 1, "length") == 204 and ("p", 0) not in worker.marked
    assert 0 < await r.ttl(worker.keys.reply("p")) <= 77 and await r.hget(key, "status") == b"finished"


async def test_an_end_long_after_the_last_ttl_refresh_sets_the_streams_ttl(worker, monkeypatch):
    from services.detokenizer import main

    clock = [1000.0]
    monkeypatch.setattr(main.time, "monotonic", lambda: clock[0])
    for start, finish in ((0, None), (1, "length")):
        await worker.redis.expire(worker.keys.reply("q"), 77)
        batch = DetokenizeBatch("s", start, [TokenDelta(uid="q", start=start, ids=[69], prompt_tokens=3,
                                                        finish=finish)])
        await worker.handle([Delivery(f"{start + 1}-0", batch)], claimed=False)
        clock[0] += main.PROGRESS_EVERY_S
    assert await worker.redis.ttl(worker.keys.reply("q")) > 77  # the end's EXPIRE: the last was too long ago


async def test_a_progress_mark_whose_pipeline_failed_is_written_when_the_read_is_retried(worker, monkeypatch):
    """The marks are noted once the read's pipeline has gone: one that failed leaves them as they were, so the
    retry of the same read writes the progress it was due to write."""
    from redis.asyncio.client import Pipeline
    from redis.exceptions import ConnectionError as RedisConnectionError

    from services.detokenizer import main

    clock = [1000.0]
    monkeypatch.setattr(main.time, "monotonic", lambda: clock[0])
    first = DetokenizeBatch("s", 0, [TokenDelta(uid="f", start=0, ids=[69], prompt_tokens=3)])
    await worker.handle([Delivery("1-0", first)], claimed=False)
    clock[0] += main.PROGRESS_EVERY_S
    due = DetokenizeBatch("s", 1, [TokenDelta(uid="f", start=1, ids=[69, 70], prompt_tokens=3)])
    execute = Pipeline.execute

    async def fails_once(self, *args, **kwargs):
        monkeypatch.setattr(Pipeline, "execute", execute)
        raise RedisConnectionError("Redis went away")

    monkeypatch.setattr(Pipeline, "execute", fails_once)
    with pytest.raises(RedisConnectionError):
        await worker.handle([Delivery("2-0", due)], claimed=False)
    assert worker.marked[("f", 0)] == 1000.0  # as before the read
    await worker.handle([Delivery("2-0", due)], claimed=False)
    assert await worker.redis.hget(worker.keys.request("f"), "completion_tokens") == b"3"
    assert worker.marked[("f", 0)] == clock[0]
