"""Scheduler worker: consumer group `scheduler` on rsinfer:schedule:<model> (and, read before it, its own stream
of the jobs routed to it and those of departed peers: shared/routing.py), the engine, and one
rsinfer:detokenize:<model> entry per engine step.

Its loop: take new requests only while the engine has room, drop requests that ended elsewhere (abort
flags in one round trip per step; deadlines; owners and records gone, once a second), run one engine
step in a worker thread, publish what it produced, and acknowledge a schedule entry only when its
request has ended, so that a peer can resume it from its reply stream if this process dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from services.scheduler.engine.base import Engine, EngineRequest, RequestRejected, StepOutput
from services.scheduler.engine.factory import build_engine
from shared import records, streams
from shared.keys import SCHEDULER_GROUP
from shared.messages import (
    DetokenizeBatch,
    Reply,
    ReplyCheckpoint,
    ReplyError,
    ReplyFence,
    ScheduleJob,
    TokenDelta,
    decode,
    encode,
)
from shared.replies import ProducedTokens
from shared.routing import SchedulerLanes
from shared.settings import SchedulerSettings
from shared.streams import Delivery
from shared.tracing import NO_SPAN, Span
from shared.worker import PullWorker, run_stage

log = logging.getLogger(__name__)

# Tokens sent before each delta so detokenizing needs no state. They must span the detokenizer's
# held-back tail (up to 3 U+FFFD) plus a character cut at the window's start (or one the prompt left
# unfinished): 8 do.
CONTEXT_TOKENS = 8
# Detokenize entries published between two updates of the mean entry size (the stream's MAXLEN follows it).
ENTRY_SIZE_WEIGHT = 1 / 64
MIN_DETOKENIZE_MAXLEN = 1_000  # steps kept at least, however large the entries
SWEEP_EVERY_S = 1.0  # how often abort flags, owners' heartbeats and request records are checked
ABORTS_PER_READ = 1000
TTL_REFRESH_S = 60.0  # at most this long between refreshes of a running request's TTLs (a tenth of the TTL if less)


@dataclass
class Ends:
    """Requests to drop (uid -> reason) and choices a stop string ended, learned between two steps."""

    requests: dict[str, str] = field(default_factory=dict)
    choices: set[tuple[str, int]] = field(default_factory=set)

    def add_note(self, note: dict[str, str], running: dict) -> None:
        """An abort notification (shared/records.py `abort`, `stop_choice`) about one of ours, if it is."""
        uid = note.get("uid", "")
        if uid not in running:
            return
        if "choice" in note:
            self.choices.add((uid, int(note["choice"])))
        else:
            self.requests[uid] = note.get("reason", "aborted")

    def __or__(self, other: Ends) -> Ends:
        return Ends({**other.requests, **self.requests}, self.choices | other.choices)


@dataclass
class Running:
    """What the scheduler keeps per admitted request: enough to publish, acknowledge and resume."""

    entry_id: str
    job: ScheduleJob
    outputs: list[list[int]]
    done: set[int] = field(default_factory=set)
    span: Span = NO_SPAN  # from admission to the request's end, when traced
    steps: int = 0  # engine steps that produced tokens for it
    epoch: int = 0  # raised by every takeover; on every delta, so a successor's fence refuses ours
    checkpointed: int = 0  # tokens (all choices) at the last checkpoint written to the reply stream
    prompt_scores: list | None = None  # echo with logprobs: choice 0's, for every choice's first delta
    refreshed: float = field(default_factory=time.monotonic)  # when its keys' TTLs were last set
    window: int = field(init=False)  # completion tokens sent before each delta (`context`)

    def __post_init__(self) -> None:
        self.window = CONTEXT_TOKENS + stop_span(self.job.params.stop)

    def context(self, seq: list[int], start: int) -> list[int]:
        """The tokens before completion token `start` that it is decoded after: the completion's last
        `window`, and while the completion is shorter than CONTEXT_TOKENS the prompt's last tokens before
        them up to that count (as vLLM and SGLang seed their detokenizers with the prompt's tail), since
        SentencePiece-style tokenizers drop the leading space of a window's first word. A function of
        (prompt, completion, start) only, so a peer resuming the request sends the same windows."""
        context = seq[max(0, start - self.window):start]
        if start < CONTEXT_TOKENS:
            prompt = self.job.input_ids
            context = prompt[max(0, len(prompt) - (CONTEXT_TOKENS - start)):] + context
        return context

    def delta(self, out: StepOutput) -> TokenDelta:
        context = self.context(self.outputs[out.index], out.start)
        p = self.job.params
        first: dict = {}
        if out.start == 0:  # what a choice's first delta tells: cache hits, and the prompt for echo
            self.prompt_scores = out.prompt_logprobs or self.prompt_scores
            first = {"cached_tokens": out.cached_tokens, "prompt_ids": self.job.input_ids if p.echo else None,
                     "prompt_logprobs": self.prompt_scores if p.prompt_logprobs is not None else None}
        edge = out.start == 0 or out.finish_reason is not None  # the detokenizer traces these
        # The stop strings go with a choice's first delta only; the others say how many there are, and a
        # detokenizer that lacks them reads them from the record (shared/messages.py TokenDelta).
        return TokenDelta(uid=self.job.uid, start=out.start, ids=out.ids, prompt_tokens=len(self.job.input_ids),
                          index=out.index, n=p.n, context=context, finish=out.finish_reason,
                          stop=p.stop if out.start == 0 else [], stops=len(p.stop),
                          skip_special_tokens=p.skip_special_tokens, logprobs=out.logprobs,
                          top_logprobs=out.top_logprobs, trace=self.job.trace if edge else None,
                          epoch=self.epoch, **first)

    def end_span(self, outcome: str, error: str | None = None) -> None:
        self.span.set(outcome=outcome, steps=self.steps, completion_tokens=sum(len(o) for o in self.outputs))
        self.span.end(error)

    def abort_deltas(self) -> list[TokenDelta]:
        """A final "abort" for every choice still open, so the client's reply ends in order."""
        return [TokenDelta(uid=self.job.uid, start=len(seq), ids=[], prompt_tokens=len(self.job.input_ids),
                           index=i, n=self.job.params.n, finish="abort", epoch=self.epoch)
                for i, seq in enumerate(self.outputs) if i not in self.done]

    def checkpoint_due(self, every: int) -> ReplyCheckpoint | None:
        """After `every` more tokens (of all choices; at least 16 per choice), all tokens so far: a successor
        resumes from the newest one, so resuming never depends on the head of a capped reply stream."""
        total = sum(len(o) for o in self.outputs)
        if total - self.checkpointed < max(every, 16 * self.job.params.n):
            return None
        self.checkpointed = total
        return ReplyCheckpoint(epoch=self.epoch, outputs=[list(o) for o in self.outputs])


class SchedulerWorker(PullWorker[ScheduleJob]):
    role = "scheduler"
    group = SCHEDULER_GROUP
    message_type = ScheduleJob

    def __init__(self, settings: SchedulerSettings, model_name: str, engine: Engine, model_path: str = ""):
        super().__init__(settings, model_name)
        self.engine = engine
        self.model_info = {"root": model_path or model_name, "max_model_len": engine.max_context}
        # Tokens between checkpoints: at most a quarter of the reply stream's cap lies after the newest one
        # (one entry per token at most), so MAXLEN never trims it away.
        self.checkpoint_every = settings.reply_maxlen // 4
        self.running: dict[str, Running] = {}
        self.detokenize_key = self.keys.detokenize(model_name)
        self.entry_bytes = 1024.0  # mean size of the detokenize entries published (bytes), for their MAXLEN
        self.aborts_key = self.keys.aborts(model_name)
        self.aborts_cursor = "0-0"  # set to the stream's tip at start
        # Writes a Redis outage kept us from sending; sent first when Redis is back, so no step is lost.
        self.outbox: list[Callable[[Pipeline], None]] = []
        # Read between steps only: the heartbeat runs while a step mutates the engine in its thread.
        self.engine_stats = engine.stats()
        # --stream-interval: each open choice's tokens not published yet, merged over steps, and how many steps
        self.unsent: dict[tuple[str, int], tuple[StepOutput, int]] = {}
        self.source.lane_key = functools.partial(self.keys.scheduler_stream, model_name)
        self.lanes = SchedulerLanes(self.redis, self.keys, model_name, self.id, self.source, engine.prefix_page_size,
                                    settings.heartbeat_ttl_s)
        self.heartbeat.extra = self.lanes.on_beat
        # A batch whose admission pipeline Redis refused (full, or gone): admitted again at the next iteration.
        self.unadmitted: tuple[list[Delivery[ScheduleJob]], bool] | None = None
        self.started: list[str] = []  # uids the admission in progress started

    def load(self) -> dict:
        return {**super().load(), **self.engine_stats, "requests": len(self.running), "outbox": len(self.outbox),
                "prefix_page_size": self.lanes.advertised_page_size}

    def read_count(self) -> int:
        return min(self.settings.batch_size, self.engine.room())

    def held_entries(self) -> list[str]:
        unadmitted = [d.entry_id for d in self.unadmitted[0]] if self.unadmitted else []
        return [r.entry_id for r in self.running.values()] + unadmitted

    async def receive(self, block_ms: int | None = 1000) -> tuple[list[Delivery[ScheduleJob]], bool]:
        if self.unadmitted:  # a batch whose admission Redis refused: again, before anything new
            batch, self.unadmitted = self.unadmitted, None
            return batch
        return await super().receive(block_ms)

    async def iteration(self) -> None:
        """One engine step, the Redis I/O overlapped with it (`work`), then between steps: end what ended
        elsewhere and admit new requests (read only while the engine has room)."""
        batch, claimed = await self.work(receive=True)
        if batch:
            await self.admit(batch, claimed)
        await self.housekeeping()

    async def work(self, receive: bool = False) -> tuple[list[Delivery[ScheduleJob]], bool]:
        """While the engine computes a step in its thread, one pipeline sends what the previous step produced
        and reads the model's abort notifications, and (with `receive`) new requests are read. So Redis costs
        the step no time, and learning of aborts costs one command per step, not one per running request."""
        step = asyncio.ensure_future(self._step()) if self.engine.has_work() else None
        batch: list[Delivery[ScheduleJob]] = []
        claimed, ends = False, Ends()
        try:
            ends = await self.exchange()
            if receive:
                batch, claimed = await self.receive(block_ms=None if step else 1000)
        finally:
            if step is not None:  # even when Redis failed: what it made waits in the outbox
                self.queue_outputs(await step)
                self.queue_prefix_changes()
        await self.end(ends | await self.ends_due())
        self.engine_stats = self.engine.stats()
        self.last_step_at = time.time()  # the loop moved (liveness); a hung step leaves it stale
        return batch, claimed

    async def _step(self) -> list[StepOutput]:
        began = time.perf_counter()
        try:
            outputs = await asyncio.to_thread(self.engine.step)
        except Exception as e:  # the engine cannot tell whose it was: fail what it holds, serve what comes next
            log.exception("engine step failed; failing the %d requests it held", len(self.running))
            outputs = [StepOutput(uid, len(run.outputs[i]), [], i, "error", error=f"engine error: {e}")
                       for uid, run in self.running.items() for i in range(run.job.params.n) if i not in run.done]
        self.metrics.step(time.perf_counter() - began)
        self.steps += 1
        return outputs

    async def exchange(self) -> Ends:
        """Send every queued write and read new abort notifications, in one round trip. On failure the writes
        stay queued for the next try."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for write in self.outbox:
                write(pipe)
            pipe.xread({self.aborts_key: self.aborts_cursor}, count=ABORTS_PER_READ)
            *_, notes = await pipe.execute()
        self.outbox.clear()
        ends = Ends()
        for _key, entries in notes or []:
            self.aborts_cursor = entries[-1][0]
            for _, fields in entries:
                ends.add_note({k.decode(): v.decode() for k, v in fields.items()}, self.running)
        return ends

    def queue_prefix_changes(self) -> None:
        """The pages the step cached and evicted, for the tokenizers' routing: on the next step's pipeline."""
        changes = self.lanes.pages_due(self.engine.prefix_changes, self.engine.prefix_digests)
        if changes is not None:
            self.outbox.append(lambda pipe: self.lanes.write_pages(pipe, changes))

    async def adopt(self) -> None:
        await self.lanes.adopt()

    async def release(self) -> None:
        await self.lanes.release()

    async def finish_in_flight(self, deadline: float) -> None:
        """Shutdown: no new requests; step the running ones toward their end until the deadline (or a
        second signal), and send everything already produced before the rest is handed back."""
        while self.engine.has_work() and not self.forced.is_set() and time.monotonic() < deadline:
            try:
                await self.work(receive=False)
            except (RedisError, OSError) as e:
                log.warning("redis unavailable while draining (%s)", e)
                await asyncio.sleep(0.5)
        if self.running:
            log.info("grace period over with %d requests running; handing them back", len(self.running))
        self.publish_unsent()  # a successor resumes where the client stands: after these
        try:
            await self.flush()
        except (RedisError, OSError) as e:
            log.warning("could not send the last steps before handing back (%s)", e)

    # -- admission ----------------------------------------------------------------------------------------
    async def admit(self, batch: list[Delivery[ScheduleJob]], claimed: bool) -> None:
        """Start each request of a read, or end it here (aborted, past its deadline, a duplicate, poison). An
        exception while admitting one request fails that request (a 500 to its client), not the process: a
        restarted or peer scheduler would claim the same entry and die of it too. If Redis refuses the pipeline
        that records them (its maxmemory reached, or an outage), none of them runs: a request running without
        its record saying so would be dropped as `record_lost` by the next sweep. They stay pending and held,
        and are admitted again next iteration."""
        self.started = []
        try:
            await self._admit(batch, claimed)
        except (RedisError, OSError):
            for uid in self.started:
                if (run := self.running.pop(uid, None)) is not None:
                    self.engine.abort(uid)
                    run.end_span("not_admitted")
            self.unadmitted = (batch, claimed)
            raise

    async def _admit(self, batch: list[Delivery[ScheduleJob]], claimed: bool) -> None:
        self.metrics.consumed("schedule", len(batch))
        if claimed:
            batch = await self._within_delivery_limit(batch)
        uids = [d.msg.uid for d in batch]
        aborted = await records.abort_reasons(self.redis, self.keys, uids)
        owners = await self._record_fields(uids, "scheduler", "entry")
        now = time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            for d in batch:
                try:
                    if not await self._admit_one(pipe, d, claimed, owners[d.msg.uid], aborted.get(d.msg.uid), now):
                        continue
                except (RedisError, OSError):
                    raise
                except Exception as e:  # a bug or an engine that cannot take this job: fail it alone
                    log.exception("uid=%s could not be admitted", d.msg.uid)
                    self._forget(d.msg.uid)
                    records.end_failed(pipe, self.keys, d.msg.uid, ReplyError(
                        message=f"the scheduler could not start the request: {type(e).__name__}: {e}"),
                        self.ttl, self.maxlen)
                self.source.ack_in(pipe, [d.entry_id])
            await pipe.execute()

    async def _admit_one(self, pipe: Pipeline, d: Delivery[ScheduleJob], claimed: bool, owned: list[str | None],
                         aborted: str | None, now: float) -> bool:
        """Queue what admitting one entry writes; whether to acknowledge it now (False: it runs, or is not ours)."""
        job = d.msg
        owner, owner_entry = owned
        if job.uid in self.running:
            if not (claimed and self.running[job.uid].entry_id == d.entry_id):
                return False  # delivered twice to us: already running
            # Its entry went idle while we ran it: we stalled past the claim idle, and a peer may have taken it
            # over and died before it recorded itself as the owner. What we run may be fenced out: take it over
            # like any claimed entry, under a new epoch.
            log.info("uid=%s: our own entry was idle long enough to claim; resuming it anew", job.uid)
            self._drop(job.uid, "taken_over")
        if owner and owner_entry and owner_entry != d.entry_id:
            # Another schedule entry of the same request was admitted (the tokenizer forwarded it twice):
            # acknowledge this one, or every claim interval a peer would resume the request from it and take it
            # from its owner, back and forth.
            log.info("uid=%s duplicate schedule entry dropped (admitted by %s)", job.uid, owner)
        elif not claimed and owner:  # we were hung; a peer claimed this very entry: it is theirs
            log.info("uid=%s was taken over by %s while we were stalled", job.uid, owner)
            return False
        elif aborted is not None:
            records.end_aborted(pipe, self.keys, job.uid, job.params.n, aborted, self.ttl, self.maxlen,
                                len(job.input_ids))
        elif job.deadline <= now:
            records.end_failed(pipe, self.keys, job.uid, records.deadline_error(), self.ttl, self.maxlen)
        elif await self._start(pipe, d, claimed):
            self.started.append(job.uid)  # rolled back if Redis refuses the pipeline (`admit`)
            return False
        return True

    async def _within_delivery_limit(self, batch: list[Delivery[ScheduleJob]]) -> list[Delivery[ScheduleJob]]:
        """Claimed entries delivered more than --max-deliveries times: each delivery ended with its scheduler
        gone (a crash while running it, e.g. a native one no `except` sees), and the next would take down the
        next scheduler. Dead-lettered, and their clients answered at once with an error."""
        counts = await self.source.delivery_counts([d.entry_id for d in batch])
        limit = self.settings.max_deliveries
        poison = [d for d in batch if counts.get(d.entry_id, 0) > limit]
        if not poison:
            return batch
        await self.source.dead_letter([(d.entry_id, {streams.FIELD: encode(d.msg)},
                                        f"delivered {counts[d.entry_id]} times; each scheduler died with it")
                                       for d in poison])
        async with self.redis.pipeline(transaction=False) as pipe:
            for d in poison:
                log.error("uid=%s dead-lettered: its schedule entry was delivered %d times", d.msg.uid,
                          counts[d.entry_id])
                self._forget(d.msg.uid)
                records.end_failed(pipe, self.keys, d.msg.uid, poison_error(counts[d.entry_id]), self.ttl,
                                   self.maxlen)
            await pipe.execute()
        bad = {d.entry_id for d in poison}
        return [d for d in batch if d.entry_id not in bad]

    def _forget(self, uid: str) -> None:
        """Whatever the engine and this worker hold of a request that fails at admission."""
        self.engine.abort(uid)
        self._take_unsent(uid)
        run = self.running.pop(uid, None)
        if run is not None:
            run.end_span("failed")

    async def _start(self, pipe: Pipeline, d: Delivery[ScheduleJob], claimed: bool) -> bool:
        """Hand a request to the engine (resuming from its reply stream when claimed); False if it ended."""
        job, n = d.msg, d.msg.params.n
        outputs, done, epoch = [[] for _ in range(n)], set(), 0
        if claimed:
            produced, epoch = await self._take_over(job)
            if produced.failed or produced.done:
                return False
            if produced.unresumable:
                log.error("uid=%s cannot resume: its reply stream was trimmed past every checkpoint", job.uid)
                records.end_failed(pipe, self.keys, job.uid, ReplyError(
                    message="the request could not be resumed after its scheduler failed"), self.ttl, self.maxlen)
                return False
            outputs, done = produced.outputs, set(produced.finished)
            log.info("uid=%s resumed after %s tokens (epoch %d)", job.uid, [len(o) for o in outputs], epoch)
        try:
            max_tokens = self.engine.add(EngineRequest(job.uid, job.input_ids, job.params,
                                                       outputs if claimed else []))
        except RequestRejected as e:
            log.info("uid=%s rejected by the engine: %s", job.uid, e)
            records.end_failed(pipe, self.keys, job.uid, ReplyError(
                message=str(e), status=400, type="invalid_request_error", code=e.code, param=e.param),
                self.ttl, self.maxlen)
            return False
        span = self.tracer.start("schedule", job.trace, uid=job.uid, scheduler=self.id, resumed=claimed,
                                 prompt_tokens=len(job.input_ids))
        self.running[job.uid] = Running(d.entry_id, job, outputs, done, span, epoch=epoch,
                                        checkpointed=sum(len(o) for o in outputs))
        # The stop strings, for a detokenizer that did not see a choice's first delta (shared/messages.py
        # TokenDelta); written before any delta of the request is published.
        stop = msgspec.json.encode(job.params.stop).decode() if job.params.stop else None
        records.set_status(pipe, self.keys, job.uid, self.ttl, "running", scheduler=self.id, entry=d.entry_id,
                           max_tokens=max_tokens, stop=stop)
        return True

    async def _take_over(self, job: ScheduleJob) -> tuple[ProducedTokens, int]:
        """Raise the request's epoch, put a fence with it into the reply stream, and read what came before
        the fence: that is exactly what clients get of the previous owners (shared/replies.py)."""
        epoch = await self.redis.hincrby(self.keys.request(job.uid), "epoch", 1)
        async with self.redis.pipeline(transaction=False) as pipe:
            records.reply(pipe, self.keys, job.uid, ReplyFence(epoch=epoch, scheduler=self.id), self.ttl, self.maxlen)
            pipe.xinfo_stream(self.keys.reply(job.uid))
            pipe.xrange(self.keys.reply(job.uid))
            fence_id, _, info, entries = await pipe.execute()
        produced = ProducedTokens(job.params.n, trimmed=streams.was_trimmed(info))
        for entry_id, fields in entries:
            if entry_id == fence_id:
                break
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                produced.add(decode(streams.payload(fields), Reply))
        produced.fence(epoch)
        return produced, epoch

    async def _record_fields(self, uids: list[str], *names: str) -> dict[str, list[str | None]]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for uid in uids:
                pipe.hmget(self.keys.request(uid), names)
            rows = await pipe.execute()
        return {u: [v.decode() if v is not None else None for v in row] for u, row in zip(uids, rows, strict=True)}

    # -- ending requests that ended elsewhere ---------------------------------------------------------------
    async def ends_due(self) -> Ends:
        """What ended without a notification: deadlines, entries a peer claimed from us, and, once a second,
        the abort flags of every running request (an operator's `SET rsinfer:abort:<uid>`, or a notification
        lost in a Redis outage) and requests whose client or record is gone."""
        ends = Ends()
        if not self.running:
            return ends
        now = time.time()
        ends.requests |= {uid: "timeout" for uid, r in self.running.items() if r.job.deadline <= now}
        if self.taken:  # our entries a peer claimed while we were stalled (keep_alive found them)
            lost, self.taken = self.taken, set()
            ends.requests |= {uid: "taken_over" for uid, r in self.running.items() if r.entry_id in lost}
        if self.due("sweep", SWEEP_EVERY_S):
            stoppable = [(uid, i) for uid, r in self.running.items() if r.job.params.n > 1 and r.job.params.stop
                         for i in range(r.job.params.n) if i not in r.done]
            flagged, ends.choices = await records.ended_elsewhere(self.redis, self.keys, self.running, stoppable)
            ends.requests = {**await self._orphans(), **flagged, **ends.requests}
        return ends

    async def end(self, ends: Ends) -> None:
        for uid, index in ends.choices:
            self._stop_choice(uid, index)
        for uid, reason in ends.requests.items():
            if uid in self.running:
                self._drop(uid, reason)

    async def _orphans(self) -> dict[str, str]:
        """Requests nobody can receive or that are no longer ours: the API process died (unless they run
        in the background), the record is gone (Redis lost its data), or a peer took them over while we
        were stalled. Refreshes the TTLs of the rest."""
        runs = list(self.running.values())
        pods = sorted({r.job.pod for r in runs})
        # TTLs are refreshed a few times per TTL, not every sweep: two commands per running request a second
        # were most of what a long generation cost Redis beyond its tokens.
        now, every = time.monotonic(), min(TTL_REFRESH_S, self.ttl / 10)
        stale = [r for r in runs if now - r.refreshed >= every]
        async with self.redis.pipeline(transaction=False) as pipe:
            for pod in pods:
                pipe.exists(self.keys.worker("api", pod))
            for r in runs:
                pipe.hmget(self.keys.request(r.job.uid), ["scheduler", "epoch"])
            for r in stale:
                pipe.expire(self.keys.request(r.job.uid), self.ttl)
                pipe.expire(self.keys.reply(r.job.uid), self.ttl)
                r.refreshed = now
            found = await pipe.execute()
        alive = {pod for pod, ok in zip(pods, found, strict=False) if ok}
        owners = found[len(pods):len(pods) + len(runs)]
        out = {}
        for r, (owner, epoch) in zip(runs, owners, strict=True):
            if owner is None:
                out[r.job.uid] = "record_lost"
            elif owner.decode() != self.id or int(epoch or 0) != r.epoch:
                # A newer epoch with us still recorded as the owner: a peer took over and died before it
                # recorded itself. Our steps are refused after its fence; dropped, the entry goes idle and
                # whoever claims it resumes from what the client has.
                out[r.job.uid] = "taken_over"
            elif r.job.pod not in alive and not r.job.background:
                out[r.job.uid] = "owner_gone"
        return out

    def _stop_choice(self, uid: str, index: int) -> None:
        """A stop string ended this choice in the detokenizer (which wrote its last range): stop generating it,
        and end the request if it was the last one open."""
        run = self.running.get(uid)
        if run is None or index in run.done:
            return
        self.engine.abort(uid, index)
        self._take_unsent(uid, index)  # past the stop string: the detokenizer would drop them
        run.done.add(index)
        log.info("uid=%s choice=%d stopped by a stop string", uid, index)
        if len(run.done) == run.job.params.n:
            del self.running[uid]
            run.end_span("finished")
            self.outbox.append(lambda pipe: self.source.ack_in(pipe, [run.entry_id]))

    def _drop(self, uid: str, reason: str) -> None:
        unsent = self._take_unsent(uid)
        run = self.running.pop(uid)
        self.engine.abort(uid)
        run.end_span(reason)
        log.info("uid=%s dropped: %s", uid, reason)

        def write(pipe: Pipeline) -> None:
            if reason == "taken_over":  # the entry and the reply are the peer's now
                return
            if reason == "timeout":
                records.end_failed(pipe, self.keys, uid, records.deadline_error(), self.ttl, self.maxlen)
            elif reason != "stop":  # a stop string already ended the reply in the detokenizer
                records.set_status(pipe, self.keys, uid, self.ttl, error=f"aborted: {reason}")
                pipe.expire(self.keys.abort(uid), self.ttl)  # an operator's flag need not outlive the request
                # the tokens made before the abort first, so the abort lands where the client stands
                deltas = [run.delta(o) for o in unsent] + run.abort_deltas()
                self.publish(pipe, DetokenizeBatch(self.id, self.steps, deltas))
            self.source.ack_in(pipe, [run.entry_id])

        self.outbox.append(write)

    # -- publishing ---------------------------------------------------------------------------------------
    def queue_outputs(self, outputs: list[StepOutput]) -> None:
        items, ended, stepped = [], [], set()
        for out in outputs:
            run = self.running.get(out.uid)
            if run is None or out.index in run.done:
                continue
            if out.error is not None:
                self._fail(out.uid, out.error, out.error_status, out.error_param)
                continue
            if out.uid not in stepped:
                stepped.add(out.uid)
                run.steps += 1
                if run.steps == 1:
                    run.span.event("first_tokens")
            if (due := self._due(out)) is not None:
                items.append(run.delta(due))
            run.outputs[out.index].extend(out.ids)
            if out.finish_reason is not None:
                run.done.add(out.index)
                if len(run.done) == run.job.params.n:
                    ended.append(self.running.pop(out.uid).entry_id)
                    run.end_span("finished")
        batch = DetokenizeBatch(self.id, self.steps, items) if items else None
        self.metrics.published("detokenize", int(batch is not None))
        checkpoints = [(uid, ck) for uid in {it.uid for it in items}
                       if uid in self.running and (ck := self.running[uid].checkpoint_due(self.checkpoint_every))]

        def write(pipe: Pipeline) -> None:
            if batch:
                self.publish(pipe, batch)
            for uid, ck in checkpoints:
                records.reply(pipe, self.keys, uid, ck, self.ttl, self.maxlen, refresh_ttl=False)
            self.source.ack_in(pipe, ended)

        self.outbox.append(write)

    def publish(self, pipe: Pipeline, batch: DetokenizeBatch) -> None:
        """XADD a step's deltas to the model's detokenize stream, capped near --detokenize-budget-mb: MAXLEN ~
        the budget over the mean entry size. Detokenizers read an entry within milliseconds and every worker trims
        what its group acknowledged every 10 s, so the cap only bites when no detokenizer reads for a long while
        (entries trimmed unread are token ranges lost: their requests end at their deadline), not Redis' memory."""
        data = encode(batch)
        self.entry_bytes += (len(data) - self.entry_bytes) * ENTRY_SIZE_WEIGHT
        maxlen = max(MIN_DETOKENIZE_MAXLEN, int(self.settings.detokenize_budget_mb * 2**20 / self.entry_bytes))
        streams.add_data(pipe, self.detokenize_key, data, maxlen)

    def _due(self, out: StepOutput) -> StepOutput | None:
        """With --stream-interval N, a choice's tokens wait until N steps' worth are merged into one output; its
        first output (time to first token) and its last go at once. None while they wait."""
        if self.settings.stream_interval == 1:
            return out
        key = (out.uid, out.index)
        if key in self.unsent:
            held, steps = self.unsent.pop(key)
            out, steps = merge_outputs(held, out), steps + 1
        else:
            steps = 1
        if out.start == 0 or out.finish_reason is not None or steps >= self.settings.stream_interval:
            return out
        self.unsent[key] = (out, steps)
        return None

    def _take_unsent(self, uid: str, index: int | None = None) -> list[StepOutput]:
        """Remove and return the request's (or one choice's) tokens not published yet."""
        keys = [k for k in self.unsent if k[0] == uid and index in (None, k[1])]
        return [self.unsent.pop(k)[0] for k in keys]

    def publish_unsent(self) -> None:
        """Queue every choice's tokens not published yet (a drain hands the requests back after this)."""
        items = [self.running[o.uid].delta(o) for o, _ in self.unsent.values() if o.uid in self.running]
        self.unsent.clear()
        if items:
            batch = DetokenizeBatch(self.id, self.steps, items)
            self.outbox.append(lambda pipe: self.publish(pipe, batch))

    def _fail(self, uid: str, error: str, status: int = 500, param: str | None = None) -> None:
        self._take_unsent(uid)
        run = self.running.pop(uid)
        self.engine.abort(uid)
        run.end_span("failed", error)
        if status < 500:  # the request's own fault (e.g. its grammar): a 400, one line
            log.info("uid=%s refused by the engine: %s", uid, error)
            reply = ReplyError(message=error, status=status, type="invalid_request_error", param=param,
                               code="invalid_constraint" if error.startswith("structured output") else None)
        else:
            log.error("uid=%s failed in the engine: %s", uid, error)
            reply = ReplyError(message=error)

        def write(pipe: Pipeline) -> None:
            records.end_failed(pipe, self.keys, uid, reply, self.ttl, self.maxlen)
            self.source.ack_in(pipe, [run.entry_id])

        self.outbox.append(write)

    async def flush(self) -> None:
        """Send every queued write in one pipeline; on failure they stay queued for the next try."""
        if not self.outbox:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for write in self.outbox:
                write(pipe)
            await pipe.execute()
        self.outbox.clear()

    async def start(self) -> None:
        tip = await self.redis.xrevrange(self.aborts_key, count=1)
        self.aborts_cursor = tip[0][0].decode() if tip else "0-0"  # older notifications: the sweep's job
        await self.lanes.start()  # the own stream (if it joins routing) exists before the heartbeat says we serve
        await super().start()

    async def close(self) -> None:
        self.engine.close()
        for run in self.running.values():
            run.end_span("handed_back")  # a peer resumes it under the same trace
        await super().close()


def poison_error(deliveries: int) -> ReplyError:
    return ReplyError(message=f"the request could not be served: every scheduler that took it ({deliveries}) "
                      "stopped while running it", code="request_dead_lettered")


def stop_span(stops: list[str]) -> int:
    """The most completion tokens one of these stop strings can span, and so the detokenizer's held-back text:
    its UTF-8 bytes, since every token decodes to at least one byte (byte-level BPE and byte-fallback
    vocabularies have a token for every byte, so no bound below the byte count holds for every way the model
    may spell it). Computed once per request."""
    return max((len(s.encode()) for s in stops), default=0)


def merge_outputs(a: StepOutput, b: StepOutput) -> StepOutput:
    """One choice's outputs of consecutive steps as one: b's tokens (and logprobs) after a's."""
    def joined(x: list | None, y: list | None) -> list | None:
        return None if x is None and y is None else (x or []) + (y or [])

    return dataclasses.replace(a, ids=a.ids + b.ids, finish_reason=b.finish_reason,
                               logprobs=joined(a.logprobs, b.logprobs), top_logprobs=joined(a.top_logprobs,
                                                                                            b.top_logprobs))


async def build_worker(settings: SchedulerSettings, model_path: str, model_name: str) -> SchedulerWorker:
    """Load the model and warm the engine up (kernels compiled, batch shapes run): all before the worker
    exists, so its heartbeat, which probes and the API read as "ready", appears only when it can serve."""
    engine = await asyncio.to_thread(build_engine, settings, model_path)
    return SchedulerWorker(settings, model_name, engine, model_path)


def run(settings: SchedulerSettings) -> int:
    return run_stage(settings, lambda model_path, model_name: build_worker(settings, model_path, model_name))
