"""--stream-flush-ms in the request book, on a fake clock (no Redis, no sleep): a choice's tokens merge while
holding them to the next step (expected as far off as the last two steps were apart) keeps the oldest within the
flush interval; its first token and its end go at once; and a checkpoint never claims tokens not yet published (a
successor resumes after it)."""

from __future__ import annotations

import pytest

from services.scheduler.arrivals import Admission, Found, Verdict
from services.scheduler.book import Ends, RequestBook, Unsent
from services.scheduler.effects import Checkpoint, Publish
from services.scheduler.engine.base import StepOutput
from services.scheduler.engine.synthetic import SyntheticEngine, SyntheticVocab
from shared.consumer_group import Delivery
from shared.messages import SamplingParams, ScheduleJob
from shared.tracing import Tracer

pytestmark = pytest.mark.timeout(30)
NOW = 1000.0


class Clock:
    """A monotonic clock the test moves: one engine step every `step_s`."""

    def __init__(self, step_s: float):
        self.t, self.step_s = 0.0, step_s

    def tick(self) -> float:
        self.t += self.step_s
        return self.t


def book_of(flush_ms: float, stream_interval: int = 1, checkpoint_every: int = 1000,
            entry_rate: float = 0.0) -> RequestBook:
    engine = SyntheticEngine(SyntheticVocab(range(20, 60)), max_context=256, step_s=0.0, sleep=lambda _s: None)
    return RequestBook(engine, "s1", checkpoint_every, Unsent(stream_interval, flush_ms / 1000, entry_rate))


def admit(book: RequestBook, uid: str, entry: str = "1-0", **params) -> None:
    job = ScheduleJob(uid=uid, model="m", pod="api-x", created_at=0.0, deadline=1e12, background=True,
                      params=SamplingParams(**params), input_ids=[11, 12, 13])
    adm = Admission(book, Tracer("scheduler", None))
    d = Delivery(entry, job)
    assert adm.verdict(d, False, Found(), NOW)[0] is Verdict.START
    adm.start(d, None)


def run(book: RequestBook, clock: Clock, steps: int) -> list[list[tuple[int, int]]]:
    """Per step: the (start, token count) of each delta it published."""
    out = []
    for _ in range(steps):
        effects = book.stepped(book.engine.step(), book.engine.steps, clock.tick())
        out.append([(d.start, len(d.ids)) for e in effects if isinstance(e, Publish) for d in e.deltas])
    return out


def test_tokens_wait_until_the_oldest_is_as_old_as_the_flush_interval_the_first_and_the_last_at_once():
    book, clock = book_of(flush_ms=10), Clock(0.004)  # 4 ms steps: a third would wait 12 ms
    admit(book, "a", max_tokens=9)
    per_step = run(book, clock, 9)
    assert per_step == [[(0, 1)], [], [], [(1, 3)], [], [], [(4, 3)], [], [(7, 2)]]
    assert not book.running and not book.unsent.held


def test_steps_slower_than_the_flush_interval_publish_every_step_as_without_it():
    book, clock = book_of(flush_ms=10), Clock(0.020)  # a CPU engine's 20 ms steps: nothing is merged
    admit(book, "a", max_tokens=5)
    assert run(book, clock, 5) == [[(0, 1)], [(1, 1)], [(2, 1)], [(3, 1)], [(4, 1)]]


def test_zero_publishes_every_step_and_either_form_sends_when_both_are_set():
    book, clock = book_of(flush_ms=0), Clock(0.001)
    admit(book, "a", max_tokens=4)
    assert run(book, clock, 4) == [[(0, 1)], [(1, 1)], [(2, 1)], [(3, 1)]]
    book, clock = book_of(flush_ms=10, stream_interval=2), Clock(0.001)  # 2 steps come before 10 ms
    admit(book, "a", max_tokens=6)
    assert run(book, clock, 6) == [[(0, 1)], [], [(1, 2)], [], [(3, 2)], [(5, 1)]]
    book, clock = book_of(flush_ms=10, stream_interval=8), Clock(0.004)  # 10 ms come before 8 steps
    admit(book, "a", max_tokens=5)
    assert run(book, clock, 5) == [[(0, 1)], [], [], [(1, 3)], [(4, 1)]]


def test_a_choice_a_step_made_nothing_for_goes_once_its_tokens_are_due():
    book = book_of(flush_ms=10)
    admit(book, "a", max_tokens=50)
    out = lambda start: StepOutput("a", start, [30])  # noqa: E731
    assert [d.start for e in book.stepped([out(0)], 1, 0.000) for d in e.deltas] == [0]
    assert book.stepped([out(1)], 2, 0.004) == []
    assert book.stepped([], 3, 0.008) == []  # e.g. preempted: nothing new, nothing due
    [pub] = book.stepped([], 4, 0.014)
    assert [(d.start, d.ids) for d in pub.deltas] == [(1, [30])]


@pytest.mark.parametrize("flush_ms, interval", [(10, 1), (0, 3)], ids=["by-time", "by-steps"])
def test_a_checkpoint_waits_until_no_choice_of_its_request_holds_unsent_tokens(flush_ms, interval):
    """Choice 0 ends (published at once) while choice 1's tokens wait: a checkpoint then would claim choice 1's
    unsent tokens, and a successor resuming from it would never send them (--stream-interval alone did)."""
    book = book_of(flush_ms=flush_ms, stream_interval=interval, checkpoint_every=16)
    admit(book, "a", max_tokens=100, n=2)
    out = lambda i, start, k, finish=None: StepOutput("a", start, [30] * k, i, finish)  # noqa: E731
    book.stepped([out(0, 0, 1), out(1, 0, 1)], 1, 0.000)  # both first tokens go at once
    assert book.stepped([out(0, 1, 20), out(1, 1, 20)], 2, 0.001) == []  # both wait
    effects = book.stepped([out(0, 21, 20, "length"), out(1, 21, 20)], 3, 0.002)
    [pub] = effects  # choice 0's end with its waiting tokens; no checkpoint while choice 1's wait
    assert [(d.index, d.start, len(d.ids)) for d in pub.deltas] == [(0, 1, 40)]
    effects = book.stepped([out(1, 41, 1)], 4, 0.011)
    assert [(d.index, d.start, len(d.ids)) for e in effects if isinstance(e, Publish) for d in e.deltas] == [
        (1, 1, 41)]
    [ck] = [e.checkpoint for e in effects if isinstance(e, Checkpoint)]
    assert [len(o) for o in ck.outputs] == [41, 42]  # everything published so far, no more


def test_an_abort_publishes_the_waiting_tokens_before_its_end_and_a_stop_drops_them():
    book, clock = book_of(flush_ms=10), Clock(0.001)
    admit(book, "a", "1-0", max_tokens=50)
    admit(book, "b", "2-0", max_tokens=50, n=2, stop=["zz"])
    run(book, clock, 3)
    assert set(book.unsent.held) == {("a", 0), ("b", 0), ("b", 1)}
    assert book.end(Ends(choices={("b", 0)}), 4) == [] and set(book.unsent.held) == {("a", 0), ("b", 1)}
    [_, pub, _] = book.end(Ends({"a": "client_gone"}), 4)
    assert [(d.start, len(d.ids), d.finish) for d in pub.deltas] == [(1, 2, None), (3, 0, "abort")]
    assert [(d.uid, d.start, len(d.ids)) for d in book.unsent_now(4)[0].deltas] == [("b", 1, 2)]


def test_paced_a_few_streams_publish_every_step_and_hundreds_merge_up_to_the_flush_interval():
    """--stream-entry-rate R: a token waits (choices this step) / R, at most --stream-flush-ms: with 1,000 deltas a
    second to spend, 2 streams at 4 ms steps publish every step (a hold of 2 ms), 40 of them hold 40 ms, capped at
    the 10 ms flush interval: a delta per 3 steps, as unpaced."""
    few, clock = book_of(flush_ms=10, entry_rate=1000), Clock(0.004)
    for uid in ("a", "b"):
        admit(few, uid, f"{uid}-0", max_tokens=6)
    assert [len(step) for step in run(few, clock, 6)] == [2] * 6
    assert few.unsent.hold_s == pytest.approx(0.002)

    many, clock = book_of(flush_ms=10, entry_rate=1000), Clock(0.004)
    for k in range(40):
        admit(many, f"r{k}", f"{k}-0", max_tokens=9)
    sizes = run(many, clock, 9)
    assert many.unsent.hold_s == pytest.approx(0.010)  # 40 / 1000 = 40 ms, capped
    assert all(step == [(0, 1)] * 40 or not step or len(set(step)) == 1 for step in sizes)
    assert [step[0] if step else None for step in sizes] == [(0, 1), None, None, (1, 3), None, None, (4, 3), None,
                                                              (7, 2)]


def test_unpaced_every_choice_holds_for_the_flush_interval_whatever_the_count():
    book, clock = book_of(flush_ms=10), Clock(0.004)
    admit(book, "a", max_tokens=9)
    assert run(book, clock, 9)[:4] == [[(0, 1)], [], [], [(1, 3)]] and book.unsent.hold_s == 0.010
