"""What the scheduler asks Redis about requests it did not start here, or may no longer own: what a delivered
entry's request already is (`look_up`), entries every scheduler died with (`without_poison`), taking a claimed
request over from where its client stands (`take_over`), what ended elsewhere (`AbortNotes`, read with every
exchange) and, once a second, what ended without a notification (`sweep`: abort flags, choices a stop string
ended, owners and records gone), refreshing the TTLs of the rest. Its decisions are the book's and admission's
(services/scheduler/book.py, admission.py); its writes go through the EffectWriter, but for the fence, which must
be in the reply stream before the stream is read.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import msgspec
from redis.asyncio import Redis

from services.scheduler.arrivals import Found, Resumed
from services.scheduler.book import Ends, RequestBook, Running
from services.scheduler.effects import EffectWriter, Fail
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


class Recovery:
    def __init__(self, requests: RequestStore, source: GroupConsumer, book: RequestBook, writer: EffectWriter,
                 max_deliveries: int):
        self.requests, self.source, self.book, self.writer = requests, source, book, writer
        self.redis, self.keys, self.ttl = requests.redis, requests.keys, requests.ttl
        self.max_deliveries = max_deliveries

    async def look_up(self, batch: list[Delivery[ScheduleJob]]) -> dict[str, Found]:
        """Per request: its abort flag, and the scheduler and entry its record names."""
        uids = [d.msg.uid for d in batch]
        aborted = await self.requests.abort_reasons(uids)
        owners = await self.requests.fields(uids, "scheduler", "entry")
        return {uid: Found(aborted.get(uid), *owners[uid]) for uid in uids}

    async def without_poison(self, batch: list[Delivery[ScheduleJob]]) -> list[Delivery[ScheduleJob]]:
        """Claimed entries delivered more than --max-deliveries times: each delivery ended with its scheduler
        gone (a crash while running it, e.g. a native one no `except` sees), and the next would take down the
        next scheduler. Dead-lettered, and their clients answered at once with an error."""
        counts = await self.source.delivery_counts([d.entry_id for d in batch])
        poison = [d for d in batch if counts.get(d.entry_id, 0) > self.max_deliveries]
        if not poison:
            return batch
        await self.source.dead_letter([(d.entry_id, {streams.FIELD: encode(d.msg)},
                                        f"delivered {counts[d.entry_id]} times; each scheduler died with it")
                                       for d in poison])
        for d in poison:
            log.error("uid=%s dead-lettered: its schedule entry was delivered %d times", d.msg.uid,
                      counts[d.entry_id])
            self.book.forget(d.msg.uid)
        async with self.redis.pipeline(transaction=False) as pipe:
            self.writer.apply(pipe, [Fail(d.msg.uid, poison_error(counts[d.entry_id])) for d in poison])
            await pipe.execute()
        bad = {d.entry_id for d in poison}
        return [d for d in batch if d.entry_id not in bad]

    async def take_over(self, job: ScheduleJob) -> Resumed:
        """Raise the request's epoch, put a fence with it into the reply stream, and read what came before
        the fence: that is exactly what clients get of the previous owners (shared/reply_order.py)."""
        epoch = await self.requests.raise_epoch(job.uid)
        trimmed, before = await self.requests.fence(job.uid, ReplyFence(epoch=epoch, scheduler=self.writer.id))
        produced = ProducedTokens(job.params.n, trimmed=trimmed)
        for _, fields in before:
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                produced.add(decode(streams.payload(fields), Reply))
        produced.fence(epoch)
        return Resumed(produced, epoch)

    async def sweep(self) -> Ends:
        """What ended without a notification: the abort flags of every running request (an operator's `SET
        rsinfer:abort:<uid>`, or a notification lost in a Redis outage), choices a stop string ended, and
        requests whose client or record is gone or that are no longer ours. A flag's reason wins."""
        flagged, stopped = await self.requests.ended_elsewhere(self.book.running, self.book.stoppable())
        return Ends({**await self.orphans(), **flagged}, stopped)

    async def orphans(self) -> dict[str, str]:
        """Requests nobody can receive or that are no longer ours (`orphan_reason`), in one round trip that
        also refreshes the TTLs of the requests due for it."""
        runs = list(self.book.running.values())
        pods = sorted({r.job.pod for r in runs})
        # TTLs are refreshed a few times per TTL, not every sweep: two commands per running request a second
        # were most of what a long generation cost Redis beyond its tokens.
        stale = self.book.stale(time.monotonic(), min(TTL_REFRESH_S, self.ttl / 10))
        async with self.redis.pipeline(transaction=False) as pipe:
            for pod in pods:
                pipe.exists(self.keys.worker("api", pod))
            for r in runs:
                pipe.hmget(self.keys.request(r.job.uid), ["scheduler", "epoch"])
            for r in stale:
                self.requests.refresh(pipe, r.job.uid)
            found = await pipe.execute()
        alive = {pod for pod, ok in zip(pods, found, strict=False) if ok}
        owners = found[len(pods):len(pods) + len(runs)]
        reasons = {r.job.uid: orphan_reason(r, owner, epoch, alive, self.writer.id)
                   for r, (owner, epoch) in zip(runs, owners, strict=True)}
        return {uid: reason for uid, reason in reasons.items() if reason is not None}


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
