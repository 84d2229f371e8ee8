"""What every stage worker shares: build, report ready, loop, drain, close in `finally` in reverse order.

A worker consumes one stream through one consumer group. Its loop survives Redis outages (backoff and
retry; groups are recreated when Redis comes back empty), claims entries a dead or hung peer left
pending, and trims entries every group member has acknowledged. On SIGTERM it stops taking new
entries, lets in-flight work finish within the grace period, and hands what is left back to the group
so a peer takes it at once.

Three classes, each with the loop it runs: `StageWorker` (the base: heartbeat, liveness, keep-alive, trims,
drain, close), `PullWorker` (reads when it has room, `iteration` until SIGTERM: the scheduler) and `PushWorker`
(FastStream delivers to `handle`; its loop only watches: the tokenizer and detokenizer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from redis.exceptions import OutOfMemoryError, RedisError, ResponseError

from shared import faststream_glue, heap
from shared.consumer_group import Delivery, GroupConsumer
from shared.heartbeats import Beating, Heartbeat, live_workers
from shared.keys import Keys
from shared.liveness import Liveness, liveness_path
from shared.redis_conn import broker, connect, is_cluster_client
from shared.settings import StageSettings
from shared.stage_metrics import WorkerMetrics
from shared.streams import Member
from shared.tasks import stop_task, unless_set
from shared.tracing import Tracer

log = logging.getLogger(__name__)
# FastStream's own messages in our log format; its per-message and task-callback chatter stays out.
FASTSTREAM_LOG = logging.getLogger("faststream.rsinfer")
FASTSTREAM_LOG.setLevel(logging.WARNING)
M = TypeVar("M")

TRIM_EVERY_S = 10.0
MAX_BACKOFF_S = 2.0
CLAIM_EVERY_S = 0.5  # claims are cheap; polling often is what makes a hand-back "at once"
HANDOFF_CONSUMER = "handoff"  # entries handed back on shutdown wait here, idle, for any peer to claim


class StageWorker(Generic[M]):
    """What every stage has: its consumer, heartbeat, liveness file, keep-alive of held entries, trims, drain and
    close. Its subclasses are the two ways a stage receives: `PullWorker` (the scheduler reads when it has room)
    and `PushWorker` (FastStream delivers to the tokenizer and detokenizer)."""

    role: str = ""
    group: str = ""
    message_type: type

    def __init__(self, settings: StageSettings, model_name: str):
        self.settings = settings
        self.keys = Keys(settings.namespace)
        self.id = settings.identity()
        self.model_name = model_name
        # Named after this worker on every connection: CLIENT LIST shows who is connected, and a process gone
        # has no connection left (PullWorker.claim_disconnected).
        self.redis = connect(settings.redis_url, client_name=self.id, **settings.redis_options())
        self.source = GroupConsumer[M](self.redis, self.keys.stage_stream(self.role, model_name),
                                       Member(self.group, self.id), self.message_type, self.keys.dead())
        beating = Beating(self.role, self.id, model_name, settings.heartbeat_interval_s, settings.heartbeat_ttl_s)
        self.heartbeat = Heartbeat(self.redis, self.keys, beating, self.load, card=lambda: self.model_info)
        self.tracer = Tracer(self.role, settings.otlp_endpoint)
        self.metrics = WorkerMetrics(self.role, settings.metrics_port)
        self.ttl, self.maxlen = settings.request_ttl_s, settings.reply_maxlen
        self.stopping = asyncio.Event()
        self.forced = asyncio.Event()
        self.steps = 0
        self.liveness = Liveness(liveness_path(settings.liveness_file, settings.namespace, self.role, settings.name()),
                                 self.role, self.id)
        self.last_step_at = time.time()
        self._last: dict[str, float] = {}
        self._keep_alive: asyncio.Task | None = None
        # in the heartbeat and the model's declaration: `root` (checkpoint) and `max_model_len`, for /v1/models
        self.model_info: dict = {}

    @property
    def last_step_at(self) -> float:
        """When the loop last moved (busy or idle): in the heartbeat, and the liveness file is touched with it."""
        return self._last_step_at

    @last_step_at.setter
    def last_step_at(self, value: float) -> None:
        self._last_step_at = value
        self.liveness.moved()

    def loop_alive(self) -> None:
        """The loop is not stuck: it stepped, or it is waiting out an unreachable or full Redis (liveness must
        not depend on Redis)."""
        self.last_step_at = time.time()

    # -- hooks for subclasses -------------------------------------------------------------------------
    async def loop(self) -> None:
        """Until SIGTERM: what this worker does (its subclasses' loops)."""
        raise NotImplementedError

    def load(self) -> dict:
        return {"steps": self.steps, "last_step_at": round(self.last_step_at, 3), "model_info": self.model_info}

    def held_entries(self) -> list[str]:
        """Entries this worker holds on purpose across iterations (kept alive against claims)."""
        return []

    def lost(self, refs: list[str]) -> None:
        """Held entries a peer claimed while this worker was stalled (`keep_alive` found them). Default: nothing
        to do (whoever finishes second is dropped as a duplicate)."""

    async def finish_in_flight(self, deadline: float) -> None:
        """On shutdown, until `deadline` (time.monotonic()): finish what can be finished. Default: nothing
        is held across iterations, so nothing to finish."""

    # -- the shape every worker has -------------------------------------------------------------------
    async def start(self) -> None:
        self.metrics.serve()
        await self.source.ensure_group()
        await self.heartbeat.beat()
        self.heartbeat.start()
        self._keep_alive = asyncio.create_task(self.keep_alive(), name=f"keep-alive-{self.role}")
        self.liveness.arm()
        log.info("%s ready: model=%s stream=%s", self.role, self.model_name, self.source.key)

    async def keep_alive(self) -> None:
        """Every claim_idle_ms / 3, in its own task (so however long a step runs in its thread): reset the idle
        time of the entries this worker holds on purpose, and report those a peer took while we were stalled
        (`lost`)."""
        while True:
            await asyncio.sleep(self.settings.claim_idle_ms / 3000)
            try:
                self.lost(await self.source.touch(self.held_entries()))
            except (RedisError, OSError) as e:
                log.warning("keep-alive failed: %s", e)
            except Exception:  # a dead keep-alive would let peers take live requests: never let it die
                log.exception("keep-alive failed")

    async def retrying(self, step: Callable[[], Awaitable[None]], until: asyncio.Event) -> None:
        """Run `step` until `until` is set; a Redis outage means backoff and retry, never exit."""
        backoff = 0.1
        while not until.is_set():
            try:
                await step()
                backoff = 0.1
            except (RedisError, OSError) as e:
                log.warning("redis unavailable (%s); retrying in %.1fs", e, backoff)
                self.loop_alive()
                await asyncio.sleep(backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)

    def due(self, what: str, every_s: float) -> bool:
        now = time.monotonic()
        if now - self._last.get(what, 0.0) < every_s:
            return False
        self._last[what] = now
        return True

    async def housekeeping(self) -> None:
        if self.due("trim", TRIM_EVERY_S):
            await self.source.trim_acknowledged()
            ttl = self.settings.heartbeat_ttl_s
            alive = {w.id for w in await live_workers(self.redis, self.keys, ttl) if w.role == self.role}
            gone = await self.source.remove_departed(alive | {self.id}, idle_ms=int(2000 * ttl))
            if gone:
                log.info("removed consumers of processes that are gone: %s", ", ".join(gone))

    async def drain(self) -> None:
        """After SIGTERM: finish in-flight work within the grace period, then hand back the rest.
        The deadline is checked between steps, never by cancelling one: a step runs in a thread that a
        cancellation would not stop."""
        await self.finish_in_flight(time.monotonic() + self.settings.grace_period_s)
        with contextlib.suppress(RedisError, OSError):
            left = await self.source.pending_ids()
            await self.source.hand_back(left, HANDOFF_CONSUMER)
            if left:
                log.info("handed %d entries back to the group", len(left))

    async def close(self) -> None:
        await self.stop_beating()
        await self.disconnect()

    async def stop_beating(self) -> None:
        """The first half of `close`: no liveness file, keep-alive or heartbeat any more."""
        self.liveness.remove()
        if self._keep_alive is not None:
            await stop_task(self._keep_alive)
            self._keep_alive = None
        await self.heartbeat.stop()

    async def disconnect(self) -> None:
        """The second half of `close`: Redis and the tracer."""
        await self.redis.aclose()
        self.tracer.shutdown()

    def request_stop(self) -> None:
        if self.stopping.is_set():
            self.forced.set()
        self.stopping.set()


class PullWorker(StageWorker[M]):
    """A stage that reads when it has room (the scheduler: `read_count` follows its engine's free slots) and
    holds entries across iterations (a request's entry until the request ends). Its loop runs `iteration` until
    SIGTERM; `receive` is its read: claims first when due (peers whose process is gone at once, then entries idle
    past --claim-idle-ms), else new entries of its streams (`adopt` updates those read beside the main one)."""

    def __init__(self, settings: StageSettings, model_name: str):
        super().__init__(settings, model_name)
        self.taken: set[str] = set()  # held entries a peer claimed from us (`lost`): the loop drops them
        self._disconnected: set[str] = set()  # consumers holding entries with no connection at the last look
        self._client_list_refused = False

    async def iteration(self) -> None:
        raise NotImplementedError

    def read_count(self) -> int:
        return self.settings.batch_size

    async def adopt(self) -> None:
        """Before each claim round: update the streams read beside the main one (`GroupConsumer` lanes).
        Default: none."""

    async def release(self) -> None:
        """On close, after the heartbeat is gone and before Redis is: end what this worker owns in Redis beyond
        its heartbeat. Default: nothing."""

    def lost(self, refs: list[str]) -> None:
        self.taken.update(refs)

    async def loop(self) -> None:
        await self.retrying(self.iteration, until=self.stopping)

    async def receive(self, block_ms: int | None = 1000) -> tuple[list[Delivery[M]], bool]:
        count = self.read_count()
        if count <= 0:
            return [], False
        if self.due("claim", min(CLAIM_EVERY_S, self.settings.claim_idle_ms / 2000)):
            await self.adopt()
            claimed = (await self.claim_disconnected(count)
                       or await self.source.claim(self.settings.claim_idle_ms, count))
            if claimed:
                log.info("claimed %d entries a dead, hung or departing peer left pending", len(claimed))
                return claimed, True
        return await self._read_unless_stopped(count, block_ms), False

    async def _read_unless_stopped(self, count: int, block_ms: int | None) -> list[Delivery[M]]:
        """The read, ended early by SIGTERM: an idle worker blocked in it would otherwise notice the signal only
        when the block runs out (a second for the scheduler). What Redis delivered to a read cut short stays
        pending to this consumer, which `drain` hands back."""
        if self.stopping.is_set():
            block_ms = None  # stopping: what is there, without waiting
        if not block_ms:  # a read that does not block (every engine step's): as it is
            return await self.source.read(count, block_ms)
        return await unless_set(self.source.read(count, block_ms), self.stopping, default=[])

    async def claim_disconnected(self, count: int) -> list[Delivery[M]]:
        """The entries of peers whose process is gone, long before their claim idle: its claim idle is the longest
        (a claim costs the scheduler a resume) and its requests the most, so a SIGKILLed peer's requests would
        otherwise all stall for it. Every connection of a worker is named after it; a process that died (SIGKILL,
        OOM, its node lost) has none left at once, while a frozen or busy one keeps its own. A consumer must be
        seen so in two looks in a row (a live peer reconnecting after a Redis restart is back within one).
        Standalone Redis only: a cluster client's connections are spread over nodes; and not where CLIENT LIST is
        refused (ACLs)."""
        if self._client_list_refused or is_cluster_client(self.redis):
            return []
        others = await self.source.holders() - {self.id}
        if not others:  # nobody else holds anything: no need to list the connections
            self._disconnected = set()
            return []
        try:
            connected = {c.get("name", "") for c in await self.redis.client_list()}
        except ResponseError as e:
            log.warning("CLIENT LIST refused (%s): dead peers' entries wait for --claim-idle-ms", e)
            self._client_list_refused = True
            return []
        gone = others - connected
        confirmed, self._disconnected = gone & self._disconnected, gone
        if not confirmed:
            return []
        claimed = await self.source.claim_from(sorted(confirmed), int(CLAIM_EVERY_S * 1000), count)
        if claimed:
            log.info("claimed %d entries of %s, whose process is gone (no connection left)", len(claimed),
                     ", ".join(sorted(confirmed)))
        return claimed

    async def close(self) -> None:
        await self.stop_beating()
        with contextlib.suppress(RedisError, OSError):
            await self.release()
        await self.disconnect()


class PushWorker(StageWorker[M]):
    """A stage whose entries FastStream delivers (shared/faststream_glue.py `subscribe`): a batch reader of new
    entries and a claimer of a dead or hung peer's, both handing decoded deliveries to `handle`, which
    acknowledges in the pipeline that writes its output. Undecodable entries go to the dead-letter stream at
    once; an entry delivered more than --max-deliveries times without being handled (its handling keeps
    failing) goes there too. The loop only watches: housekeeping, liveness, and restarting a subscriber that
    stopped because its group vanished (Redis came back empty)."""

    def __init__(self, settings: StageSettings, model_name: str):
        super().__init__(settings, model_name)
        self.broker = broker(settings.redis_url, graceful_timeout=max(0.1, settings.grace_period_s),
                             logger=FASTSTREAM_LOG, log_level=logging.DEBUG, apply_types=False,
                             middlewares=self.metrics.faststream_middlewares(), **settings.redis_options())
        what = faststream_glue.Subscription(self.source.key, self.source.member, settings.batch_size,
                                            settings.claim_idle_ms)
        self.subscribers = faststream_glue.subscribe(self.broker, what, self._deliver,
                                                     title=f"{self.role}:{model_name}", description=self.__doc__ or "")
        self.busy_since: float | None = None
        self.held_while_full: list[str] = []  # a batch whose output a full Redis refuses, retried in place
        self.handling: set[str] = set()  # entries being handled now (kept alive: `held_entries`)

    async def handle(self, batch: list[Delivery[M]], claimed: bool) -> None:
        """Do the work of a batch and acknowledge it in the pipeline that writes its output."""
        raise NotImplementedError

    def loop_alive(self) -> None:
        if self.busy_since is None or time.time() - self.busy_since < 1.0:  # else a handler is stuck
            super().loop_alive()

    def held_entries(self) -> list[str]:
        # Touched while they are handled, however long that takes: else after --claim-idle-ms a peer (or this
        # worker's own claimer) takes an entry in the middle of its handling and does the same work again.
        return list(self.handling)

    async def start(self) -> None:
        await super().start()
        await self.broker.start()

    async def loop(self) -> None:
        await self.retrying(self.watch, until=self.stopping)

    async def watch(self) -> None:
        """Once a second: the loop moved unless a handler is stuck; restart stopped subscribers; trim."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), 1.0)
        self.loop_alive()
        if any(not sub.running for sub in self.subscribers):
            log.warning("a subscriber of %s stopped (its group vanished); recreating it", self.source.key)
            await self.source.ensure_group()
            for sub in self.subscribers:
                if not sub.running:
                    await sub.start()
        await self.housekeeping()

    async def _deliver(self, entries: list[tuple[str, dict[bytes, bytes]]], claimed: bool) -> None:
        if claimed:
            log.info("claimed %s, which a dead, hung or departing peer left pending", entries[0][0])
            entries = await self._within_delivery_limit(entries)
        batch = await self.source.decode_all(entries)
        if not batch:
            return
        self.busy_since = time.time()
        ids = {d.entry_id for d in batch}
        self.handling |= ids
        try:
            await self._handle_riding_out_full_redis(batch, claimed)
            self.steps += 1
        except Exception:
            log.exception("handling %d entries failed; they stay pending for a retry", len(batch))
        finally:
            self.handling -= ids
            self.busy_since = None
            self.last_step_at = time.time()

    async def _handle_riding_out_full_redis(self, batch: list[Delivery[M]], claimed: bool) -> None:
        """`handle`, again and again while Redis refuses its writes for memory (OOM: maxmemory, noeviction). That
        is backpressure, not a bad entry: left to the claimer, each retry would count toward the dead-letter limit
        and the batch would be lost after a few seconds of a full Redis. Its acknowledgement was refused with its
        writes (shared/streams.py `ack`), so the entries stay pending; they are kept alive meanwhile (keep_alive)
        so that no peer claims them, and the subscriber reads nothing new until Redis has room."""
        backoff = 0.1
        try:
            while True:
                try:
                    await self.handle(batch, claimed)
                    return
                except OutOfMemoryError as e:
                    if self.stopping.is_set():
                        raise  # shutting down: they stay pending, and the drain hands them back
                    if not self.held_while_full:
                        log.warning("redis is full (%s): holding %d entries until it takes their output", e,
                                    len(batch))
                    self.held_while_full = [d.entry_id for d in batch]
                    self.busy_since = time.time()  # waiting on Redis, not stuck (liveness)
                    await asyncio.sleep(backoff)
                    backoff = min(MAX_BACKOFF_S, backoff * 2)
        finally:
            self.held_while_full = []

    async def _within_delivery_limit(self, entries: list[tuple[str, dict[bytes, bytes]]]
                                     ) -> list[tuple[str, dict[bytes, bytes]]]:
        limit = self.settings.max_deliveries
        counts = await self.source.delivery_counts([eid for eid, _ in entries])
        bad = [(eid, f, f"delivered {counts[eid]} times without being handled")
               for eid, f in entries if counts.get(eid, 0) > limit]
        if bad:
            await self.source.dead_letter(bad)
            await self.answer_dead([d.msg for d in await self.source.decode_all([(e, f) for e, f, _ in bad])])
        return [(eid, f) for eid, f in entries if counts.get(eid, 0) <= limit]

    async def answer_dead(self, messages: list[M]) -> None:
        """The clients of entries just dead-lettered, which would otherwise wait until their deadline. Default:
        none (an entry may carry many requests' work)."""

    async def drain(self) -> None:
        """Stop reading (FastStream lets handlers in flight finish within the grace period), then hand back
        what this consumer still holds."""
        await self.broker.stop()
        await super().drain()

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.broker.stop()
        await super().close()


def run_stage(settings: StageSettings, build: Callable[[str, str], Awaitable[StageWorker]]) -> int:
    """Entry point of a stage process: resolve the model, then serve the worker `build` makes."""
    from shared.models import resolve_model

    model_path, model_name = resolve_model(settings)
    asyncio.run(serve(lambda: build(model_path, model_name)))
    return 0


async def serve(build: Callable[[], Awaitable[StageWorker]]) -> None:
    """Build a worker, report it ready, run its loop until SIGTERM/SIGINT, drain it, then close it.
    A second signal cuts the drain short."""
    worker = await build()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.request_stop)
    try:
        await worker.start()
        heap.freeze_startup(worker.role)
        await worker.loop()
        await worker.drain()
    finally:
        with contextlib.suppress(Exception):
            await worker.close()
        log.info("%s stopped", worker.role)
