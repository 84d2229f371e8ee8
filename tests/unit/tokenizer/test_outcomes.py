"""services/tokenizer/outcomes.py without Redis: what a read, a release from fair queueing's hold, a dead-lettered
entry and a claim decide, as effects (services/tokenizer/outbox.py), in the order one pipeline writes them."""

from __future__ import annotations

from services.tokenizer import outcomes
from services.tokenizer.fair import Plan
from services.tokenizer.outbox import (
    Ack,
    Answered,
    Barrier,
    EndAborted,
    EndFailed,
    EndTimedOut,
    Forward,
    LeaveQueue,
    Park,
    QueryAborted,
    Tokenized,
)
from services.tokenizer.outcomes import Held
from shared.consumer_group import Delivery
from shared.messages import ReplyError, SamplingParams, ScheduleJob, TokenizeJob, TokenizerAnswer, TokenizerQuery
from shared.request_states import Status

NOW = 1_000.0
REFUSED = ReplyError(message="too long", status=400, param="prompt")


def job(uid: str, deadline: float = NOW + 60, n: int = 1) -> TokenizeJob:
    return TokenizeJob(uid=uid, model="demo", pod="p", created_at=NOW, deadline=deadline,
                       params=SamplingParams(max_tokens=4, n=n), prompt="hi", tenant="acme")


def scheduled(uid: str, deadline: float = NOW + 60, tenant: str = "acme") -> ScheduleJob:
    return ScheduleJob(uid=uid, model="demo", pod="p", created_at=NOW, deadline=deadline,
                       params=SamplingParams(max_tokens=4), input_ids=[1, 2, 3], tenant=tenant)


def query(uid: str) -> TokenizerQuery:
    return TokenizerQuery(uid=uid, model="demo", pod="p", created_at=NOW, deadline=NOW + 60, prompt="hi")


def test_a_job_ends_aborted_timed_out_refused_or_tokenized(caplog):
    caplog.set_level("INFO")
    assert outcomes.job_end(job("x", n=2), scheduled("x"), "client") == EndAborted("x", 2, "client")
    assert outcomes.job_end(job("x"), None, None) == EndTimedOut("x")
    assert outcomes.job_end(job("x"), REFUSED, None) == EndFailed("x", REFUSED)
    assert outcomes.job_end(job("x"), scheduled("x"), None) == Tokenized("x", 3, 4)
    assert all("uid=x" in r.getMessage() for r in caplog.records) and len(caplog.records) == 3


def test_a_read_writes_records_then_past_a_barrier_sends_parks_leaves_and_acknowledges_what_is_not_held():
    """Records first (a scheduler must find `tokenized`), then the jobs sent (routed or not) and parked, the queue
    count of those that ended here, and one acknowledgement of every entry but those fair queueing holds."""
    batch = [Delivery(f"{i}-0", job(u)) for i, u in enumerate(("sent", "routed", "held", "parked", "bad", "gone"))]
    encoded = {u: scheduled(u, tenant="t") for u in ("sent", "routed", "held", "parked")} | {"bad": REFUSED}
    held = {u: Held(d.entry_id, encoded[u]) for d in batch if (u := d.msg.uid) in encoded and u != "bad"}
    plan = Plan(send=[held["sent"], held["routed"]], hold=[held["held"]], park=[held["parked"]])
    effects = outcomes.read(batch, encoded, {"gone": "client"}, plan, {"routed": "s1"})
    assert effects == [
        Tokenized("sent", 3, 4), Tokenized("routed", 3, 4), Tokenized("held", 3, 4), Tokenized("parked", 3, 4),
        EndFailed("bad", REFUSED), EndAborted("gone", 1, "client"), Barrier(),
        Forward(encoded["sent"], None), Forward(encoded["routed"], "s1"), Park(encoded["parked"]),
        LeaveQueue(["bad acme", "gone acme"]), Ack(["0-0", "1-0", "3-0", "4-0", "5-0"])]  # shared/queued.py `member`
    assert (outcomes.count(effects, Tokenized), outcomes.count(effects, EndFailed)) == (4, 1)  # the metrics


def test_an_entry_held_already_stays_pending_once():
    """A claimed-back entry fair queueing holds already (its keep-alive failed) is in no list of the plan but
    `kept`: not sent again, and not acknowledged."""
    d = Delivery("1-0", job("again"))
    encoded = {"again": scheduled("again", tenant="t")}
    effects = outcomes.read([d], encoded, {}, Plan(kept=[Held("1-0", encoded["again"])]), {})
    assert effects == [Tokenized("again", 3, 4), Barrier(), LeaveQueue([]), Ack([])]


def test_queries_end_with_their_answers_or_why_not_and_are_all_acknowledged():
    answer = TokenizerAnswer(tokens=[5, 6], count=2)
    batch = [Delivery(f"{i}-0", query(u)) for i, u in enumerate(("ok", "bad", "gone", "late"))]
    effects = outcomes.answers(batch, {"ok": answer, "bad": REFUSED}, {"gone": "client"})
    assert effects == [Answered("ok", answer, 2), EndFailed("bad", REFUSED), QueryAborted("gone", "client"),
                       EndTimedOut("late"), Ack(["0-0", "1-0", "2-0", "3-0"])]
    detokenized = TokenizerAnswer(prompt="hi", count=2)  # a /detokenize answer counts no prompt tokens
    assert outcomes.query_end(query("d"), detokenized, None) == Answered("d", detokenized, None)


def test_a_release_sends_the_live_ends_the_aborted_and_expired_and_acknowledges_all():
    batch = [Held("a/1-0", scheduled("go")), Held("2-0", scheduled("gone")),
             Held("3-0", scheduled("late", deadline=NOW)), Held("4-0", scheduled("routed"))]
    effects = outcomes.released(batch, {"gone": "client"}, NOW, {"routed": "s2"})
    assert effects == [Forward(batch[0].job, None), EndAborted("gone", 1, "client"), EndTimedOut("late"),
                       Forward(batch[3].job, "s2"), LeaveQueue(["gone acme", "late acme"]),
                       Ack(["a/1-0", "2-0", "3-0", "4-0"])]


def test_dead_lettered_entries_fail_and_only_jobs_leave_the_queue_count():
    effects = outcomes.dead([job("j"), query("q")])
    assert effects == [EndFailed("j", outcomes.DEAD_LETTERED), EndFailed("q", outcomes.DEAD_LETTERED),
                       LeaveQueue(["j acme"])]
    assert effects[0].error.code == "request_dead_lettered"


def test_claimed_entries_already_done_are_settled():
    """A job is done once a scheduler took it (past `tokenized`), a query once its record ended."""
    pairs = [("1-0", "new"), ("2-0", "tokenized"), ("3-0", "running"), ("4-0", "finished")]
    statuses = {"new": None, "tokenized": Status.TOKENIZED, "running": Status.RUNNING, "finished": Status.FINISHED}
    assert outcomes.settled(pairs, statuses, outcomes.forwarded) == ["3-0", "4-0"]
    assert outcomes.settled(pairs, statuses, outcomes.answered) == ["4-0"]


def test_going_on_keeps_the_encoded_jobs_with_their_entries():
    batch = [Delivery("1-0", job("a")), Delivery("2-0", job("b")), Delivery("3-0", job("c"))]
    encoded = {"a": scheduled("a"), "b": REFUSED}
    assert outcomes.going_on(batch, encoded) == [Held("1-0", encoded["a"])]
