"""Tokenizer worker: consumer group `tokenizer` on rsinfer:tokenize:<model> -> rsinfer:schedule:<model>.

Each read is one batch (`_encode`, on one screen): skip aborted and expired jobs, encode the rest together, decide
what each becomes (services/tokenizer/outcomes.py: effects as data, no Redis), then one pipeline writes them
(services/tokenizer/outbox.py, the one writer): the request records and error replies, then the schedule entries,
and the acknowledgement of the whole read. With `--prefix-routing` a job whose prompt pages a scheduler caches goes
to that scheduler's own stream instead (services/tokenizer/router.py: one more round trip per batch).

With fair queueing (`--fair-queueing`, or unset and the job has a tenant) a tokenized job is held instead (its
entry pending, kept alive), or parked in Redis past the hold's cap, and released to the schedule stream in tenants'
turns while that stream's backlog is below --fair-watermark (services/tokenizer/holding.py, the decisions in
services/tokenizer/fair.py): released, it is sent and acknowledged in one pipeline. Every job that ends here
leaves the model's queue count (shared/queued.py).

A read's `/tokenize` and `/detokenize` queries (TokenizerQuery) are answered here, on their reply streams, in one
pipeline with their records: they never reach a scheduler, so they are answered while the schedulers are scaled
to zero (services/tokenizer/queries.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from redis.exceptions import RedisError

from services.tokenizer import outcomes, queries
from services.tokenizer.encode import PromptEncoder
from services.tokenizer.fair import Plan
from services.tokenizer.holding import FairHold
from services.tokenizer.outbox import Ack, EndFailed, Outbox, Tokenized
from services.tokenizer.router import Policy, Router
from shared.consumer_group import Delivery
from shared.grammars import checked
from shared.keys import TOKENIZER_GROUP
from shared.messages import ReplyError, ScheduleJob, TokenizeJob, TokenizerAnswer, TokenizerQuery
from shared.models import context_length, default_max_tokens, load_tokenizer, transformers_without_torch
from shared.request_store import RequestStore
from shared.settings import TokenizerSettings
from shared.worker import PushWorker, run_stage

log = logging.getLogger(__name__)

# A job with this much text (characters of prompt and messages), or a constraint not checked yet, is encoded
# apart from the others, in a thread of its own, one at a time: a 64 KiB prompt takes ~0.1 s with the demo
# model's tokenizer, a 4 MiB one seconds, and a read's small jobs must not wait for it.
HEAVY_JOB_CHARS = 32 * 1024
HEAVY_IN_FLIGHT = 8  # heavy jobs held at once; past it, reading waits (their text is in memory)
Entry = TokenizeJob | TokenizerQuery  # what the tokenize stream carries


class TokenizerWorker(PushWorker[Entry]):
    role = "tokenizer"
    group = TOKENIZER_GROUP
    message_type = Entry

    def __init__(self, settings: TokenizerSettings, model_path: str, model_name: str):
        super().__init__(settings, model_name)
        self.encoder = PromptEncoder(load_tokenizer(model_path, settings.trust_remote_code),
                                     context_length(model_path, settings.trust_remote_code),
                                     settings.tool_call_parser, settings.reasoning_parser,
                                     default_max_tokens(model_path, settings.default_max_tokens))
        self.requests = RequestStore(self.redis, self.keys, self.ttl, self.maxlen)
        # max_token_bytes: the most bytes of text one token stands for, so the API bounds a prompt by the context
        # before it stores anything of it (services/api/responses_api/responses.py)
        self.model_info = {"root": model_path, "max_model_len": self.encoder.max_context, **self.encoder.parsers,
                           "max_token_bytes": self.encoder.max_prompt_bytes // self.encoder.max_context}
        if self.encoder.default_max_tokens:  # what the API reserves for a request without max_tokens
            self.model_info["default_max_tokens"] = self.encoder.default_max_tokens
        self.router = Router(self.redis, self.keys, model_name, heartbeat_ttl_s=settings.heartbeat_ttl_s,
                             policy=Policy(settings.prefix_routing_load_tokens, settings.prefix_routing_max_skew),
                             tokenizer_id=self.id) if settings.prefix_routing else None
        if self.router is not None:  # its flag, with every beat, is what makes the model's schedulers join
            self.heartbeat.extra = self.router.on_beat
        self._heavy_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize-heavy")
        self._heavy: dict[asyncio.Task, str] = {}  # heavy jobs being encoded apart -> their entry
        self._heavy_room = asyncio.Semaphore(HEAVY_IN_FLIGHT)
        self.outbox = Outbox(self.requests, self.source, model_name)  # what writes, acknowledges and ends
        self.fair = None if settings.fair_queueing is False else FairHold(settings, self.requests, self.outbox, self)
        self._releaser: asyncio.Task | None = None

    # -- the loop: a read of one kind, decided (services/tokenizer/outcomes.py), written and acknowledged in one
    # pipeline (services/tokenizer/outbox.py) --------------------------------------------------------------------
    async def handle(self, batch: list[Delivery[Entry]], claimed: bool) -> None:
        """Small jobs are encoded together; each heavy one (much text, a new grammar) apart, in the background,
        so that the read's other jobs, and the reads after it, do not wait for it."""
        light = []
        for d in batch:
            if not self.heavy(d.msg):
                light.append(d)
                continue
            await self._heavy_room.acquire()
            task = asyncio.create_task(self._encode_apart(d, claimed), name=f"tokenize-{d.msg.uid}")
            self._heavy[task] = d.entry_id
        if light:
            await self._process(light, claimed)

    async def _process(self, batch: list[Delivery[Entry]], claimed: bool, thread: ThreadPoolExecutor | None = None
                       ) -> None:
        """Queries are answered, jobs encoded and forwarded: each kind in a pipeline of its own."""
        asked = [d for d in batch if isinstance(d.msg, TokenizerQuery)]
        jobs = [d for d in batch if not isinstance(d.msg, TokenizerQuery)]
        if asked:
            await self._answer(asked, claimed, thread)  # type: ignore[arg-type]
        if jobs:
            await self._encode(jobs, claimed, thread)  # type: ignore[arg-type]

    async def _encode(self, batch: list[Delivery[TokenizeJob]], claimed: bool,
                      thread: ThreadPoolExecutor | None = None) -> None:
        """Jobs: skip the aborted and expired, encode the rest together, then hold, park or route what goes on
        (fair queueing, prefix routing), and write and acknowledge it all in one pipeline."""
        if claimed:  # a dead peer may have forwarded some before it could acknowledge them
            batch = await self._undone(batch, outcomes.forwarded)
        jobs = [d.msg for d in batch]
        uids = [j.uid for j in jobs]
        spans = [self.tracer.start("tokenize", j.trace, uid=j.uid, claimed=claimed) for j in jobs]
        encoded: dict[str, ScheduleJob | ReplyError] = {}
        try:
            aborted = await self.requests.abort_reasons(uids)
            now = time.time()
            todo = [j for j in jobs if j.uid not in aborted and j.deadline > now]
            results = await asyncio.get_running_loop().run_in_executor(thread, self.encoder.encode, todo)
            encoded = dict(zip((j.uid for j in todo), results, strict=True))
            going = outcomes.going_on(batch, encoded)
            plan = self.fair.plan(going) if self.fair is not None else Plan(send=going)
            routes = await self.schedulers_for([h.job for h in plan.send])  # held: routed when released
            effects = outcomes.read(batch, encoded, aborted, plan, routes)
            self.metrics.published("schedule", outcomes.count(effects, Tokenized))
            self.metrics.published("reply", outcomes.count(effects, EndFailed))
            await self.outbox.send(effects)
            if self.fair is not None:
                await self.fair.placed(plan)
        finally:
            end_spans(spans, [encoded.get(job.uid) for job in jobs])

    async def _answer(self, batch: list[Delivery[TokenizerQuery]], claimed: bool,
                      thread: ThreadPoolExecutor | None = None) -> None:
        """Answer /tokenize and /detokenize queries on their reply streams, skipping aborted and expired ones."""
        if claimed:  # a dead peer may have answered some before it could acknowledge them
            batch = await self._undone(batch, outcomes.answered)
        asked = [d.msg for d in batch]
        spans = [self.tracer.start("tokenize_query", q.trace, uid=q.uid, op=q.op) for q in asked]
        answers: dict[str, TokenizerAnswer | ReplyError] = {}
        try:
            aborted = await self.requests.abort_reasons(q.uid for q in asked)
            now = time.time()
            todo = [q for q in asked if q.uid not in aborted and q.deadline > now]
            results = await asyncio.get_running_loop().run_in_executor(
                thread, lambda: [queries.answer(self.encoder, q) for q in todo])
            answers = dict(zip((q.uid for q in todo), results, strict=True))
            self.metrics.published("reply", len(asked))
            await self.outbox.send(outcomes.answers(batch, answers, aborted))
        finally:
            end_spans(spans, [answers.get(q.uid) for q in asked])

    async def _undone(self, batch: list, done: Callable[[str | None], bool]) -> list:
        """Acknowledge the claimed entries whose record's status says they are `done`; the others."""
        statuses = await self.requests.field([d.msg.uid for d in batch], "status")
        acked = outcomes.settled([(d.entry_id, d.msg.uid) for d in batch], statuses, done)
        await self.outbox.send([Ack(acked)])
        return [d for d in batch if d.entry_id not in acked]

    async def answer_dead(self, messages: list[Entry]) -> None:
        """A job whose handling failed every time it was delivered: its client gets the error now."""
        await self.outbox.send(outcomes.dead(messages))

    async def schedulers_for(self, jobs: list[ScheduleJob]) -> dict[str, str | None]:
        """uid -> the scheduler whose own stream the job goes to (None: the shared stream)."""
        if self.router is None or not jobs:
            return {}
        return dict(zip((j.uid for j in jobs), await self.router.route(jobs), strict=True))

    def schedule_streams(self) -> list[str]:
        """Every stream schedulers read this model's jobs from: the shared one and, routing, each one's own."""
        shared = self.keys.schedule(self.model_name)
        if self.router is None:
            return [shared]
        return [shared, *(self.keys.scheduler_stream(self.model_name, c.id) for c in self.router.candidates)]

    # -- heavy jobs, encoded apart ------------------------------------------------------------------------------
    def heavy(self, job: Entry) -> bool:
        if isinstance(job, TokenizerQuery):
            return queries.query_chars(job) > HEAVY_JOB_CHARS
        guided = job.params.guided
        return self.encoder.job_bytes(job) > HEAVY_JOB_CHARS or (guided is not None and not checked(guided))

    async def _encode_apart(self, d: Delivery[Entry], claimed: bool) -> None:
        try:
            await self._process([d], claimed, self._heavy_thread)
        except (RedisError, OSError) as e:  # left pending: claimed and done again once Redis is back
            log.warning("uid=%s: could not write its tokenization (%s)", d.msg.uid, e)
        except Exception:
            log.exception("uid=%s: tokenizing failed; it stays pending for a retry", d.msg.uid)
        finally:
            self._heavy.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
            self._heavy_room.release()

    # -- start, watch, drain, close ----------------------------------------------------------------------------
    def load(self) -> dict:
        out = super().load()
        if self.fair is not None:  # jobs fair queueing holds, per tenant
            out = {**out, **self.fair.load()}
        if self.router is None:
            return out
        return {**out, "routing_to": len(self.router.candidates)}  # schedulers it routes among

    async def start(self) -> None:
        await super().start()
        if self.router is not None:
            await self.router.refresh()
        if self.fair is not None:
            self._releaser = asyncio.create_task(self.fair.run(self.stopping), name="fair-release")

    async def watch(self) -> None:
        await super().watch()
        if self.router is not None:  # once a second: the live schedulers and their load, from their heartbeats
            await self.router.refresh()

    def held_entries(self) -> list[str]:
        held = self.fair.entries() if self.fair is not None else []
        return [*super().held_entries(), *self._heavy.values(), *held]

    def lost(self, refs: list[str]) -> None:
        if self.fair is not None:
            self.fair.lost(refs)

    async def finish_in_flight(self, deadline: float) -> None:
        """Shutdown: heavy jobs still encoding get until the deadline; what is left is handed back."""
        if self._heavy:
            await asyncio.wait(list(self._heavy), timeout=max(0.0, deadline - time.monotonic()))
        for task in list(self._heavy):
            task.cancel()

    async def close(self) -> None:
        if self._releaser is not None:
            self._releaser.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._releaser
        for task in list(self._heavy):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._heavy_thread.shutdown(wait=False, cancel_futures=True)
        await super().close()


def run(settings: TokenizerSettings) -> int:
    async def build(model_path: str, model_name: str) -> TokenizerWorker:
        transformers_without_torch()  # this stage never runs a model
        return TokenizerWorker(settings, model_path, model_name)

    return run_stage(settings, build)


def end_spans(spans: list, results: list) -> None:
    """Each job's span ends with its result (an error reply's message, if it is one)."""
    for span, result in zip(spans, results, strict=True):
        span.end(error=result.message if isinstance(result, ReplyError) else None)
