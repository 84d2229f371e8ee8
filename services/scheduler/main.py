"""Scheduler worker: consumer group `scheduler` on rsinfer:schedule:<model>, the engine, and one
rsinfer:detokenize:<model> entry per engine step.

Its loop: take new requests only while the engine has room, drop aborted and expired ones (one round
trip for all abort flags), run one engine step in a worker thread, publish what it produced, and
acknowledge a schedule entry only when its request has ended, so a peer can resume it if we die.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from services.scheduler.engine.base import Engine, EngineRequest, RequestRejected, StepOutput
from services.scheduler.engine.factory import build_engine
from shared import records, streams
from shared.keys import SCHEDULER_GROUP
from shared.messages import DetokenizeBatch, ReplyError, ScheduleJob, TokenDelta
from shared.settings import SchedulerSettings
from shared.streams import Delivery
from shared.worker import StageWorker, run_stage

log = logging.getLogger(__name__)

CONTEXT_TOKENS = 8  # completion tokens sent before each delta so detokenizing needs no state


@dataclass
class Running:
    """What the scheduler keeps per admitted request: enough to publish, acknowledge and resume."""

    entry_id: str
    job: ScheduleJob
    outputs: list[list[int]]
    done: set[int] = field(default_factory=set)

    @property
    def window(self) -> int:
        return CONTEXT_TOKENS + max((len(s.encode()) for s in self.job.params.stop), default=0)

    def delta(self, out: StepOutput) -> TokenDelta:
        seq = self.outputs[out.index]
        context = seq[max(0, out.start - self.window):out.start]
        p = self.job.params
        return TokenDelta(uid=self.job.uid, start=out.start, ids=out.ids, prompt_tokens=len(self.job.input_ids),
                          index=out.index, n=p.n, context=context, finish=out.finish_reason, stop=p.stop,
                          skip_special_tokens=p.skip_special_tokens, logprobs=out.logprobs,
                          top_logprobs=out.top_logprobs)


class SchedulerWorker(StageWorker[ScheduleJob]):
    role = "scheduler"
    group = SCHEDULER_GROUP
    message_type = ScheduleJob

    def __init__(self, settings: SchedulerSettings, model_name: str, engine: Engine):
        super().__init__(settings, model_name)
        self.engine = engine
        self.running: dict[str, Running] = {}
        self.detokenize_key = self.keys.detokenize(model_name)

    def load(self) -> dict:
        return {**super().load(), **self.engine.stats(), "requests": len(self.running),
                "busy": self.engine.has_work()}

    def read_count(self) -> int:
        return min(self.settings.batch_size, self.engine.room())

    async def iteration(self) -> None:
        """Receive (only while there is room), drop aborted, step, send, acknowledge ended requests."""
        batch, claimed = await self.receive(block_ms=None if self.engine.has_work() else 1000)
        if batch:
            await self.admit(batch, claimed)
        await self.drop_aborted()
        if self.engine.has_work():
            outputs = await asyncio.to_thread(self.engine.step)
            self.steps += 1
            await self.publish(outputs)
        self.last_step_at = time.time()  # the loop moved (liveness); a hung step leaves it stale
        await self.housekeeping()

    async def admit(self, batch: list[Delivery[ScheduleJob]], claimed: bool) -> None:
        aborted = await records.abort_reasons(self.redis, self.keys, (d.msg.uid for d in batch))
        now = time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            for d in batch:
                job = d.msg
                if job.uid in self.running:  # a duplicate delivery of a request we already run
                    continue
                if job.uid in aborted:
                    records.end_aborted(pipe, self.keys, job.uid, job.params.n, aborted[job.uid], self.ttl,
                                        self.maxlen, len(job.input_ids))
                elif job.deadline <= now:
                    records.end_failed(pipe, self.keys, job.uid, records.deadline_error(), self.ttl, self.maxlen)
                else:
                    try:
                        self.engine.add(EngineRequest(job.uid, job.input_ids, job.params))
                    except RequestRejected as e:
                        log.info("uid=%s rejected by the engine: %s", job.uid, e)
                        records.end_failed(pipe, self.keys, job.uid, ReplyError(
                            message=str(e), status=400, type="invalid_request_error",
                            code="context_length_exceeded"), self.ttl, self.maxlen)
                    else:
                        self.running[job.uid] = Running(d.entry_id, job, [[] for _ in range(job.params.n)])
                        records.set_status(pipe, self.keys, job.uid, self.ttl, "running", scheduler=self.id)
                        continue
                self.source.ack_in(pipe, [d.entry_id])
            await pipe.execute()

    async def drop_aborted(self) -> None:
        """One round trip reads every running request's abort flag; deadlines are checked locally."""
        if not self.running:
            return
        reasons = await records.abort_reasons(self.redis, self.keys, self.running)
        now = time.time()
        expired = [uid for uid, r in self.running.items() if r.job.deadline <= now and uid not in reasons]
        if not reasons and not expired:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            items = []
            for uid, reason in reasons.items():
                run = self.running.pop(uid)
                self.engine.abort(uid)
                log.info("uid=%s aborted (%s)", uid, reason)
                if reason != "stop":  # a stop string already ended the reply in the detokenizer
                    records.set_status(pipe, self.keys, uid, self.ttl, error=f"aborted: {reason}")
                    items += [TokenDelta(uid=uid, start=len(seq), ids=[], prompt_tokens=len(run.job.input_ids),
                                         index=i, n=run.job.params.n, finish="abort")
                              for i, seq in enumerate(run.outputs) if i not in run.done]
                self.source.ack_in(pipe, [run.entry_id])
            for uid in expired:
                run = self.running.pop(uid)
                self.engine.abort(uid)
                log.info("uid=%s dropped: deadline passed", uid)
                records.end_failed(pipe, self.keys, uid, records.deadline_error(), self.ttl, self.maxlen)
                self.source.ack_in(pipe, [run.entry_id])
            if items:
                streams.add(pipe, self.detokenize_key, DetokenizeBatch(self.id, self.steps, items))
            await pipe.execute()

    async def publish(self, outputs: list[StepOutput]) -> None:
        items, ended, failed = [], [], []
        for out in outputs:
            run = self.running.get(out.uid)
            if run is None:
                continue
            if out.error is not None:
                failed.append((out.uid, out.error))
                continue
            items.append(run.delta(out))
            run.outputs[out.index].extend(out.ids)
            if out.finish_reason is not None:
                run.done.add(out.index)
                if len(run.done) == run.job.params.n:
                    ended.append(out.uid)
        async with self.redis.pipeline(transaction=False) as pipe:
            if items:
                streams.add(pipe, self.detokenize_key, DetokenizeBatch(self.id, self.steps, items))
            for uid, error in failed:
                log.error("uid=%s failed in the engine: %s", uid, error)
                self.engine.abort(uid)
                records.end_failed(pipe, self.keys, uid, ReplyError(message=error), self.ttl, self.maxlen)
                ended.append(uid)
            self.source.ack_in(pipe, [self.running.pop(uid).entry_id for uid in ended if uid in self.running])
            await pipe.execute()

    async def close(self) -> None:
        self.engine.close()
        await super().close()


def run(settings: SchedulerSettings) -> int:
    async def build(model_path: str, model_name: str) -> SchedulerWorker:
        engine = await asyncio.to_thread(build_engine, settings, model_path)
        return SchedulerWorker(settings, model_name, engine)

    return run_stage(settings, build)
