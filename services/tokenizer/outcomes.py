"""What the tokenizer decides, as effects (services/tokenizer/outbox.py), never written here: how each job and query
of a read ends or goes on, what a release from fair queueing's hold sends or ends, what a dead-lettered entry's
client is told, and which claimed entries are done already. No Redis: what Redis said (abort flags, statuses) and
what the other decisions chose (fair queueing's plan: services/tokenizer/fair.py; routes:
services/tokenizer/router.py) come in as arguments, so tests/unit/tokenizer/test_outcomes.py runs it alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec

from services.tokenizer.fair import Plan
from services.tokenizer.outbox import (
    Ack,
    Answered,
    Barrier,
    Effect,
    EndAborted,
    EndFailed,
    EndTimedOut,
    Forward,
    LeaveQueue,
    Park,
    QueryAborted,
    Tokenized,
)
from shared import queued
from shared.consumer_group import Delivery
from shared.messages import ReplyError, ScheduleJob, TokenizeJob, TokenizerAnswer, TokenizerQuery
from shared.request_states import NOT_SCHEDULED, TERMINAL

log = logging.getLogger(__name__)

DEAD_LETTERED = ReplyError(message="the request could not be tokenized: every attempt failed",
                           code="request_dead_lettered")


class Held(msgspec.Struct, frozen=True):
    """A tokenized job fair queueing holds: its entry (the tokenize stream's, or `<tenant>/<id>` of its tenant's
    parked stream), pending and ours, and what goes to a scheduler."""

    entry_id: str
    job: ScheduleJob


def going_on(batch: Sequence[Delivery], encoded: dict[str, Any]) -> list[Held]:
    """The read's jobs that go on to a scheduler, with their entries."""
    return [Held(d.entry_id, job) for d in batch if isinstance(job := encoded.get(d.msg.uid), ScheduleJob)]


def job_end(job: TokenizeJob, result: ScheduleJob | ReplyError | None, aborted: str | None) -> Effect:
    """A job's record (and any error reply): aborted, timed out (never encoded), refused, or tokenized."""
    uid = job.uid
    if aborted is not None:
        log.info("uid=%s skipped: aborted (%s)", uid, aborted)
        return EndAborted(uid, job.params.n, aborted)
    if result is None or isinstance(result, ReplyError):
        return _not_done(uid, result)
    return Tokenized(uid, len(result.input_ids), result.params.max_tokens)


def _not_done(uid: str, result: ReplyError | None) -> Effect:
    """The end of a job or query that was not encoded: its deadline passed first (None), or it was refused."""
    if result is None:
        log.info("uid=%s skipped: deadline passed", uid)
        return EndTimedOut(uid)
    log.info("uid=%s refused: %s", uid, result.message)
    return EndFailed(uid, result)


def read(batch: Sequence[Delivery[TokenizeJob]], encoded: dict[str, ScheduleJob | ReplyError],
         aborted: dict[str, str], plan: Plan[Held], routes: dict[str, str | None]) -> list[Effect]:
    """A read's jobs: each record, then (past a barrier: the record says `tokenized` before a scheduler can read the
    job and write `running`, and on a cluster the two are on different nodes) the jobs sent on and parked, the
    queue count of those that ended, and the acknowledgement of every entry but those fair queueing holds (they
    stay pending until released)."""
    jobs = [d.msg for d in batch]
    waiting = {h.entry_id for h in (*plan.hold, *plan.kept)}
    return [*(job_end(j, encoded.get(j.uid), aborted.get(j.uid)) for j in jobs), Barrier(),
            *(Forward(h.job, routes.get(h.job.uid)) for h in plan.send), *(Park(h.job) for h in plan.park),
            LeaveQueue(queued.members(j for j in jobs if not isinstance(encoded.get(j.uid), ScheduleJob))),
            Ack([d.entry_id for d in batch if d.entry_id not in waiting])]


def query_end(query: TokenizerQuery, result: TokenizerAnswer | ReplyError | None, aborted: str | None) -> Effect:
    """A query's reply and its record's end."""
    uid = query.uid
    if aborted is not None:  # its client is gone: nobody reads a reply
        log.info("uid=%s skipped: aborted (%s)", uid, aborted)
        return QueryAborted(uid, aborted)
    if result is None or isinstance(result, ReplyError):
        return _not_done(uid, result)
    return Answered(uid, result, result.count if result.tokens else None)


def answers(batch: Sequence[Delivery[TokenizerQuery]], results: dict[str, TokenizerAnswer | ReplyError],
            aborted: dict[str, str]) -> list[Effect]:
    """A read's queries: each one's end, and the acknowledgement of them all."""
    return [*(query_end(d.msg, results.get(d.msg.uid), aborted.get(d.msg.uid)) for d in batch),
            Ack([d.entry_id for d in batch])]


def released(batch: Sequence[Held], aborted: dict[str, str], now: float, routes: dict[str, str | None]
             ) -> list[Effect]:
    """Jobs fair queueing releases: each sent on, or ended if it was aborted or expired while held; the queue count
    of those that ended, and the acknowledgement of them all."""
    out: list[Effect] = []
    for h in batch:
        uid = h.job.uid
        if uid in aborted:
            log.info("uid=%s skipped while held: aborted (%s)", uid, aborted[uid])
            out.append(EndAborted(uid, h.job.params.n, aborted[uid]))
        elif h.job.deadline <= now:
            log.info("uid=%s skipped while held: deadline passed", uid)
            out.append(EndTimedOut(uid))
        else:
            out.append(Forward(h.job, routes.get(uid)))
    ended = queued.members(h.job for h in batch if h.job.uid in aborted or h.job.deadline <= now)
    return [*out, LeaveQueue(ended), Ack([h.entry_id for h in batch])]


def dead(messages: Sequence[TokenizeJob | TokenizerQuery]) -> list[Effect]:
    """Entries whose handling failed every time they were delivered: their clients get the error now."""
    return [*(EndFailed(m.uid, DEAD_LETTERED) for m in messages),
            LeaveQueue(queued.members(m for m in messages if isinstance(m, TokenizeJob)))]


def count(effects: Iterable[Effect], kind: type) -> int:
    """How many of the effects are of one kind (the stage's metrics count what it publishes)."""
    return sum(isinstance(e, kind) for e in effects)


def forwarded(status: str | None) -> bool:
    """A claimed job a scheduler took already (its record says so). One `tokenized` may or may not have reached
    the schedule stream (its record is written first): it is forwarded again, and a scheduler drops the duplicate."""
    return status is not None and status not in NOT_SCHEDULED


def answered(status: str | None) -> bool:
    """A claimed query a dead peer answered before it could acknowledge it."""
    return status in TERMINAL


def settled(entries: Sequence[tuple[str, str]], statuses: dict[str, Any], done: Callable[[Any], bool]) -> list[str]:
    """Of claimed (entry, uid) pairs, the entries whose record's status says they are `done`: acknowledged, not
    done again."""
    return [entry for entry, uid in entries if done(statuses[uid])]
