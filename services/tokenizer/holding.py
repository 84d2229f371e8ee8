"""Fair queueing's Redis side (the decisions are services/tokenizer/fair.py's and outcomes.py's, the writes
services/tokenizer/outbox.py's; docs/design.md, "Fair queueing").

A tokenized job the tokenizer does not send at once (`fair.applies`) is either held here, in memory, in its
tenant's lane (its tokenize entry pending, ours, kept alive), or, past the hold's cap, parked (`fair.holds`):
XADDed to its tenant's parked stream (shared/keys.py `parked`) in the pipeline that acknowledges its tokenize
entry. A parked stream is a lane of the tokenize stream's `tokenizer` group (same hash slot, read with the same
consumer), so parked jobs are durable and owned as entries are: undelivered, any tokenizer reads them back; read
back, they are pending to that tokenizer until released, kept alive, and claimed by a peer if it dies or hangs.

The releaser (`run`) does, every --fair-poll-ms or when woken by a placement: look which tenants have jobs
parked (a set beside the streams, every PARKED_REFRESH_S), claim a dead peer's read-back entries (every
CLAIM_EVERY_S), read parked jobs back into lanes with room (`fair.refills`), release held jobs in turns up to
the watermark (`fair.releasable`), and end the parked streams that are drained (every END_EVERY_S, one script
each: nothing pending or undelivered). Released jobs are routed, sent and acknowledged in one pipeline
(`outcomes.released`); an aborted or expired one ends there. Every job that ends here leaves the model's queue
count (shared/queued.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

from redis.exceptions import RedisError, ResponseError

from services.tokenizer import fair, outcomes
from services.tokenizer.fair import FairQueue, Plan, refills, releasable
from services.tokenizer.outbox import Ack, EndParked, Outbox
from services.tokenizer.outcomes import Held
from shared import streams
from shared.keys import SCHEDULER_GROUP
from shared.messages import ScheduleJob
from shared.request_store import RequestStore
from shared.settings import TokenizerSettings

log = logging.getLogger(__name__)

PARKED_REFRESH_S = 0.1
IDLE_REFRESH_S = 1.0  # nothing held or parked here: how soon a peer's parked jobs (it died) are seen
CLAIM_EVERY_S = 0.5
END_EVERY_S = 1.0
CLAIM_COUNT = 100  # read-back entries claimed per parked stream per round


class Outlet(Protocol):
    """Where released jobs are routed (services/tokenizer/main.py TokenizerWorker)."""

    def schedule_streams(self) -> list[str]: ...

    async def schedulers_for(self, jobs: list[ScheduleJob]) -> dict[str, str | None]: ...


class FairHold:
    def __init__(self, settings: TokenizerSettings, requests: RequestStore, outbox: Outbox, outlet: Outlet):
        self.settings, self.requests, self.outbox, self.outlet = settings, requests, outbox, outlet
        self.source, self.model = outbox.source, outbox.model
        self.redis, self.keys = requests.redis, requests.keys
        self.source.lane_key = lambda tenant: self.keys.parked(self.model, tenant)
        self.queue: FairQueue[Held] = FairQueue(lambda h: h.job.ttft_due)  # earliest TTFT deadline first in a lane
        self.parked: set[str] = set()  # tenants with jobs parked (as last seen in Redis, and those we parked since)
        self.weights: dict[str, int] = {}  # each tenant's latest weight
        self.wake = asyncio.Event()
        self._last: dict[str, float] = {}

    def load(self) -> dict:
        return {"held": len(self.queue), "held_by_tenant": self.queue.tenants(), "parked_tenants": len(self.parked)}

    def entries(self) -> list[str]:
        return [h.entry_id for h in self.queue.items()]

    def lost(self, refs: list[str]) -> None:
        """Held jobs a peer claimed while we were stalled: theirs to forward now."""
        if refs:
            gone = set(refs)
            self.queue.remove(lambda h: h.entry_id in gone)

    # -- a read's tokenized jobs (TokenizerWorker._encode) ---------------------------------------------------
    def plan(self, items: list[Held]) -> Plan[Held]:
        """Each job sent now, held or parked (services/tokenizer/fair.py); an entry held already (claimed back from
        ourselves after a keep-alive failed) is only `kept`: it stays held, once."""
        present = set(self.entries())
        kept = [h for h in items if h.entry_id in present]
        jobs = [(h.job.tenant, fair.applies(self.settings.fair_queueing, h.job.tenant), h)
                for h in items if h.entry_id not in present]
        plan = fair.plan(jobs, self.queue.tenants(), self.parked, self.settings.fair_max_held)
        plan.kept = kept
        return plan

    async def placed(self, plan: Plan[Held]) -> None:
        """Once the plan's pipeline ran: hold what it holds, read the new parked streams, wake the releaser."""
        for h in plan.hold:
            self._push(h)
        for tenant in {h.job.tenant for h in plan.park}:
            if tenant not in self.parked:
                log.info("tenant=%s: hold full, its jobs are parked in Redis (uid=%s first)", tenant,
                         next(h.job.uid for h in plan.park if h.job.tenant == tenant))
            self.parked.add(tenant)
            self.weights[tenant] = next(h.job.weight for h in plan.park if h.job.tenant == tenant)
            with contextlib.suppress(RedisError, OSError):  # else the next `refresh` adds it: the entries are written
                await self.source.add_lane(tenant, create=False)
        if plan.hold or plan.park:
            self.wake.set()

    def _push(self, h: Held, head: bool = False) -> None:
        self.weights[h.job.tenant] = h.job.weight
        (self.queue.restore if head else self.queue.push)(h.job.tenant, h.job.weight, h)

    # -- the releaser --------------------------------------------------------------------------------------
    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), self.settings.fair_poll_ms / 1000)
            self.wake.clear()
            try:
                await self.step()
            except (RedisError, OSError) as e:  # held still, and pending: released once Redis is back
                log.warning("fair queueing: could not release held jobs (%s)", e)
                await asyncio.sleep(0.5)
            except Exception:  # a dead releaser would hold every job until its deadline: never let it die
                log.exception("fair queueing: releasing failed")
                await asyncio.sleep(0.5)

    async def step(self) -> None:
        busy = len(self.queue) or self.parked
        if self._due("refresh", PARKED_REFRESH_S if busy else IDLE_REFRESH_S):
            await self.refresh()
        if self.source.lanes and self._due("claim", CLAIM_EVERY_S):
            await self.claim()
        await self.refill()
        await self.release_some()
        if self.source.lanes and self._due("end", END_EVERY_S):
            await self.end_drained()

    def _due(self, what: str, every_s: float) -> bool:
        now = time.monotonic()
        if now - self._last.get(what, 0.0) < every_s:
            return False
        self._last[what] = now
        return True

    async def refresh(self) -> None:
        """The tenants with jobs parked, from Redis: their streams become lanes we read (and claim)."""
        found = {streams.as_str(t) for t in await self.redis.smembers(self.keys.parked_tenants(self.model))}
        for tenant in found - set(self.source.lanes):
            await self.source.add_lane(tenant, create=False)
        mine = self._lanes_held()
        for tenant in set(self.source.lanes) - found - mine:  # a peer ended it: drained
            self.source.drop_lane(tenant)
        self.parked = found | mine

    def _lanes_held(self) -> set[str]:
        """The tenants whose parked entries we hold (read back, not yet released)."""
        return {h.job.tenant for h in self.queue.items() if "/" in h.entry_id}

    async def refill(self) -> None:
        """Read parked jobs back into their lanes (`fair.refills`), in one round trip."""
        lanes = [t for t in self.parked if t in self.source.lanes]
        targets = {t: max(2 * self.weights.get(t, 1), self.settings.fair_watermark) for t in lanes}
        wants = refills(self.queue.tenants(), lanes, targets, self.settings.fair_max_held)
        if not wants:
            return
        keyed = {self.source.lane_key(t): n for t, n in wants.items()}  # type: ignore[misc]
        rows: streams.Rows = []
        for key, got in (await streams.read_group_each(self.redis, keyed, self.source.member)).items():
            if isinstance(got, ResponseError):  # NOGROUP: the stream was ended and made again since
                await streams.create_group(self.redis, key, self.source.group, mkstream=False)
                continue
            rows += [(self.source.ref(key, eid), f) for eid, f in got]
        for d in await self.source.decode_all(rows, ScheduleJob):
            self._push(Held(d.entry_id, d.msg))

    async def claim(self) -> None:
        """Take over the read-back entries of a peer that died or hangs (idle past --claim-idle-ms): those its
        release reached a scheduler with are acknowledged, the others held at the heads of their lanes."""
        cursors = {self.source.lane_key(t): self.source.cursors.get(self.source.lane_key(t), "0-0")  # type: ignore
                   for t in self.source.lanes}
        results = await streams.autoclaim(self.redis, cursors, self.source.member, self.settings.claim_idle_ms,
                                          CLAIM_COUNT)
        rows: streams.Rows = []
        for key, result in results.items():
            if not isinstance(result, ResponseError):
                self.source.cursors[key], entries = result
                rows += [(self.source.ref(key, eid), f) for eid, f in entries]
        present = set(self.entries())
        claimed = [d for d in await self.source.decode_all(rows, ScheduleJob) if d.entry_id not in present]
        if not claimed:
            return
        log.info("claimed %d parked jobs a dead or hung tokenizer had read back", len(claimed))
        statuses = await self.requests.field([d.msg.uid for d in claimed], "status")
        done = outcomes.settled([(d.entry_id, d.msg.uid) for d in claimed], statuses, outcomes.forwarded)
        await self.outbox.send([Ack(done)])
        for d in reversed([d for d in claimed if d.entry_id not in done]):
            self._push(Held(d.entry_id, d.msg), head=True)

    async def end_drained(self) -> None:
        """End each parked stream nothing is left in (one script each, in one pipeline), with its set membership."""
        mine = self._lanes_held()
        lanes = [t for t in self.source.lanes if t not in mine]
        ended = await self.outbox.send([EndParked(t) for t in lanes])
        for t, done in zip(lanes, ended, strict=True):
            if done:
                self.source.drop_lane(t)
                self.parked.discard(t)

    async def release_some(self) -> None:
        if not len(self.queue):
            return
        watermark = self.settings.fair_watermark
        backlog = await streams.undelivered(self.redis, self.outlet.schedule_streams(), SCHEDULER_GROUP, watermark)
        batch = self.queue.take(releasable(backlog, watermark, len(self.queue)))
        if batch:
            await self._release(batch)

    async def _release(self, batch: list[Held]) -> None:
        """Send released jobs (an aborted or expired one ends here) and acknowledge them, in one pipeline; if it
        fails they stay held, at the head of their lanes."""
        try:
            aborted = await self.requests.abort_reasons(h.job.uid for h in batch)
            now = time.time()
            routes = await self.outlet.schedulers_for(
                [h.job for h in batch if h.job.uid not in aborted and h.job.deadline > now])
            await self.outbox.send(outcomes.released(batch, aborted, now, routes))
        except BaseException:
            for h in reversed(batch):
                self._push(h, head=True)
            raise
