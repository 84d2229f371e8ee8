"""What the scheduler asks Redis about requests it did not start here, or may no longer own: what a delivered
entry's request already is (`look_up`), entries every scheduler died with (`without_poison`), taking a claimed
request over from where its client stands (`take_over`), what ended elsewhere (`AbortNotes`, read with every
exchange) and, once a second, what ended without a notification (`sweep`: abort flags, choices a stop string
ended, owners and records gone), and which running requests' TTLs are due for a refresh.

It reads; what it decides comes back to the worker's loop as data (`Ends` for the book, effects for the
EffectWriter: services/scheduler/effects.py), and the loop applies it. It holds neither the book nor the writer:
what it needs of the book comes in as arguments (`SweepView`). Its one write of its own is a takeover's fence,
which must be in the reply stream before the stream is read. Its decisions are the pure functions below
(`poisoned`, `resumed_from`, `orphan_reason`), tested without Redis in tests/unit/scheduler/test_recovery_decisions.py.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Set
from dataclasses import dataclass, field
from typing import Any

import msgspec
from redis.asyncio import Redis

from services.scheduler.arrivals import Found, Resumed
from services.scheduler.book import Ends, Running, SweepView
from services.scheduler.effects import DeadLetter, Effect, Fail, RefreshTtl
from shared import streams
from shared.consumer_group import Delivery, GroupConsumer
from shared.messages import Reply, ReplyError, ReplyFence, ScheduleJob, decode, encode
from shared.reply_order import ProducedTokens
from shared.request_states import EndReason
from shared.request_store import RequestStore

log = logging.getLogger(__name__)

TTL_REFRESH_S = 60.0  # at most this long between refreshes of a running request's TTLs (a tenth of the TTL if less)
ABORTS_PER_READ = 1000


class AbortNotes:
    """The model's abort notifications (shared/request_store.py `abort`, `stop_choice`), read on each exchange's
    pipeline from where the last read stopped: one command per step, not one per running request."""

    def __init__(self, key: str):
        self.key, self.cursor = key, "0-0"

    async def start(self, redis: Redis) -> None:
        self.cursor = await streams.last_id(redis, self.key) or "0-0"  # older notifications: the sweep's job

    def queue(self, pipe: Any) -> None:
        streams.queue_read(pipe, {self.key: self.cursor}, ABORTS_PER_READ)

    def ends(self, reply: list | None, running: dict) -> Ends:
        """What the XREAD `queue` put on the pipeline tells of the requests in `running`."""
        ends = Ends()
        for _key, entries in reply or []:
            self.cursor = entries[-1][0]
            for _, fields in entries:
                ends.add_note({k.decode(): v.decode() for k, v in fields.items()}, running)
        return ends


@dataclass
class Poisoned:
    """What `poisoned` decides of a claimed read: the entries to admit, the requests the book forgets, and the
    effects that end the others (dead-lettered, their clients answered with an error)."""

    kept: list[Delivery[ScheduleJob]]
    uids: list[str] = field(default_factory=list)
    effects: list[Effect] = field(default_factory=list)


class Recovery:
    def __init__(self, requests: RequestStore, source: GroupConsumer, scheduler_id: str, max_deliveries: int):
        self.requests, self.source, self.id = requests, source, scheduler_id
        self.redis, self.keys = requests.redis, requests.keys
        self.max_deliveries = max_deliveries
        # TTLs are refreshed a few times per TTL, not every sweep: two commands per running request a second
        # were most of what a long generation cost Redis beyond its tokens.
        self.refresh_every = min(TTL_REFRESH_S, requests.ttl / 10)
        # API pods whose heartbeat the last sweep did not find: one is gone when the next does not find it either
        # (`swept`)
        self.unseen: set[str] = set()

    async def look_up(self, uids: list[str]) -> dict[str, Found]:
        """Per request: its abort flag, and the scheduler and entry its record names, in one round trip."""
        if not uids:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for uid in uids:
                pipe.get(self.keys.abort(uid))
                pipe.hmget(self.keys.request(uid), ["scheduler", "entry"])
            found = await pipe.execute()
        return {uid: found_of(flag, owner) for uid, flag, owner in zip(uids, found[::2], found[1::2], strict=True)}

    async def without_poison(self, batch: list[Delivery[ScheduleJob]]) -> Poisoned:
        """Claimed entries delivered more than --max-deliveries times (`poisoned`)."""
        counts = await self.source.delivery_counts([d.entry_id for d in batch])
        return poisoned(batch, counts, self.max_deliveries)

    async def take_over(self, job: ScheduleJob) -> Resumed:
        """Raise the request's epoch, put a fence with it into the reply stream, and read what came before
        the fence: that is exactly what clients get of the previous owners (shared/reply_order.py)."""
        epoch = await self.requests.raise_epoch(job.uid)
        trimmed, before = await self.requests.fence(job.uid, ReplyFence(epoch=epoch, scheduler=self.id))
        return resumed_from(job.params.n, epoch, trimmed, before)

    async def sweep(self, view: SweepView) -> tuple[Ends, list[Effect]]:
        """What ended without a notification (`swept`), read in one round trip, and the refresh of the TTLs due
        for one."""
        runs = list(view.running.values())
        pods = sorted({r.job.pod for r in runs})
        async with self.redis.pipeline(transaction=False) as pipe:
            for r in runs:
                pipe.get(self.keys.abort(r.job.uid))
                pipe.hmget(self.keys.request(r.job.uid), ["scheduler", "epoch"])
            for uid, index in view.stoppable:
                pipe.exists(self.keys.choice_stop(uid, index))
            for pod in pods:
                pipe.exists(self.keys.worker("api", pod))
            found = await pipe.execute()
        ends = swept(runs, view.stoppable, pods, found, self.id, unseen_before=self.unseen)
        self.unseen = unseen_pods(pods, found)
        return ends, [RefreshTtl([r.job.uid for r in view.stale])] if view.stale else []


def found_of(flag: bytes | None, owner: list[bytes | None]) -> Found:
    """What a request's abort flag and its record's scheduler and entry fields say (`look_up`)."""
    return Found(*(v.decode() if v is not None else None for v in (flag, *owner)))


def poisoned(batch: list[Delivery[ScheduleJob]], counts: dict[str, int], max_deliveries: int) -> Poisoned:
    """Claimed entries delivered more than `max_deliveries` times: each delivery ended with its scheduler gone (a
    crash while running it, e.g. a native one no `except` sees), and the next would take down the next
    scheduler. Dead-lettered, and their clients answered at once with an error."""
    poison = [d for d in batch if counts.get(d.entry_id, 0) > max_deliveries]
    if not poison:
        return Poisoned(batch)
    for d in poison:
        log.error("uid=%s dead-lettered: its schedule entry was delivered %d times", d.msg.uid, counts[d.entry_id])
    dead = DeadLetter([(d.entry_id, {streams.FIELD: encode(d.msg)},
                        f"delivered {counts[d.entry_id]} times; each scheduler died with it") for d in poison])
    fails: list[Effect] = [Fail(d.msg.uid, poison_error(counts[d.entry_id])) for d in poison]
    bad = {d.entry_id for d in poison}
    return Poisoned([d for d in batch if d.entry_id not in bad], [d.msg.uid for d in poison], [dead, *fails])


def resumed_from(n: int, epoch: int, trimmed: bool, before: streams.Rows) -> Resumed:
    """Where a request taken over under `epoch` resumes: the tokens of the reply entries before its fence, as
    its client gets them (an entry that does not decode is skipped, as the client's reader skips it)."""
    produced = ProducedTokens(n, trimmed=trimmed)
    for _, fields in before:
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            produced.add(decode(streams.payload(fields), Reply))
    produced.fence(epoch)
    return Resumed(produced, epoch)


def unseen_pods(pods: list[str], found: list) -> set[str]:
    """The API pods whose heartbeat the sweep's reads (`Recovery.sweep`: the pods' EXISTS last) did not find."""
    return {pod for pod, ok in zip(pods, found[len(found) - len(pods):], strict=True) if not ok}


def swept(runs: list[Running], stoppable: list[tuple[str, int]], pods: list[str], found: list, me: str, *,
          unseen_before: Set[str] = frozenset()) -> Ends:
    """What the sweep's reads (`Recovery.sweep`, in its order) say ended: requests whose abort flag is set (an
    operator's `SET rsinfer:abort:<uid>`, or a notification lost in a Redis outage), choices a stop string
    ended, and requests nobody can receive or that are no longer ours (`orphan_reason`). A flag's reason wins.
    An API pod is gone once two sweeps in a row (`unseen_before`: the previous one's) find no heartbeat of it: a
    Redis restart can outlast a heartbeat's TTL, and a sweep right after it would otherwise end the requests of
    every API pod that had not beaten again yet."""
    n, k = 2 * len(runs), len(stoppable)
    alive = {pod for pod, ok in zip(pods, found[n + k:], strict=True) if ok or pod not in unseen_before}
    ends = Ends(choices={c for c, stop in zip(stoppable, found[n:n + k], strict=True) if stop})
    for r, flag, (owner, epoch) in zip(runs, found[0:n:2], found[1:n:2], strict=True):
        reason = flag.decode() if flag is not None else orphan_reason(r, owner, epoch, alive, me)
        if reason is not None:
            ends.requests[r.job.uid] = reason
    return ends


def orphan_reason(run: Running, owner: bytes | None, epoch: bytes | None, alive: set[str], me: str) -> str | None:
    """Why a running request is no longer ours to run, from its record's owner and epoch and the live API pods:
    the record is gone (Redis lost its data), a peer took it over while we were stalled, or the API process died
    (unless it runs in the background). None: it is ours."""
    if owner is None:
        return EndReason.RECORD_LOST
    if owner.decode() != me or int(epoch or 0) != run.epoch:
        # A newer epoch with us still recorded as the owner: a peer took over and died before it
        # recorded itself. Our steps are refused after its fence; dropped, the entry goes idle and
        # whoever claims it resumes from what the client has.
        return EndReason.TAKEN_OVER
    if run.job.pod not in alive and not run.job.background:
        return EndReason.OWNER_GONE
    return None


def poison_error(deliveries: int) -> ReplyError:
    return ReplyError(message=f"the request could not be served: every scheduler that took it ({deliveries}) "
                      "stopped while running it", code="request_dead_lettered")
