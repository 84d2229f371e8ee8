"""The API process's state and how one request is answered, streamed or not.

Every request it opens is closed in `finally` (non-stream) or when its response ends for any reason
(stream: services/api/sse.py `SSEResponse`), so client disconnects, deadlines and errors all release the
request's state here and abort it in every stage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import orjson
from fastapi import Request

from services.api.errors import ApiError, redis_down
from services.api.fanout import FlightGroup
from services.api.flow import DeadlineExceeded, StageFailed
from services.api.formats import Format, usage
from services.api.gateway import Gateway, Inflight
from services.api.metrics import Metrics
from services.api.registry import StageRegistry
from services.api.replies import HubError, ReplyHub
from services.api.sse import SSEResponse, sse_event
from shared import streams
from shared.keys import Keys
from shared.messages import ReplyEvent, TokenizeJob
from shared.redis_conn import connect
from shared.registry import Heartbeat
from shared.settings import ApiSettings
from shared.tracing import Tracer

log = logging.getLogger(__name__)

Replies = AsyncIterator[list[tuple[str, ReplyEvent]]]
ChunkSource = Callable[[list[tuple[str, ReplyEvent]], Replies], AsyncIterator[bytes]]


DONE = sse_event(b"[DONE]")


def stage_error(e: StageFailed) -> ApiError:
    err = e.error
    return ApiError(err.status, err.message, type=err.type, param=err.param, code=err.code)


def timeout_error() -> ApiError:
    return ApiError(504, "the request did not finish before its deadline", code="request_timeout")


ENDED_EARLY = (StageFailed, DeadlineExceeded, HubError)


def ended_early(flight: Inflight, e: Exception) -> ApiError:
    """The HTTP error for a reply that ended before it finished; notes on the flight why it ended."""
    if isinstance(e, StageFailed):
        # A stage's deadline error is the same end as our own deadline; other errors the stage already ended.
        timed_out = e.error.code == "request_timeout"
        flight.end_reason = "timeout" if timed_out else "rejected" if 400 <= e.error.status < 500 else "failed"
        return stage_error(e)
    if isinstance(e, DeadlineExceeded):
        flight.end_reason = "timeout"
        return timeout_error()
    flight.end_reason = "broker_unavailable"
    return redis_down()


async def until_disconnect(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Run `work` unless the client goes away first: (True, result) or (False, None)."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        gone = not task.done()
        if gone:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return (False, None) if gone else (True, task.result())


class ApiService:
    def __init__(self, settings: ApiSettings):
        self.settings = settings
        self.pod = settings.identity()
        self.keys = Keys(settings.namespace)
        self.redis = connect(settings.redis_url, max_connections=64, **settings.redis_options())
        self.hub = ReplyHub(settings.redis_url, settings.redis_options(), self.redis, self.keys, self.pod,
                            settings.reply_shard_keys, outage_s=settings.broker_outage_s)
        self.gateway = Gateway(settings, self.redis, self.hub, self.keys, self.pod)
        self.stages = StageRegistry(self.redis, self.keys, settings.heartbeat_ttl_s, settings.model_names())
        self.metrics = Metrics(self.stages)
        self.tracer = Tracer("api", settings.otlp_endpoint)
        self.heartbeat = Heartbeat(self.redis, self.keys, "api", self.pod, "", settings.heartbeat_interval_s,
                                   settings.heartbeat_ttl_s, self.load)
        self.draining = False
        self.closing = asyncio.Event()  # set once open streams must end (shutdown after the grace period)

    def load(self) -> dict:
        return {"inflight": len(self.gateway.inflight), "subscriptions": self.hub.subscriptions,
                "draining": self.draining}

    async def start(self) -> None:
        await self.stages.refresh()
        self.stages.start()
        self.heartbeat.start()
        log.info("api ready: pod=%s redis_ok=%s models=%s", self.pod, self.stages.snapshot.redis_ok,
                 sorted(self.stages.snapshot.models))

    async def close(self) -> None:
        for flight in list(self.gateway.inflight.values()):
            flight.end_reason = "server_shutdown"
            await flight.close()
        await self.gateway.close()
        await self.heartbeat.stop()
        await self.stages.stop()
        await self.hub.close()
        await self.redis.aclose()
        self.tracer.shutdown()

    def new_job(self, model: str, timeout: float | None, background: bool | None, **fields: Any) -> TokenizeJob:
        return TokenizeJob(uid=self.hub.new_uid(), model=model, pod=self.pod, created_at=time.time(),
                           deadline=self.gateway.deadline(timeout), background=bool(background), **fields)

    # -- admission --------------------------------------------------------------------------------------
    async def admit(self, model: str) -> None:
        """Refuse what cannot be taken now; a known model with no worker in some stage is accepted: its
        request waits in the model's streams, within its deadline, for workers (scale from zero)."""
        if self.draining:
            raise ApiError(503, "this server is shutting down; retry on another", retry_after=1)
        snap = self.stages.snapshot
        if model not in snap.models and time.time() - snap.at > 0.25:
            snap = await self.stages.refresh()  # it may have been declared since the last refresh
        if not snap.redis_ok:
            raise redis_down()
        if model not in snap.models:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        if snap.queued(model) >= self.settings.max_queued and time.time() - snap.at > 0.25:
            snap = await self.stages.refresh()  # don't turn work away on a stale backlog figure
        if snap.queued(model) >= self.settings.max_queued:
            raise ApiError(429, f"model `{model}` has {snap.queued(model)} requests queued; retry shortly",
                           code="overloaded", retry_after=1)

    # -- answering --------------------------------------------------------------------------------------
    async def open(self, job: TokenizeJob, record: dict, stream: bool) -> Inflight:
        """Submit a request; the caller must end it with `finish`. Its trace (if tracing) starts here."""
        span = self.tracer.start("request", root=True, uid=job.uid, model=job.model, kind=record.get("kind", ""),
                                 stream=stream)
        if span.traceparent:
            job = msgspec.structs.replace(job, trace=span.traceparent)
        try:
            flight = await self.gateway.open(job, record, stream)
        except BaseException as e:
            span.end(error=repr(e))
            raise
        flight.span = span
        self.metrics.inflight.labels(job.model).inc()
        return flight

    async def respond(self, request: Request, job: TokenizeJob, fmt: Format, stream: bool, kind: str,
                      annotations: dict[str, str]):
        record = {"kind": kind, "n": job.params.n, "rid": fmt.rid, "created": fmt.created,
                  "include_usage": int(fmt.include_usage), "logprobs": int(fmt.want_logprobs), **annotations}
        flight = await self.open(job, record, stream)
        if stream:
            return await self.start_stream(request, flight, lambda first, rest: self.stream_chunks(
                flight, fmt, job.model, first, rest), lambda reason: self.finish(flight, job.model, "stream", reason))
        try:
            connected, result = await until_disconnect(request, self.collect(flight, fmt, job.model))
            return result if connected else None
        finally:
            await self.finish(flight, job.model, "full")

    async def respond_many(self, request: Request, jobs: list[TokenizeJob], fmt: Format, stream: bool, kind: str,
                           annotations: dict[str, str]):
        """Several requests answered as one response (a completion with a list of prompts): their choices
        follow each other, `per` by `per`."""
        per = jobs[0].params.n
        record = {"kind": kind, "n": per, "rid": fmt.rid, "created": fmt.created,
                  "include_usage": int(fmt.include_usage), "logprobs": int(fmt.want_logprobs), **annotations}
        flights: list[Inflight] = []
        try:
            for job in jobs:
                flights.append(await self.open(job, record, stream))
        except BaseException:
            for f in flights:
                await self.finish(f, jobs[0].model, "full", "rejected")
            raise
        group, model = FlightGroup(flights, per), jobs[0].model

        async def finish_all(reason: str | None = None) -> None:
            for f in flights:
                await self.finish(f, model, "stream" if stream else "full", reason)

        if stream:
            return await self.start_stream(request, group, lambda first, rest: self.stream_chunks(  # type: ignore
                group, fmt, model, first, rest), finish_all)  # type: ignore[arg-type]
        try:
            connected, result = await until_disconnect(request, self.collect(group, fmt, model))  # type: ignore
            return result if connected else None
        finally:
            await finish_all()

    async def start_stream(self, request: Request, flight: Inflight, chunks: ChunkSource,
                           on_close: Callable[[str | None], Awaitable[None]]) -> SSEResponse | None:
        """Hold the response back until the first reply entries arrive (or `sse_ping_s` passes without any),
        so that an error known before generation gets its HTTP status rather than a 200 and an error event.
        The stream then starts with those entries at once: waiting costs the first token nothing."""
        replies = flight.entries(idle_s=self.settings.sse_ping_s)
        started = False
        try:
            connected, first = await until_disconnect(request, self._first_replies(flight, replies))
            if not connected:
                return None
            started = True
            return SSEResponse(chunks(first, replies), on_close, self.settings.sse_ping_s,
                               self.settings.slow_client_timeout_s, self.closing)
        finally:
            if not started:
                await on_close(None)

    async def _first_replies(self, flight: Inflight, replies: Replies) -> list[tuple[str, ReplyEvent]]:
        try:
            return await anext(replies, [])
        except ENDED_EARLY as e:
            raise ended_early(flight, e) from None

    async def collect(self, flight: Inflight, fmt: Format, model: str) -> dict:
        try:
            async for _, events in flight.events():
                self._first_token(flight, model)
                fmt.add(events)
        except ENDED_EARLY as e:
            raise ended_early(flight, e) from None
        return fmt.response(flight.order.prompt_tokens, flight.order.completion_tokens, flight.order.cached_tokens)

    async def stream_chunks(self, flight: Inflight, fmt: Format, model: str, first: list[tuple[str, ReplyEvent]],
                            rest: Replies, skip_until: str | None = None) -> AsyncIterator[bytes]:
        """SSE events for one request; entries up to `skip_until` (Last-Event-ID) are not sent again."""
        try:
            async for pairs in chain_replies(first, rest):
                if not pairs:
                    continue  # nothing arrived for a while (pings keep the connection)
                self._first_token(flight, model)
                if skip_until:  # replay what the client already has into the formatter, unsent
                    fmt.chunks([ev for eid, ev in pairs if not streams.id_after(eid, skip_until)])
                    pairs = [(eid, ev) for eid, ev in pairs if streams.id_after(eid, skip_until)]
                if not pairs:
                    continue
                last_id = pairs[-1][0]
                order = flight.order
                for chunk in fmt.chunks([ev for _, ev in pairs]):
                    if fmt.continuous_usage:  # vLLM's stream_options.continuous_usage_stats
                        chunk["usage"] = usage(order.prompt_tokens, order.completion_tokens, order.cached_tokens)
                    yield sse_event(orjson.dumps(chunk), last_id)
            if fmt.include_usage:
                order = flight.order
                yield sse_event(orjson.dumps(fmt.usage_chunk(order.prompt_tokens, order.completion_tokens,
                                                             order.cached_tokens)))
        except ENDED_EARLY as e:
            yield sse_event(orjson.dumps(ended_early(flight, e).body()))
        yield DONE

    def _first_token(self, flight: Inflight, model: str) -> None:
        if flight.first_token_at is None:
            flight.first_token_at = time.monotonic()
            flight.span.event("first_token")
            self.metrics.ttft.labels(model).observe(flight.first_token_at - flight.started)

    async def finish(self, flight: Inflight, model: str, endpoint: str, reason: str | None = None) -> None:
        if flight.closed:
            return
        if reason:
            flight.end_reason = reason
        await flight.close()
        if not flight.owner:
            return
        status = "ok" if flight.done else flight.end_reason
        flight.span.set(status=status, completion_tokens=flight.order.completion_tokens)
        flight.span.end(error=None if flight.done else status)  # after the last byte was sent
        self.metrics.inflight.labels(model).dec()
        self.metrics.requests.labels(model, endpoint, status).inc()
        self.metrics.duration.labels(model).observe(time.monotonic() - flight.started)
        self.metrics.prompt_tokens.labels(model).inc(flight.order.prompt_tokens)
        self.metrics.generated_tokens.labels(model).inc(flight.order.completion_tokens)


async def chain_replies(first: list[tuple[str, ReplyEvent]], rest: Replies) -> Replies:
    yield first
    async for pairs in rest:
        yield pairs
