"""Admission, the request book's door (services/scheduler/book.py): what a delivered schedule entry becomes (left
pending, ended here, or run), given what Redis holds of its request (`Found`, and `Resumed` after a takeover: both
read by services/scheduler/recovery.py). No Redis: it returns effects, and adds what runs to the book and the
engine.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import msgspec

from services.scheduler.book import RequestBook, Running
from services.scheduler.effects import Ack, Effect, EndAborted, Fail, RecordRunning
from services.scheduler.engine.base import EngineRequest, RequestRejected
from shared.consumer_group import Delivery
from shared.messages import ReplyError, ScheduleJob
from shared.reply_order import ProducedTokens
from shared.request_states import EndReason
from shared.request_store import deadline_error
from shared.tracing import Tracer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Found:
    """What Redis holds of a delivered request when it is admitted (services/scheduler/recovery.py `look_up`)."""

    aborted: str | None = None  # the reason in its abort flag
    owner: str | None = None  # the scheduler its record names
    owner_entry: str | None = None  # the schedule entry that scheduler admitted


@dataclass(frozen=True)
class Resumed:
    """What a takeover found (services/scheduler/recovery.py `take_over`): the tokens before its fence."""

    produced: ProducedTokens
    epoch: int


class Verdict(enum.Enum):
    WAIT = "wait"  # not ours to act on now: left pending, unacknowledged
    ENDED = "ended"  # ended here without running: its effects say how, and acknowledge it
    START = "start"  # to hand to the engine (`Admission.start`), after a takeover when claimed


class Admission:
    def __init__(self, book: RequestBook, tracer: Tracer):
        self.book, self.tracer = book, tracer

    def verdict(self, d: Delivery[ScheduleJob], claimed: bool, found: Found, now: float
                ) -> tuple[Verdict, list[Effect]]:
        """What to do with a delivered entry before anything runs: wait, end it here, or start it."""
        job, running = d.msg, self.book.running
        if job.uid in running:
            if not (claimed and running[job.uid].entry_id == d.entry_id):
                return Verdict.WAIT, []  # delivered twice to us: already running
            # Its entry went idle while we ran it: we stalled past the claim idle, and a peer may have taken it
            # over and died before it recorded itself as the owner. What we run may be fenced out: take it over
            # like any claimed entry, under a new epoch.
            log.info("uid=%s: our own entry was idle long enough to claim; resuming it anew", job.uid)
            self.book.drop(job.uid, EndReason.TAKEN_OVER, 0)  # nothing to write: the entry and the reply are the peer's
        if found.owner and found.owner_entry and found.owner_entry != d.entry_id:
            # Another schedule entry of the same request was admitted (the tokenizer forwarded it twice):
            # acknowledge this one, or every claim interval a peer would resume the request from it and take it
            # from its owner, back and forth.
            log.info("uid=%s duplicate schedule entry dropped (admitted by %s)", job.uid, found.owner)
            return Verdict.ENDED, [Ack([d.entry_id])]
        if not claimed and found.owner:  # we were hung; a peer claimed this very entry: it is theirs
            log.info("uid=%s was taken over by %s while we were stalled", job.uid, found.owner)
            return Verdict.WAIT, []
        if found.aborted is not None:
            return Verdict.ENDED, [EndAborted(job.uid, job.params.n, found.aborted, len(job.input_ids)),
                                   Ack([d.entry_id])]
        if job.deadline <= now:
            return Verdict.ENDED, [Fail(job.uid, deadline_error()), Ack([d.entry_id])]
        return Verdict.START, []

    def start(self, d: Delivery[ScheduleJob], resumed: Resumed | None) -> list[Effect]:
        """Hand a request to the engine (from where `resumed` found its client, when claimed); its record then
        says it runs here. Or end it here, if it ended before or the engine refuses it."""
        job, n = d.msg, d.msg.params.n
        outputs, done, epoch = [[] for _ in range(n)], set(), 0
        if resumed is not None:
            produced, epoch = resumed.produced, resumed.epoch
            if produced.failed or produced.done:
                return [Ack([d.entry_id])]
            if produced.unresumable:
                log.error("uid=%s cannot resume: its reply stream was trimmed past every checkpoint", job.uid)
                return [Fail(job.uid, ReplyError(message="the request could not be resumed after its scheduler "
                                                         "failed")), Ack([d.entry_id])]
            outputs, done = produced.outputs, set(produced.finished)
            log.info("uid=%s resumed after %s tokens (epoch %d)", job.uid, [len(o) for o in outputs], epoch)
        try:
            max_tokens = self.book.engine.add(EngineRequest(job.uid, job.input_ids, job.params,
                                                            outputs if resumed is not None else [],
                                                            adapter=job.adapter, cache_salt=job.cache_salt,
                                                            ttft_due=job.ttft_due))
        except RequestRejected as e:
            log.info("uid=%s rejected by the engine: %s", job.uid, e)
            status = 404 if e.code == "model_not_found" else 400  # a LoRA adapter no longer registered
            return [Fail(job.uid, ReplyError(message=str(e), status=status, type="invalid_request_error",
                                             code=e.code, param=e.param)), Ack([d.entry_id])]
        span = self.tracer.start("schedule", job.trace, uid=job.uid, scheduler=self.book.id,
                                 resumed=resumed is not None, prompt_tokens=len(job.input_ids))
        self.book.add(Running(d.entry_id, job, outputs, done, span, epoch=epoch))
        # The stop strings, for a detokenizer that did not see a choice's first delta (shared/messages.py
        # TokenDelta); written before any delta of the request is published.
        stop = msgspec.json.encode(job.params.stop).decode() if job.params.stop else None
        return [RecordRunning(job.uid, d.entry_id, max_tokens, stop)]

    def refuse(self, d: Delivery[ScheduleJob], error: Exception) -> list[Effect]:
        """Admitting it raised (a bug, or an engine that cannot take this job): it fails alone, with a 500."""
        self.book.forget(d.msg.uid)
        return [Fail(d.msg.uid, ReplyError(message=f"the scheduler could not start the request: "
                                                   f"{type(error).__name__}: {error}")), Ack([d.entry_id])]
