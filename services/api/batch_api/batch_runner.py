"""This API process's part in running batches (services/api/batch_api/batches.py): several at once, in turns across
tenants.

Each tenant's batches wait on a work stream of its own (`Keys.batch_work`), all read in the `batch` consumer group.
Every WORK_POLL_S (sooner when a run ends) the runner reads, for each tenant that holds fewer than
--batch-max-running-per-tenant entries here, its next entry (one idle past --batch-claim-idle-s first: its runner
died), and starts those it holds, one per tenant per turn and the first tenant moving on each time, while it runs
fewer than --batch-max-running. A tenant's other batches stay in its stream, behind nobody else's.

A run its tenant's quota stops (services/api/batch_api/batch_run.py) is parked: its entry stays held here (touched, as
the running ones are, every third of --batch-claim-idle-s) and is run again after the refusal's Retry-After (doubled
on each park that ended no line, at most PARK_MAX_S), or at once when it is cancelled; its turn goes to other
tenants meanwhile. An ended batch's entry is acknowledged and deleted (the streams hold only what is to do).
Draining, the runner starts nothing and lets go of its parked entries (another process claims them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import msgspec
from redis.exceptions import RedisError, ResponseError

from services.api.batch_api.batches import PARK_MAX_S, Batches, Parked
from shared import streams
from shared.messages import BatchWork, decode
from shared.tasks import stop_task

log = logging.getLogger(__name__)

GROUP = "batch"
WORK_POLL_S = 2.0  # how often an API process looks for a batch to run
TENANTS_S = WORK_POLL_S  # how often it reads which tenants have batches (one SMEMBERS)
MIN_SLEEP_S = 0.05


@dataclass
class Held:
    """An entry of a tenant's work stream that this process holds: running (`task`) or parked until `due`."""

    tenant: str
    stream: str
    entry_id: str
    batch_id: str
    due: float = 0.0  # monotonic
    parks: int = 0  # parks in a row that ended no line
    task: asyncio.Task | None = None


class BatchRunner:
    def __init__(self, batches: Batches):
        self.b, self.s = batches, batches.s
        self.member = streams.Member(GROUP, batches.ctx.pod)
        self.held: dict[str, Held] = {}  # batch id -> its entry
        self.grouped: set[str] = set()  # work streams whose group exists
        self.cursors: dict[str, str] = {}  # XAUTOCLAIM cursor of each work stream
        self.tenants: list[str] = []
        self.tenants_at = -TENANTS_S
        self.turn = 0
        self.touched = time.monotonic()
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.loop())

    async def close(self) -> None:
        tasks = [t for t in [self.task, *(h.task for h in self.held.values())] if t is not None]
        for task in tasks:  # the loop first; a Redis call can swallow a cancellation: never wait for ever
            await stop_task(task)

    def running(self, tenant: str | None = None) -> int:
        return sum(1 for h in self.held.values() if h.task is not None and tenant in (None, h.tenant))

    async def loop(self) -> None:
        swept = time.monotonic()
        while True:
            try:
                await self.sleep()
                await self.reap()
                if self.b.ctx.drain.draining:
                    self.let_go_parked()
                await self.touch()
                if self.b.ctx.drain.draining:
                    continue
                if time.monotonic() - swept > self.s.batch_sweep_s:
                    swept = time.monotonic()
                    await self.b.files.sweep_orphans()
                    await self.b.sweep_results()
                    for tenant in self.tenants:  # what a crash left acknowledged but not deleted
                        await streams.trim_acknowledged(self.b.redis, self.b.keys.batch_work(tenant))
                await self.fill()
            except (RedisError, OSError) as e:
                log.warning("batch runner: %s", e)
                await asyncio.sleep(1.0)
            except Exception:
                log.exception("batch runner")
                await asyncio.sleep(1.0)

    async def sleep(self) -> None:
        """Until WORK_POLL_S passed (a third of --batch-claim-idle-s at most: the touch), a run ended or a parked
        batch comes due (one due already waits for a run to end: its tenant or the runner is full)."""
        now = time.monotonic()
        later = [h.due - now for h in self.held.values() if h.task is None and h.due > now]
        wait = max(MIN_SLEEP_S, min([WORK_POLL_S, self.s.batch_claim_idle_s / 3, *later]))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), wait)
        self.wake.clear()

    async def reap(self) -> None:
        """Runs that ended: their entries acknowledged (the batch ended), parked, or let go (failed: another
        process, or this one, claims the entry once idle)."""
        for h in [h for h in self.held.values() if h.task is not None and h.task.done()]:
            task, h.task = h.task, None
            if task.cancelled():
                self.held.pop(h.batch_id, None)
                continue
            error = task.exception()
            if error is not None:
                log.error("batch=%s run failed: %r (tried again once its entry is idle)", h.batch_id, error)
                self.held.pop(h.batch_id, None)
                continue
            outcome = task.result()
            if isinstance(outcome, Parked):
                h.parks = 0 if outcome.progressed else h.parks + 1
                h.due = time.monotonic() + min(PARK_MAX_S, outcome.delay_s * 2 ** max(0, h.parks - 1))
                continue
            self.held.pop(h.batch_id, None)
            await streams.ack_delete(self.b.redis, h.stream, GROUP, [h.entry_id])

    def let_go_parked(self) -> None:
        for h in [h for h in self.held.values() if h.task is None]:
            self.held.pop(h.batch_id)

    async def touch(self) -> None:
        """Every third of --batch-claim-idle-s: the entries held touched (one taken over meanwhile let go, its
        run stopped), and parked batches cancelled since made due at once."""
        if time.monotonic() - self.touched < self.s.batch_claim_idle_s / 3 or not self.held:
            return
        self.touched = time.monotonic()
        by_stream: dict[str, list[str]] = {}
        for h in self.held.values():
            by_stream.setdefault(h.stream, []).append(h.entry_id)
        lost = {(key, i) for key, ids in (await streams.touch_own(self.b.redis, by_stream, self.member)).items()
                for i in ids}
        for h in [h for h in self.held.values() if (h.stream, h.entry_id) in lost]:
            log.warning("batch=%s taken over by another runner", h.batch_id)
            self.held.pop(h.batch_id)
            if h.task is not None:
                h.task.cancel()
        parked = [h for h in self.held.values() if h.task is None]
        async with self.b.redis.pipeline(transaction=False) as pipe:
            for h in parked:
                pipe.hget(self.b.keys.batch(h.batch_id), "status")
            statuses = await pipe.execute()
        for h, status in zip(parked, statuses, strict=True):
            if status in (None, b"cancelling"):
                h.due = 0.0

    async def fill(self) -> None:
        """Held batches that are due started, in turns: one per tenant, the first tenant moving on each time; for
        the slots they leave free, the next entries of tenants holding fewer than their cap, read in rounds."""
        free = self.s.batch_max_running - self.running()
        if free <= 0:
            return
        tenants = await self.known_tenants()
        k = self.turn % len(tenants)
        order = tenants[k:] + tenants[:k]
        self.turn += 1
        cap = self.s.batch_max_running_per_tenant
        want = [t for t in order if self.holds(t) < cap and self.next_due(t) is None]
        ready = sum(1 for t in order if self.next_due(t) is not None)
        while want and ready < free:
            take, want = want[:free - ready], want[free - ready:]
            await self.read(take)
            ready = sum(1 for t in order if self.next_due(t) is not None)
        while self.running() < self.s.batch_max_running:
            due = [h for h in map(self.next_due, order) if h is not None]
            if not due:
                return
            for h in due[:self.s.batch_max_running - self.running()]:
                h.task = asyncio.create_task(self.b.run(h.batch_id))
                h.task.add_done_callback(lambda _: self.wake.set())

    def holds(self, tenant: str) -> int:
        return sum(1 for h in self.held.values() if h.tenant == tenant)

    def next_due(self, tenant: str) -> Held | None:
        now = time.monotonic()
        if self.running(tenant) >= self.s.batch_max_running_per_tenant:
            return None
        ready = [h for h in self.held.values() if h.tenant == tenant and h.task is None and h.due <= now]
        return min(ready, key=lambda h: h.due, default=None)

    async def known_tenants(self) -> list[str]:
        """Every tenant that has created batches (open mode's "" always: its stream is the one of old)."""
        if time.monotonic() - self.tenants_at > TENANTS_S:
            names = {m.decode() for m in await self.b.redis.smembers(self.b.keys.batch_tenants())}
            self.tenants, self.tenants_at = sorted(names | {""}), time.monotonic()
        return self.tenants

    async def read(self, tenants: list[str]) -> None:
        """One entry of each tenant's stream: one whose runner went quiet, else a new one."""
        keys = {self.b.keys.batch_work(t): t for t in tenants}
        for key in keys:
            if key not in self.grouped and await streams.create_group(self.b.redis, key, GROUP, mkstream=True):
                self.grouped.add(key)
        idle_ms = int(self.s.batch_claim_idle_s * 1000)
        claimed = await streams.autoclaim(self.b.redis, {k: self.cursors.get(k, "0-0") for k in keys}, self.member,
                                          idle_ms, 1)
        rows: dict[str, streams.Rows] = {}
        for key, got in claimed.items():
            if isinstance(got, ResponseError):
                self.grouped.discard(key)  # NOGROUP: the stream was deleted; made again next time
                continue
            self.cursors[key], rows[key] = got
        fresh = await streams.read_group_each(self.b.redis, {k: 1 for k in keys if not rows.get(k)}, self.member)
        for key, got in fresh.items():
            if isinstance(got, ResponseError):
                self.grouped.discard(key)
                continue
            rows[key] = got
        for key, entries in rows.items():
            for entry_id, fields in entries:
                await self.hold(keys[key], key, entry_id, fields)

    async def hold(self, tenant: str, key: str, entry_id: str, fields: dict[bytes, bytes]) -> None:
        try:
            work = decode(fields[b"data"], BatchWork)
        except (KeyError, msgspec.DecodeError, msgspec.ValidationError):
            log.error("unreadable batch work entry %s: deleted", entry_id)
            await streams.ack_delete(self.b.redis, key, GROUP, [entry_id])
            return
        if work.batch_id in self.held:  # claimed back from itself: the same batch, already here
            return
        self.held[work.batch_id] = Held(tenant, key, entry_id, work.batch_id)
