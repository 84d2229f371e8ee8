"""The request book and admission without Redis (the synthetic engine, no sleep): what each verdict, step and end
becomes as effects, and that the effect writer queues the acknowledgement after every write. What Redis does
with those effects is tests/unit/scheduler/test_recovery.py's subject."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from services.scheduler.arrivals import Admission, Found, Resumed, Verdict
from services.scheduler.book import Ends, RequestBook, Unsent
from services.scheduler.effects import (
    Ack,
    Checkpoint,
    EffectWriter,
    EndAborted,
    Fail,
    Publish,
    RecordAbort,
    RecordRunning,
)
from services.scheduler.engine.synthetic import SyntheticEngine, SyntheticVocab
from services.scheduler.lanes import PageChanges, SchedulerLanes
from shared import streams
from shared.consumer_group import Delivery, GroupConsumer
from shared.keys import Keys
from shared.messages import ReplyError, ReplyEvent, ReplyFence, SamplingParams, ScheduleJob
from shared.reply_order import ProducedTokens
from shared.request_store import RequestStore
from shared.streams import Member
from shared.tracing import Tracer

pytestmark = pytest.mark.timeout(30)
NOW = 1000.0


def job(uid: str, max_tokens: int = 5, deadline: float = 1e12, prompt: list[int] | None = None,
        **params) -> ScheduleJob:
    return ScheduleJob(uid=uid, model="m", pod="api-x", created_at=0.0, deadline=deadline, background=True,
                       params=SamplingParams(max_tokens=max_tokens, **params), input_ids=prompt or [11, 12, 13])


def delivery(uid: str, entry: str = "1-0", **kw) -> Delivery[ScheduleJob]:
    return Delivery(entry, job(uid, **kw))


def book_of(stream_interval: int = 1, checkpoint_every: int = 1000) -> tuple[RequestBook, Admission]:
    engine = SyntheticEngine(SyntheticVocab(range(20, 60)), max_context=64, step_s=0.0, sleep=lambda _s: None)
    book = RequestBook(engine, "s1", checkpoint_every, Unsent(stream_interval))
    return book, Admission(book, Tracer("scheduler", None))


def admitted(book: RequestBook, adm: Admission, *deliveries: Delivery[ScheduleJob]) -> None:
    for d in deliveries:
        verdict, effects = adm.verdict(d, False, Found(), NOW)
        assert (verdict, effects) == (Verdict.START, [])
        [started] = adm.start(d, None)
        assert isinstance(started, RecordRunning)


def step(book: RequestBook, n: int = 1) -> list:
    effects = []
    for _ in range(n):
        effects += book.stepped(book.engine.step(), book.engine.steps)
    return effects


def test_verdicts_before_anything_runs():
    _, adm = book_of()
    d = delivery("u1", "7-0")
    assert adm.verdict(d, True, Found(owner="s2", owner_entry="6-0"), NOW) == (Verdict.ENDED, [Ack(["7-0"])])
    assert adm.verdict(d, False, Found(owner="s2"), NOW) == (Verdict.WAIT, [])  # a peer claimed it from us
    assert adm.verdict(d, False, Found(aborted="client_gone"), NOW) == (
        Verdict.ENDED, [EndAborted("u1", 1, "client_gone", 3), Ack(["7-0"])])
    verdict, [fail, ack] = adm.verdict(delivery("u1", "7-0", deadline=NOW - 1), False, Found(), NOW)
    assert verdict is Verdict.ENDED and fail.error.status == 504 and ack == Ack(["7-0"])
    assert adm.verdict(d, True, Found(owner="s2", owner_entry="7-0"), NOW) == (Verdict.START, [])  # claimed


def test_a_request_delivered_twice_runs_once_and_our_own_claimed_entry_is_taken_over_anew():
    book, adm = book_of()
    d = delivery("u1", "7-0")
    admitted(book, adm, d)
    assert adm.verdict(d, False, Found(owner="s1", owner_entry="7-0"), NOW) == (Verdict.WAIT, [])
    assert adm.verdict(delivery("u1", "8-0"), True, Found(), NOW) == (Verdict.WAIT, [])  # another entry, running
    assert adm.verdict(d, True, Found(owner="s1", owner_entry="7-0"), NOW) == (Verdict.START, [])
    assert "u1" not in book.running and not book.engine.has_work()  # dropped: to be resumed under a new epoch


def test_start_records_the_request_running_or_ends_it_here():
    book, adm = book_of()
    [running] = adm.start(delivery("u1", stop=["zz"]), None)
    assert running == RecordRunning("u1", "1-0", 5, '["zz"]') and "u1" in book.running
    too_long = adm.start(delivery("u2", max_tokens=100), None)
    assert [type(e) for e in too_long] == [Fail, Ack] and too_long[0].error.status == 400
    assert too_long[0].error.code == "context_length_exceeded" and "u2" not in book.running
    done = ProducedTokens(1)
    done.add(ReplyEvent(start=0, end=2, text="ab", ids=[21, 22], prompt_tokens=3, finish_reason="length"))
    assert adm.start(delivery("u3"), Resumed(done, 1)) == [Ack(["1-0"])]  # it ended before its owner died
    failed = ProducedTokens(1)
    failed.add(ReplyError(message="boom"))
    assert adm.start(delivery("u4"), Resumed(failed, 1)) == [Ack(["1-0"])]
    assert set(book.running) == {"u1"}


def test_a_takeover_resumes_from_what_the_client_has_under_its_epoch():
    book, adm = book_of()
    produced = ProducedTokens(1)
    produced.add(ReplyEvent(start=0, end=2, text="ab", ids=[21, 22], prompt_tokens=3))
    produced.add(ReplyFence(epoch=3, scheduler="s1"))
    adm.start(delivery("u1"), Resumed(produced, 3))
    run = book.running["u1"]
    assert run.outputs == [[21, 22]] and run.epoch == 3 and run.checkpointed == 2
    [publish, *_] = step(book)
    assert publish.deltas[0].start == 2 and publish.deltas[0].epoch == 3


def test_refusing_a_request_that_raised_at_admission_forgets_it():
    book, adm = book_of()
    admitted(book, adm, delivery("u1"))
    [fail, ack] = adm.refuse(delivery("u1", "1-0"), RuntimeError("bad job"))
    assert "could not start the request: RuntimeError: bad job" in fail.error.message and fail.error.status == 500
    assert ack == Ack(["1-0"]) and not book.running and not book.engine.has_work()


def test_each_step_is_one_publish_and_a_request_that_ends_is_acknowledged_after_it():
    book, adm = book_of()
    admitted(book, adm, delivery("a", "1-0", max_tokens=2), delivery("b", "2-0", max_tokens=4))
    first = step(book)
    assert [type(e) for e in first] == [Publish]
    assert sorted(d.uid for d in first[0].deltas) == ["a", "b"] and first[0].step == 1
    second = step(book)
    assert [type(e) for e in second] == [Publish, Ack] and second[1] == Ack(["1-0"])
    assert [d.finish for d in second[0].deltas if d.uid == "a"] == ["length"]
    assert set(book.running) == {"b"} and book.held_entries() == ["2-0"]


def test_a_checkpoint_is_due_after_enough_tokens():
    book, adm = book_of(checkpoint_every=4)
    admitted(book, adm, delivery("a", max_tokens=40))
    effects = step(book, 20)
    [ck] = [e for e in effects if isinstance(e, Checkpoint)]  # at least 16 tokens per choice between two
    assert ck.uid == "a" and [len(o) for o in ck.checkpoint.outputs] == [16]


def test_with_a_stream_interval_a_choice_publishes_its_first_tokens_at_once_then_merged_steps_and_its_last():
    book, adm = book_of(stream_interval=3)
    admitted(book, adm, delivery("a", max_tokens=8))
    published = [d for e in step(book, 8) if isinstance(e, Publish) for d in e.deltas]
    assert [(d.start, len(d.ids)) for d in published] == [(0, 1), (1, 3), (4, 3), (7, 1)]
    assert published[-1].finish == "length"


def test_ends_become_effects_by_reason():
    book, adm = book_of(stream_interval=4)
    names = ["gone", "late", "stopped", "peer"]
    admitted(book, adm, *(delivery(u, f"{i}-0", max_tokens=20) for i, u in enumerate(names)))
    step(book, 2)  # each choice's second token waits for the interval: unsent
    effects = book.end(Ends({"gone": "client_gone", "late": "timeout", "stopped": "stop", "peer": "taken_over",
                             "unknown": "client_gone"}), 3)
    assert [type(e) for e in effects] == [RecordAbort, Publish, Ack, Fail, Ack, Ack]
    assert effects[0] == RecordAbort("gone", "client_gone")
    assert [(d.start, d.ids != [], d.finish) for d in effects[1].deltas] == [(1, True, None), (2, False, "abort")]
    assert effects[3].error.status == 504
    assert [e.entries for e in effects if isinstance(e, Ack)] == [["0-0"], ["1-0"], ["2-0"]]  # none for "peer"
    assert not book.running and not book.engine.has_work()


def test_a_stop_string_ends_one_choice_then_the_request():
    book, adm = book_of()
    admitted(book, adm, delivery("a", max_tokens=20, n=2, stop=["zz"]))
    step(book)
    assert book.stoppable() == [("a", 0), ("a", 1)]
    assert book.end(Ends(choices={("a", 0)}), 2) == []
    assert {s.index for s in book.engine.running} == {1} and book.stoppable() == [("a", 1)]
    assert book.end(Ends(choices={("a", 1)}), 2) == [Ack(["1-0"])] and not book.running


def test_deadlines_and_entries_a_peer_took_are_due_ends_and_stale_ttls_are_marked():
    book, adm = book_of()
    admitted(book, adm, delivery("a", "1-0"), delivery("b", "2-0", deadline=NOW + 1), delivery("c", "3-0"))
    assert book.ends_due(NOW + 1, {"3-0"}).requests == {"b": "timeout", "c": "taken_over"}
    book.running["a"].refreshed -= 100
    assert [r.job.uid for r in book.stale(book.running["b"].refreshed + 50, 60)] == ["a"]
    assert book.stale(book.running["b"].refreshed + 50, 60) == []  # marked refreshed


def test_a_failed_step_fails_every_request_it_held():
    book, adm = book_of()
    admitted(book, adm, delivery("a", "1-0"), delivery("b", "2-0", n=2))
    effects = book.stepped(book.failed_step(RuntimeError("kernel fault")), 1)
    assert [type(e) for e in effects] == [Fail, Ack, Fail, Ack]
    assert all("engine error: kernel fault" in e.error.message for e in effects if isinstance(e, Fail))
    assert not book.running


def test_a_refused_admission_is_rolled_back():
    book, adm = book_of()
    admitted(book, adm, delivery("a"))
    book.roll_back(["a", "never"])
    assert not book.running and not book.engine.has_work()


@pytest.mark.parametrize("flagged", [False, True])
def test_the_writer_acknowledges_once_after_every_write_of_the_pipeline(flagged, monkeypatch):
    monkeypatch.setattr(streams, "scripts_flagged", lambda: flagged)  # Redis 7+: one flagged script, no MULTI
    keys = Keys("t")
    redis = Redis()  # never connected: the pipeline only queues
    source = GroupConsumer(redis, keys.schedule("m"), Member("scheduler", "s1"), ScheduleJob, keys.dead())
    lanes = SchedulerLanes(redis, keys, "m", source, page_size=16, heartbeat_ttl_s=5)
    writer = EffectWriter(RequestStore(redis, keys, ttl=60, maxlen=100), source, lanes, "s1", keys.detokenize("m"),
                          detokenize_budget_mb=1)
    book, adm = book_of()
    admitted(book, adm, delivery("a", max_tokens=1))
    pipe = redis.pipeline(transaction=False)
    writer.apply(pipe, [Fail("x", ReplyError(message="e")), Ack(["1-0"]), *step(book), PageChanges(["ab"], []),
                        Ack(["2-0"])])
    names = [c[0][0] for c in pipe.command_stack]
    # one acknowledgement, of the entries this scheduler still holds (shared/streams.py `ack_own`)
    if flagged:
        assert names[-1] == "EVAL" and "MULTI" not in names and "XACK" not in names
    else:
        assert names[-3:] == ["MULTI", "EVAL", "EXEC"] and "XACK" not in names
    ack = pipe.command_stack[-1 if flagged else -2][0]
    assert ack[1].startswith("#!lua\n") == flagged
    assert ack[3:6] == (keys.schedule("m"), "scheduler", "s1")
    assert ack[6:8] == ("1-0", "2-0")  # the range the script reads what s1 holds in
    assert ack[8:] == ("1-0", "1-0", "2-0")  # "a" ended in its first step: entry 1-0 too
    assert {"XADD", "HSET", "SADD", "PEXPIRE"} <= set(names)


def test_a_prefill_only_answer_goes_to_its_reply_stream_and_ends_the_request():
    """An embedding's one output (services/scheduler/engine/pooling.py) is no delta for a detokenizer: it is written
    to the reply stream (base64 of its float32) with the record finished, and its entry acknowledged."""
    import base64

    import numpy as np

    from services.scheduler.book import Running
    from services.scheduler.effects import Pooled
    from services.scheduler.engine.base import StepOutput
    from shared.messages import Pooling

    book, adm = book_of()
    admitted(book, adm, delivery("g"))  # a generation in the same step
    book.running["e"] = Running("9-0", job("e", max_tokens=1, pooling=Pooling("embed")), [[]])
    vector = np.asarray([0.5, -1.25, 3.0], dtype="<f4")
    outputs = [StepOutput("e", 0, [], 0, "stop", cached_tokens=2, embedding=vector.tobytes()), *book.engine.step()]
    effects = book.stepped(outputs, 1)
    [pooled] = [e for e in effects if isinstance(e, Pooled)]
    assert pooled.uid == "e" and Ack(["9-0"]) in effects and "e" not in book.running
    ev = pooled.event
    assert (ev.start, ev.end, ev.finish_reason, ev.prompt_tokens, ev.cached_tokens) == (0, 0, "stop", 3, 2)
    assert np.frombuffer(base64.b64decode(ev.embedding), dtype="<f4").tolist() == vector.tolist()
    [publish] = [e for e in effects if isinstance(e, Publish)]
    assert {d.uid for d in publish.deltas} == {"g"}  # only the generation goes to the detokenizer
    keys = Keys("t")
    redis = Redis()  # never connected: the pipeline only queues
    source = GroupConsumer(redis, keys.schedule("m"), Member("scheduler", "s1"), ScheduleJob, keys.dead())
    writer = EffectWriter(RequestStore(redis, keys, ttl=60, maxlen=100), source,
                          SchedulerLanes(redis, keys, "m", source, page_size=16, heartbeat_ttl_s=5), "s1",
                          keys.detokenize("m"), detokenize_budget_mb=1)
    pipe = redis.pipeline(transaction=False)
    writer.apply(pipe, [pooled])
    commands = [c[0] for c in pipe.command_stack]
    assert any(c[0] == "XADD" and c[1] == keys.reply("e") for c in commands)
    assert any(c[0] == "HSET" and "finished" in c for c in commands)


def test_an_engine_without_pooling_refuses_prefill_only_requests():
    from shared.messages import Pooling

    _, adm = book_of()
    [fail, ack] = adm.start(delivery("e", pooling=Pooling("score", label_token_ids=[1])), None)
    assert fail.error.status == 400 and "paged engine" in fail.error.message and ack == Ack(["1-0"])
