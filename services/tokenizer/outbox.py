"""The tokenizer's writes as data, and the one writer of them: what a read, a release from fair queueing's hold,
a dead-lettered entry or a claim decides (services/tokenizer/outcomes.py, no Redis) is a list of effects, and
`Outbox.send` queues their commands, in order, on one pipeline and runs it. Nothing else in the tokenizer writes
a request's record or reply, a schedule or parked entry, the queue count or an acknowledgement; what is left
elsewhere is the heartbeat's (the routing flag: services/tokenizer/router.py) and the consumer's upkeep of its
lanes (groups made again: services/tokenizer/holding.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import msgspec
from redis.asyncio.client import Pipeline

from shared import queued, streams
from shared.consumer_group import GroupConsumer
from shared.messages import ReplyError, ScheduleJob, TokenizerAnswer
from shared.redis_conn import barrier
from shared.request_states import Status
from shared.request_store import RequestStore

log = logging.getLogger(__name__)


class Tokenized(msgspec.Struct, frozen=True):
    """A job encoded: its record says `tokenized` (an omitted max_tokens, None, is not written: the engine's
    scheduler resolves and records it)."""

    uid: str
    prompt_tokens: int
    max_tokens: int | None


class Answered(msgspec.Struct, frozen=True):
    """A /tokenize or /detokenize query's answer on its reply stream, and its record's end."""

    uid: str
    answer: TokenizerAnswer
    prompt_tokens: int | None


class EndAborted(msgspec.Struct, frozen=True):
    """A job whose client is gone: every choice ends with finish_reason "abort"."""

    uid: str
    n: int
    reason: str


class QueryAborted(msgspec.Struct, frozen=True):
    """A query whose client is gone: nobody reads a reply, its record says why."""

    uid: str
    reason: str


class EndTimedOut(msgspec.Struct, frozen=True):
    """Past its deadline: a 504 to its client."""

    uid: str


class EndFailed(msgspec.Struct, frozen=True):
    """Refused (a 400) or dead-lettered: the error to its client, and its record says failed."""

    uid: str
    error: ReplyError


class Barrier(msgspec.Struct, frozen=True):
    """What is queued before lands before what is queued after, on a cluster too (shared/redis_conn.py)."""


class Forward(msgspec.Struct, frozen=True):
    """A schedule job to the model's shared schedule stream (`scheduler` None) or to one scheduler's own."""

    job: ScheduleJob
    scheduler: str | None


class Park(msgspec.Struct, frozen=True):
    """A job past fair queueing's hold, into its tenant's parked stream (services/tokenizer/holding.py)."""

    job: ScheduleJob


class LeaveQueue(msgspec.Struct, frozen=True):
    """Jobs that ended here: they no longer count against --max-queued (shared/queued.py `member`s)."""

    members: list[str]


class Ack(msgspec.Struct, frozen=True):
    """Entries (of the tokenize stream, or `<tenant>/<id>` of a parked one) done with, after what is queued before."""

    entries: list[str]


class EndParked(msgspec.Struct, frozen=True):
    """A tenant's parked stream ended if nothing is left in it (one script; its reply says whether it was)."""

    tenant: str


Effect = (Tokenized | Answered | EndAborted | QueryAborted | EndTimedOut | EndFailed | Barrier | Forward | Park
          | LeaveQueue | Ack | EndParked)


class Outbox:
    """Turns effects into commands on a pipeline (`apply`) and runs it (`send`)."""

    def __init__(self, requests: RequestStore, source: GroupConsumer, model: str):
        self.redis, self.keys, self.model = requests.redis, requests.keys, model
        self.requests, self.source = requests, source

    async def send(self, effects: Iterable[Effect]) -> list[Any]:
        """One pipeline of every effect's commands, in order (none: no round trip); its replies."""
        async with self.redis.pipeline(transaction=False) as pipe:
            self.apply(pipe, effects)
            if not len(pipe):
                return []
            return await pipe.execute()

    def apply(self, pipe: Pipeline, effects: Iterable[Effect]) -> None:
        """Queue every effect's commands, in order (a read's most frequent effects first)."""
        for e in effects:
            match e:
                case Tokenized():
                    self.requests.set_status(pipe, e.uid, Status.TOKENIZED, prompt_tokens=e.prompt_tokens,
                                             max_tokens=e.max_tokens)
                case Forward():
                    self.forward(pipe, e)
                case Barrier():
                    barrier(pipe)
                case LeaveQueue():
                    queued.leave(pipe, self.keys, self.model, e.members)
                case Ack():
                    self.source.ack_in(pipe, e.entries)
                case _:
                    self.end(pipe, e)

    def end(self, pipe: Pipeline, e: Effect) -> None:
        """A request's end here (with the reply its client reads), a job parked, a parked stream ended."""
        match e:
            case Answered():
                self.requests.reply(pipe, e.uid, e.answer)
                self.requests.set_status(pipe, e.uid, Status.FINISHED, prompt_tokens=e.prompt_tokens)
            case EndAborted():
                self.requests.end_aborted(pipe, e.uid, e.n, e.reason)
            case QueryAborted():
                self.requests.set_status(pipe, e.uid, Status.ABORTED, error=f"aborted: {e.reason}")
            case EndTimedOut():
                self.requests.end_timed_out(pipe, e.uid)
            case EndFailed():
                self.requests.end_failed(pipe, e.uid, e.error)
            case Park():
                self.park(pipe, e)
            case EndParked():
                self.end_parked(pipe, e)

    def forward(self, pipe: Pipeline, e: Forward) -> None:
        if e.scheduler is None:
            streams.add(pipe, self.keys.schedule(self.model), e.job)
            return
        log.debug("uid=%s routed to %s", e.job.uid, e.scheduler)
        streams.add(pipe, self.keys.scheduler_stream(self.model, e.scheduler), e.job)
        # After the entry: a peer that ended this stream (its owner gone) finds it again (services/scheduler/lanes.py).
        pipe.sadd(self.keys.routed(self.model), e.scheduler)

    def park(self, pipe: Pipeline, e: Park) -> None:
        """Before the acknowledgement of its tokenize entry; its tenant's set membership after the entry, so a peer
        ending the stream meanwhile finds it not drained (`end_parked`)."""
        streams.add(pipe, self.keys.parked(self.model, e.job.tenant), e.job)
        pipe.sadd(self.keys.parked_tenants(self.model), e.job.tenant)

    def end_parked(self, pipe: Pipeline, e: EndParked) -> None:
        key = self.keys.parked(self.model, e.tenant)
        # no companion key: the stream itself stands in (deleting it twice is nothing)
        streams.end_if_drained(pipe, key, self.source.group, companion=key,
                               registry=self.keys.parked_tenants(self.model), member=e.tenant)
