"""Scheduler worker: consumer group `scheduler` on rsinfer:schedule:<model> (and, once it joined prefix routing,
its own stream and those of departed peers, read before it: services/scheduler/lanes.py), the engine, and one
rsinfer:detokenize:<model> entry per engine step.

Its loop (`work`): start the engine's step in a worker thread; meanwhile one round trip sends what the previous
step's effects are and reads the model's abort notifications, and new requests are read; then the step's
effects, and those of the requests that ended elsewhere, wait in the outbox for the next round trip. New
requests are taken only while the engine has room, and admitted between steps in a pipeline of their own. A
schedule entry is acknowledged only when its request has ended, so that a peer can resume it from its reply
stream if this process dies.

What decides is the request book (services/scheduler/book.py, no Redis); what it decides is written by one
function (services/scheduler/effects.py); what it must ask Redis of requests it did not start, or may no longer
own, is recovery's (services/scheduler/recovery.py), which hands what it finds back to the loop as data.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from redis.exceptions import RedisError

from services.scheduler.arrivals import Admission, Verdict
from services.scheduler.book import Ends, RequestBook, Unsent
from services.scheduler.effects import Dequeued, Effect, EffectWriter, Publish, raise_first_error, unapplied
from services.scheduler.engine.base import Engine, StepOutput
from services.scheduler.engine.factory import build_engine
from services.scheduler.lanes import SchedulerLanes
from services.scheduler.recovery import AbortNotes, Recovery
from services.scheduler.registered_adapters import SYNC_EVERY_S, RegisteredAdapters
from shared import queued
from shared.consumer_group import Delivery
from shared.keys import SCHEDULER_GROUP
from shared.messages import ScheduleJob
from shared.models import sentence_transformers_pooling, transformers_without_torch
from shared.request_store import RequestStore
from shared.settings import SchedulerSettings
from shared.worker import PullWorker, run_stage

log = logging.getLogger(__name__)

SWEEP_EVERY_S = 1.0  # how often abort flags, owners' heartbeats and request records are checked


class SchedulerWorker(PullWorker[ScheduleJob]):
    role = "scheduler"
    group = SCHEDULER_GROUP
    message_type = ScheduleJob

    def __init__(self, settings: SchedulerSettings, model_name: str, engine: Engine, model_path: str = "",
                 adapters: RegisteredAdapters | None = None):
        super().__init__(settings, model_name)
        self.engine = engine
        self.model_info = {"root": model_path or model_name, "max_model_len": engine.max_context}
        if (card := getattr(engine, "pooling_card", None)) is not None:  # embeddings and scores (paged engine)
            self.model_info.update(card(), **(sentence_transformers_pooling(model_path) if model_path else {}))
        # LoRA adapters from the registry (services/scheduler/registered_adapters.py); what the API checks a
        # load against
        self.adapters = adapters
        if adapters is not None:
            adapters.attach(self.redis, self.keys, engine)
        self.model_info.update(adapters.card() if adapters is not None else {"lora_slots": 0})
        # Tokens between checkpoints: at most a quarter of the reply stream's cap lies after the newest one
        # (one entry per token at most), so MAXLEN never trims it away.
        self.book = RequestBook(engine, self.id, settings.reply_maxlen // 4, Unsent(
            settings.stream_interval, settings.stream_flush_ms / 1000, settings.stream_entry_rate))
        self.admission = Admission(self.book, self.tracer)
        self.source.lane_key = functools.partial(self.keys.scheduler_stream, model_name)
        self.lanes = SchedulerLanes(self.redis, self.keys, model_name, self.source, page_size=engine.prefix_page_size,
                                    heartbeat_ttl_s=settings.heartbeat_ttl_s)
        self.heartbeat.extra = self.lanes.on_beat
        self.requests = RequestStore(self.redis, self.keys, self.ttl, self.maxlen)
        self.writer = EffectWriter(self.requests, self.source, self.lanes, self.id, self.keys.detokenize(model_name),
                                   detokenize_budget_mb=settings.detokenize_budget_mb)
        self.recovery = Recovery(self.requests, self.source, self.id, settings.max_deliveries)
        # Effects not sent yet: with the next exchange. A Redis outage keeps them here, so no step is lost.
        self.outbox: list[Effect] = []
        self.notes = AbortNotes(self.keys.aborts(model_name))
        # Read between steps only: the heartbeat runs while a step mutates the engine in its thread.
        self.engine_stats = engine.stats()
        # A batch whose admission pipeline Redis refused (full, or gone): admitted again at the next iteration.
        self.unadmitted: tuple[list[Delivery[ScheduleJob]], bool] | None = None

    # -- the loop -------------------------------------------------------------------------------------
    async def iteration(self) -> None:
        """One engine step with the Redis I/O overlapped (`work`), then admit what it read."""
        batch, claimed = await self.work(receive=True)
        if batch:
            await self.admit(batch, claimed)
        await self.housekeeping()
        if self.adapters is not None and self.due("adapters", SYNC_EVERY_S):
            await self.adapters.sync()

    async def work(self, receive: bool = False) -> tuple[list[Delivery[ScheduleJob]], bool]:
        """While the engine computes a step in its thread, one pipeline sends the outbox and reads the model's
        abort notifications, and (with `receive`) new requests are read. So Redis costs the step no time, and
        learning of aborts costs one command per step, not one per running request. The step's effects, and
        those of what ended meanwhile, go into the outbox: sent with the next step's exchange."""
        step = asyncio.ensure_future(self.engine_step()) if self.engine.has_work() else None
        batch: list[Delivery[ScheduleJob]] = []
        claimed, ends = False, Ends()
        try:
            ends = await self.exchange()
            if receive:
                batch, claimed = await self.receive(block_ms=None if step else 1000)
        finally:
            if step is not None:  # even when Redis failed: what it made waits in the outbox
                self.outbox += self.stepped(*await step)
        self.outbox += self.book.end(ends | await self.ends_due(), self.steps)
        self.engine_stats = self.engine.stats()
        self.last_step_at = time.time()  # the loop moved (liveness); a hung step leaves it stale
        return batch, claimed

    async def engine_step(self) -> tuple[list[StepOutput], float]:
        """One engine step, in a worker thread: its outputs and the seconds it took."""
        began = time.perf_counter()
        try:
            outputs = await asyncio.to_thread(self.engine.step)
        except Exception as e:  # the engine cannot tell whose it was: fail what it holds, serve what comes next
            log.exception("engine step failed; failing the %d requests it held", len(self.book.running))
            outputs = self.book.failed_step(e)
        self.steps += 1
        return outputs, time.perf_counter() - began

    def stepped(self, outputs: list[StepOutput], seconds: float) -> list[Effect]:
        """The effects of a step: the book's, and the pages the step cached and evicted (for routing)."""
        pages = self.lanes.pages_due(self.engine.prefix_changes, self.engine.prefix_digests)
        effects = self.book.stepped(outputs, self.steps, time.monotonic())
        published = sum(isinstance(e, Publish) for e in effects)
        self.metrics.step(seconds)
        self.metrics.published("detokenize", published)
        return effects if pages is None else [*effects, pages]

    async def exchange(self) -> Ends:
        """Send the outbox and read new abort notifications, in one round trip. On failure the effects stay
        queued for the next try."""
        async with self.redis.pipeline(transaction=False) as pipe:
            spans = self.writer.apply(pipe, self.outbox)
            self.notes.queue(pipe)
            *results, notes = await pipe.execute(raise_on_error=False)
        self.outbox = unapplied(self.outbox, spans, results)
        raise_first_error([*results, notes])
        return self.notes.ends(notes, self.book.running)

    async def ends_due(self) -> Ends:
        """What ended without a notification: deadlines, entries a peer claimed from us, and, once a second,
        what the sweep finds (services/scheduler/recovery.py; the TTL refreshes it asks for go with the outbox)."""
        if not self.book.running:
            return Ends()
        taken, self.taken = self.taken, set()
        ends = self.book.ends_due(time.time(), taken)
        if self.due("sweep", SWEEP_EVERY_S):
            view = self.book.sweep_view(time.monotonic(), self.recovery.refresh_every, SWEEP_EVERY_S)
            swept, refresh = await self.recovery.sweep(view)
            ends = ends | swept
            self.outbox += refresh
        return ends

    # -- admission ------------------------------------------------------------------------------------
    async def admit(self, batch: list[Delivery[ScheduleJob]], claimed: bool) -> None:
        """Start each request of a read, or end it here (aborted, past its deadline, a duplicate, poison), in one
        pipeline. If Redis refuses it (its maxmemory reached, or an outage), none of them runs: a request running
        without its record saying so would be dropped as `record_lost` by the next sweep. They stay pending and
        held, and are admitted again next iteration."""
        started: list[str] = []
        try:
            await self.send(await self.admission_effects(batch, claimed, started))
        except (RedisError, OSError):
            self.book.roll_back(started)
            self.unadmitted = (batch, claimed)
            raise

    async def admission_effects(self, batch: list[Delivery[ScheduleJob]], claimed: bool, started: list[str]
                                ) -> list[Effect]:
        """The effects of admitting a read. An exception while admitting one request fails that request (a 500 to
        its client), not the process: a restarted or peer scheduler would claim the same entry and die of it too."""
        if claimed:  # entries every scheduler died with: forgotten, dead-lettered and failed at once
            poisoned = await self.recovery.without_poison(batch)
            if poisoned.uids:
                for uid in poisoned.uids:
                    self.book.forget(uid)
                await self.send(poisoned.effects)
            batch = poisoned.kept
        if self.adapters is not None:  # adapter names -> the registrations' identities
            batch = await self.adapters.resolved(batch)
        uids = [d.msg.uid for d in batch]
        found = await self.recovery.look_up(uids)
        now, effects = time.time(), [Dequeued(self.model_name, queued.members(d.msg for d in batch))]
        for d in batch:
            try:
                verdict, ended = self.admission.verdict(d, claimed, found[d.msg.uid], now)
                if verdict is not Verdict.START:
                    effects += ended
                    continue
                effects += self.admission.start(d, await self.recovery.take_over(d.msg) if claimed else None)
                if d.msg.uid in self.book.running:
                    started.append(d.msg.uid)  # rolled back if Redis refuses the pipeline (`admit`)
            except (RedisError, OSError):
                raise
            except Exception as e:  # a bug or an engine that cannot take this job: fail it alone
                log.exception("uid=%s could not be admitted", d.msg.uid)
                effects += self.admission.refuse(d, e)
        return effects

    async def send(self, effects: list[Effect]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            self.writer.apply(pipe, effects)
            await pipe.execute()

    async def receive(self, block_ms: int | None = 1000) -> tuple[list[Delivery[ScheduleJob]], bool]:
        if self.unadmitted:  # a batch whose admission Redis refused: again, before anything new (counted once)
            batch, self.unadmitted = self.unadmitted, None
            return batch
        batch, claimed = await super().receive(block_ms)
        self.metrics.consumed("schedule", len(batch))
        return batch, claimed

    def read_count(self) -> int:
        return min(self.settings.batch_size, self.engine.room())

    def held_entries(self) -> list[str]:
        unadmitted = [d.entry_id for d in self.unadmitted[0]] if self.unadmitted else []
        return self.book.held_entries() + unadmitted

    def load(self) -> dict:
        return {**super().load(), **self.engine_stats, "requests": len(self.book.running), "outbox": len(self.outbox),
                "prefix_page_size": self.lanes.advertised_page_size,
                "max_running": self.settings.max_running}  # the API's SLO admission (services/api/answer/slo.py)

    # -- start, drain, close --------------------------------------------------------------------------
    async def flush(self) -> None:
        """Send the outbox in one pipeline; on failure it stays queued for the next try."""
        if self.outbox:
            async with self.redis.pipeline(transaction=False) as pipe:
                spans = self.writer.apply(pipe, self.outbox)
                results = await pipe.execute(raise_on_error=False)
            self.outbox = unapplied(self.outbox, spans, results)
            raise_first_error(results)

    async def finish_in_flight(self, deadline: float) -> None:
        """Shutdown: no new requests; step the running ones toward their end until the deadline (or a
        second signal), and send everything already produced before the rest is handed back."""
        while self.engine.has_work() and not self.forced.is_set() and time.monotonic() < deadline:
            try:
                await self.work(receive=False)
            except (RedisError, OSError) as e:
                log.warning("redis unavailable while draining (%s)", e)
                await asyncio.sleep(0.5)
        if self.book.running:
            log.info("grace period over with %d requests running; handing them back", len(self.book.running))
        self.outbox += self.book.unsent_now(self.steps)  # a successor resumes where the client stands: after these
        try:
            await self.flush()
        except (RedisError, OSError) as e:
            log.warning("could not send the last steps before handing back (%s)", e)

    async def adopt(self) -> None:
        await self.lanes.adopt()

    async def release(self) -> None:
        await self.lanes.release()

    async def start(self) -> None:
        await self.notes.start(self.redis)
        if self.adapters is not None:
            await self.adapters.register_configured()  # --lora-modules
        await self.lanes.start()  # the own stream (if it joins routing) exists before the heartbeat says we serve
        await super().start()

    async def close(self) -> None:
        self.engine.close()
        self.book.hand_back()
        if self.adapters is not None:
            await self.adapters.close()
        await super().close()


async def build_worker(settings: SchedulerSettings, model_path: str, model_name: str) -> SchedulerWorker:
    """Load the model and warm the engine up (kernels compiled, batch shapes run): all before the worker
    exists, so its heartbeat, which probes and the API read as "ready", appears only when it can serve."""
    if settings.engine == "synthetic":  # it runs no model: transformers reads the config without torch (~1 s less)
        transformers_without_torch()
    adapters = RegisteredAdapters(settings, model_name) if settings.max_loras and settings.engine == "paged" else None
    engine = await asyncio.to_thread(build_engine, settings, model_path, adapters)
    return SchedulerWorker(settings, model_name, engine, model_path, adapters)


def run(settings: SchedulerSettings) -> int:
    return run_stage(settings, lambda model_path, model_name: build_worker(settings, model_path, model_name))
