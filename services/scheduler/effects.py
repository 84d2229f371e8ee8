"""What the scheduler writes to Redis, as data: the request book (services/scheduler/book.py), admission and
recovery (arrivals.py, recovery.py) return these, and
`EffectWriter.apply` is the one place that turns them into commands on a pipeline. The worker's loop decides
when a pipeline goes (services/scheduler/main.py: a step's effects with the next step's exchange, an admission's
at once), so reading the loop tells when an XADD or XACK happens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from redis.asyncio.client import Pipeline

from services.scheduler.lanes import PageChanges, SchedulerLanes
from shared import queued, streams
from shared.consumer_group import GroupConsumer
from shared.messages import DetokenizeBatch, ReplyCheckpoint, ReplyError, ReplyEvent, TokenDelta, encode
from shared.request_states import Status
from shared.request_store import RequestStore

# Detokenize entries published between two updates of the mean entry size (the stream's MAXLEN follows it).
ENTRY_SIZE_WEIGHT = 1 / 64
MIN_DETOKENIZE_MAXLEN = 1_000  # steps kept at least, however large the entries


@dataclass(frozen=True, slots=True)
class Publish:
    """One detokenize entry: deltas of one step (or a drop's last ones), in this order."""

    deltas: list[TokenDelta]
    step: int


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """All tokens of a request so far, straight into its reply stream (what a successor resumes from)."""

    uid: str
    checkpoint: ReplyCheckpoint


@dataclass(frozen=True, slots=True)
class Pooled:
    """A prefill-only request's answer (an embedding or scores), straight into its reply stream with no detokenize
    step; its record says it finished."""

    uid: str
    event: ReplyEvent


@dataclass(frozen=True, slots=True)
class Ack:
    """Schedule entries whose requests ended here (or were never ours to run): acknowledged after every other
    write of the same pipeline."""

    entries: list[str]


@dataclass(frozen=True, slots=True)
class Fail:
    """The request ends with this error: to its client, and its record says `Status.FAILED`."""

    uid: str
    error: ReplyError


@dataclass(frozen=True, slots=True)
class EndAborted:
    """A request aborted before it ran: every choice ends with finish_reason `Finish.ABORT`."""

    uid: str
    n: int
    reason: str
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class RecordAbort:
    """A running request dropped by an abort: its record says why (its choices end by a Publish of abort
    deltas), and its abort flag need not outlive it."""

    uid: str
    reason: str


@dataclass(frozen=True, slots=True)
class RecordRunning:
    """A request the engine took: its record names this scheduler and entry, before any of its deltas."""

    uid: str
    entry: str
    max_tokens: int
    stop: str | None  # its stop strings as JSON, for a detokenizer that did not see a choice's first delta


@dataclass(frozen=True, slots=True)
class Dequeued:
    """Requests this scheduler took from the model's queue (run, or ended at its door): they no longer count
    against --max-queued and their tenants' shares of it (shared/queued.py)."""

    model: str
    members: list[str]  # shared/queued.py `member`


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Claimed schedule entries every scheduler died with (services/scheduler/recovery.py `poisoned`): moved to the
    dead-letter stream, and acknowledged. (entry id, its fields, why)"""

    entries: list[tuple[str, dict[bytes, bytes], str]]


@dataclass(frozen=True, slots=True)
class RefreshTtl:
    """Running requests whose record's and reply stream's TTLs are due for a refresh (recovery's sweep)."""

    uids: list[str]


Effect = (Publish | Checkpoint | Pooled | Ack | Fail | EndAborted | RecordAbort | RecordRunning | PageChanges
          | Dequeued | DeadLetter | RefreshTtl)


class EffectWriter:
    """Turns effects into commands on a pipeline (`apply`); nothing else in the scheduler writes to Redis, but
    for a takeover's fence (services/scheduler/recovery.py), the heartbeat and the lanes' upkeep."""

    def __init__(self, requests: RequestStore, source: GroupConsumer, lanes: SchedulerLanes, scheduler_id: str,
                 detokenize_key: str, *, detokenize_budget_mb: float):
        self.requests, self.source, self.lanes, self.id = requests, source, lanes, scheduler_id
        self.detokenize_key = detokenize_key
        self.budget_bytes = detokenize_budget_mb * 2**20
        self.entry_bytes = 1024.0  # mean size of the detokenize entries published (bytes), for their MAXLEN
        self._write: dict[type, Callable[[Pipeline, Any], None]] = {
            Publish: self.publish, Checkpoint: self.checkpoint, Pooled: self.pooled, Fail: self.fail,
            EndAborted: self.end_aborted, RecordAbort: self.record_abort, RecordRunning: self.record_running,
            PageChanges: lanes.write_pages, Dequeued: self.dequeued, DeadLetter: self.dead_letter,
            RefreshTtl: self.refresh_ttl}

    def apply(self, pipe: Pipeline, effects: Iterable[Effect]) -> list[range]:
        """Queue every effect's commands, in order, then one acknowledgement of all the entries they end. Which
        of the pipeline's commands each effect queued (`unapplied` reads them)."""
        acks: list[str] = []
        spans: list[range] = []
        ack_spans: list[int] = []
        for e in effects:
            if isinstance(e, Ack):
                acks += e.entries
                ack_spans.append(len(spans))
                spans.append(range(0))
            else:
                start = len(pipe)
                self._write[type(e)](pipe, e)
                spans.append(range(start, len(pipe)))
        start = len(pipe)
        self.source.ack_own_in(pipe, acks)  # what a peer took over while this process was stalled is the peer's
        for k in ack_spans:
            spans[k] = range(start, len(pipe))
        return spans


    def publish(self, pipe: Pipeline, e: Publish) -> None:
        """XADD the deltas to the model's detokenize stream, capped near --detokenize-budget-mb: MAXLEN ~ the
        budget over the mean entry size. Detokenizers read an entry within milliseconds and every worker trims
        what its group acknowledged every 10 s, so the cap only bites when no detokenizer reads for a long while
        (entries trimmed unread are token ranges lost: their requests end at their deadline), not Redis' memory."""
        data = encode(DetokenizeBatch(self.id, e.step, e.deltas))
        self.entry_bytes += (len(data) - self.entry_bytes) * ENTRY_SIZE_WEIGHT
        maxlen = max(MIN_DETOKENIZE_MAXLEN, int(self.budget_bytes / self.entry_bytes))
        streams.add_data(pipe, self.detokenize_key, data, maxlen)

    def checkpoint(self, pipe: Pipeline, e: Checkpoint) -> None:
        self.requests.reply(pipe, e.uid, e.checkpoint, refresh_ttl=False)

    def pooled(self, pipe: Pipeline, e: Pooled) -> None:
        self.requests.reply(pipe, e.uid, e.event)
        self.requests.set_status(pipe, e.uid, Status.FINISHED, finish_reason=e.event.finish_reason,
                                 completion_tokens=0)

    def fail(self, pipe: Pipeline, e: Fail) -> None:
        self.requests.end_failed(pipe, e.uid, e.error)

    def end_aborted(self, pipe: Pipeline, e: EndAborted) -> None:
        self.requests.end_aborted(pipe, e.uid, e.n, e.reason, e.prompt_tokens)

    def record_abort(self, pipe: Pipeline, e: RecordAbort) -> None:
        self.requests.note_abort(pipe, e.uid, e.reason)

    def dequeued(self, pipe: Pipeline, e: Dequeued) -> None:
        queued.leave(pipe, self.requests.keys, e.model, e.members)

    def dead_letter(self, pipe: Pipeline, e: DeadLetter) -> None:
        self.source.queue_dead_letter(pipe, e.entries)

    def refresh_ttl(self, pipe: Pipeline, e: RefreshTtl) -> None:
        for uid in e.uids:
            self.requests.refresh(pipe, uid)

    def record_running(self, pipe: Pipeline, e: RecordRunning) -> None:
        self.requests.set_status(pipe, e.uid, Status.RUNNING, scheduler=self.id, entry=e.entry,
                                 max_tokens=e.max_tokens, stop=e.stop)


def raise_first_error(results: list[Any]) -> None:
    """What the pipeline's `execute()` would have raised: the first failed command's error."""
    for r in results:
        if isinstance(r, Exception):
            raise r


def unapplied(effects: list[Effect], spans: list[range], results: list[Any]) -> list[Effect]:
    """The effects of a pipeline (`EffectWriter.apply`, executed without raising) that a command of theirs failed
    for: only those are sent again. A pipeline is not a transaction: what it did apply stays applied, and a
    step's deltas sent twice would reach a detokenizer beside the next ones and be merged into a range that
    overlaps what its client already has (shared/reply_order.py drops such a range)."""
    return [e for e, span in zip(effects, spans, strict=True)
            if any(isinstance(results[k], Exception) for k in span)]
