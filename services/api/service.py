"""The API process's state, and the one path every request's answer takes (`ApiService.answer`; a
reattaching client's, `ApiService.reattach`), each module entered once, in this order:

1. submit (services/api/gateway.py): the record, the tokenize job and the reply subscription in one round
   trip per job (`Gateway.open`), or a reattach to a request's reply stream (`Gateway.attach`);
2. ordered reply events (services/api/flow.py): OrderedReplies over the subscription, fences, the deadline,
   several requests merged into one response by services/api/fanout.py;
3. format (services/api/formats.py): events -> OpenAI chunk dicts, or the final response;
4. bytes (services/api/sse.py): SSE framing, the response start, keep-alives, the client leaving;
5. finish (`ApiService.finish`): close the flight (abort the request unless it finished), metrics, span.

Every request it opens is finished in `finally` (non-stream) or when its response ends for any reason
(stream: the `SSEResponse`), so client disconnects, deadlines and errors all release the request's state
here and abort it in every stage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from functools import partial
from typing import Any

import msgspec
import orjson
from fastapi import Request

from services.api.errors import ApiError, redis_down
from services.api.fanout import FlightGroup
from services.api.flow import ENDED_EARLY, ended_early
from services.api.formats import Format, format_of_record
from services.api.gateway import Gateway, Inflight
from services.api.limits import Limits
from services.api.metrics import Metrics
from services.api.registry import StageRegistry
from services.api.replies import ReplyHub
from services.api.schemas import Budget
from services.api.sse import DONE, SSEResponse, sse_event
from shared import streams
from shared.keys import Keys
from shared.messages import ReplyEvent, TokenizeJob
from shared.redis_conn import connect
from shared.registry import Heartbeat
from shared.settings import ApiSettings
from shared.tracing import Tracer

log = logging.getLogger(__name__)

Pairs = list[tuple[str, ReplyEvent]]
Replies = AsyncIterator[Pairs]
Flight = Inflight | FlightGroup


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
        self.limits = Limits(settings)
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
        self._shutting_down = False  # SIGTERM (services/api/main.py): out of service for good
        self._drained_until = 0.0  # a drain over the control socket (services/api/admin.py), until then
        self.closing = asyncio.Event()  # set once open streams must end (shutdown after the grace period)

    @property
    def draining(self) -> bool:
        """Out of service: `/ready` 503 and new requests 503 (open streams go on)."""
        return self._shutting_down or time.monotonic() < self._drained_until

    @draining.setter
    def draining(self, value: bool) -> None:
        self._shutting_down = value

    def drain_for(self, seconds: float) -> None:
        """Out of service for `seconds` (the preStop hook; SIGTERM normally follows within them), then back in
        service unless shutting down: a drain nobody followed up must not keep the pod unready for ever."""
        first = not self.draining
        self._drained_until = time.monotonic() + seconds
        log.info("drained for %.0fs (%d requests in flight)", seconds, len(self.gateway.inflight))
        if first:
            asyncio.get_running_loop().call_later(seconds + 0.05, self._drain_expired)

    def _drain_expired(self) -> None:
        if self._shutting_down:
            return
        if self.draining:  # drained again since: its own timer comes later
            asyncio.get_running_loop().call_later(self._drained_until - time.monotonic() + 0.05,
                                                  self._drain_expired)
            return
        log.warning("drain not followed by SIGTERM within its timeout: back in service")

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
    async def admit(self, model: str, budget: Budget) -> None:
        """Refuse what cannot be taken now; a known model with no worker in some stage is accepted: its
        request waits in the model's streams, within its deadline, for workers (scale from zero). Every job
        of the request (one per prompt) counts against --max-queued."""
        if self.draining:
            raise ApiError(503, "this server is shutting down; retry on another", retry_after=1)
        snap = self.stages.snapshot
        if model not in snap.models and time.time() - snap.at > 0.25:
            snap = await self.stages.refresh()  # it may have been declared since the last refresh
        if not snap.redis_ok:
            raise redis_down()
        if model not in snap.models:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        self.limits.fan_out(budget, snap.model_info(model).get("max_model_len"))
        jobs, most = budget.prompts, self.settings.max_queued
        if jobs > most:
            raise ApiError(400, f"{jobs} prompts are more than this server queues for a model: at most {most} "
                           "(--max-queued); send them in smaller requests", param="prompt", code="request_too_large")
        if snap.queued(model) + jobs > most and time.time() - snap.at > 0.25:
            snap = await self.stages.refresh()  # don't turn work away on a stale backlog figure
        if snap.queued(model) + jobs > most:
            raise ApiError(429, f"model `{model}` has {snap.queued(model)} requests queued and this one adds "
                           f"{jobs}; at most {most} (--max-queued): retry shortly", code="overloaded", retry_after=1)

    # -- one request's path: submit -> ordered replies -> format -> bytes -> finish ----------------------
    async def answer(self, request: Request, jobs: list[TokenizeJob], fmt: Format, stream: bool, kind: str,
                     annotations: dict[str, str] | None = None, endpoint: str | None = None):
        """Submit new requests and answer them as one response (several jobs: a completion with a list of
        prompts, whose choices follow each other). `endpoint` labels the metrics (default stream / full)."""
        flight = await self.submit(jobs, fmt, kind, annotations or {}, stream)
        return await self.deliver(request, flight, fmt, stream, endpoint or ("stream" if stream else "full"))

    async def reattach(self, request: Request, uid: str, record: dict, last_event_id: str | None):
        """Stream a request submitted by any API process, from its record: entries up to `last_event_id`
        go into the format unsent."""
        fmt = format_of_record(record, uid)
        flight = await self.gateway.attach(uid, record, last_event_id)
        return await self.deliver(request, flight, fmt, True, "reattach", skip_until=last_event_id)

    async def submit(self, jobs: list[TokenizeJob], fmt: Format, kind: str, annotations: dict[str, str],
                     stream: bool) -> Flight:
        """Step 1: open every job; if one cannot be opened, those already open are ended (`rejected`)."""
        record = {"kind": kind, "n": jobs[0].params.n, **fmt.record_fields(), **annotations}
        flights: list[Inflight] = []
        try:
            for job in jobs:
                flights.append(await self._open(job, record, stream))
        except BaseException:
            for f in flights:
                await self.finish(f, "full", "rejected")
            raise
        return flights[0] if len(flights) == 1 else FlightGroup(flights, jobs[0].params.n)

    async def _open(self, job: TokenizeJob, record: dict, stream: bool) -> Inflight:
        """Submit one job; its trace (if tracing) starts here."""
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

    async def deliver(self, request: Request, flight: Flight, fmt: Format, stream: bool, endpoint: str,
                      skip_until: str | None = None):
        """Steps 2 to 5: a JSON body once every choice finished, or an SSE stream; then finish."""
        fmt.counts = flight.order
        if stream:
            return await self.start_stream(request, flight, fmt, endpoint, skip_until)
        try:
            connected, body = await until_disconnect(request, self.full_body(flight, fmt))
            return body if connected else None
        finally:
            await self.finish(flight, endpoint)

    async def full_body(self, flight: Flight, fmt: Format) -> dict:
        """The whole answer, held here until it ends: bounded by --max-response-bytes, counted as its events
        (text and logprobs, as JSON) arrive, which is about the size of the body they make."""
        size, limit = 0, self.settings.max_response_bytes
        try:
            async for _, events in flight.events():
                self._first_token(flight, fmt)
                size += sum(len(msgspec.json.encode(ev)) for ev in events)
                if size > limit:
                    flight.end_reason = "response_too_large"
                    raise ApiError(400, f"the answer is over {limit} bytes (--max-response-bytes) and was "
                                   "stopped: stream it (`stream: true`) or ask for fewer tokens, choices or "
                                   "logprobs", param="max_tokens", code="response_too_large")
                fmt.add(events)
        except ENDED_EARLY as e:
            raise ended_early(flight, e) from None
        return fmt.response()

    async def start_stream(self, request: Request, flight: Flight, fmt: Format, endpoint: str,
                           skip_until: str | None) -> SSEResponse | None:
        """Hold the response back until the first reply entries arrive (or `sse_ping_s` passes without any),
        so that an error known before generation gets its HTTP status rather than a 200 and an error event.
        The stream then starts with those entries at once: waiting costs the first token nothing."""
        replies = flight.entries(idle_s=self.settings.sse_ping_s)
        started = False
        try:
            connected, first = await until_disconnect(request, first_replies(flight, replies))
            if not connected:
                return None
            started = True
            # The one call back up: the response is sent after this handler returned, so it finishes the
            # request itself, when its last byte is sent or it ends early (with the reason).
            return SSEResponse(self.sse_chunks(flight, fmt, first, replies, skip_until),
                               partial(self.finish, flight, endpoint), self.settings.sse_ping_s,
                               self.settings.slow_client_timeout_s, self.closing)
        finally:
            if not started:
                await self.finish(flight, endpoint)

    async def sse_chunks(self, flight: Flight, fmt: Format, first: Pairs, rest: Replies,
                         skip_until: str | None = None) -> AsyncIterator[bytes]:
        """Ordered replies -> chunk dicts -> SSE events; entries up to `skip_until` (Last-Event-ID) go into
        the format but are not sent again."""
        try:
            async for pairs in chain_replies(first, rest):
                if not pairs:
                    continue  # nothing arrived for a while (pings keep the connection)
                self._first_token(flight, fmt)
                if skip_until:  # replay what the client already has into the formatter, unsent
                    fmt.chunks([ev for eid, ev in pairs if not streams.id_after(eid, skip_until)])
                    pairs = [(eid, ev) for eid, ev in pairs if streams.id_after(eid, skip_until)]
                    if not pairs:
                        continue
                last_id = pairs[-1][0] if fmt.event_ids else None
                for chunk in fmt.chunks([ev for _, ev in pairs]):
                    yield sse_event(orjson.dumps(chunk), last_id)
            if fmt.include_usage:
                yield sse_event(orjson.dumps(fmt.usage_chunk()))
        except ENDED_EARLY as e:
            yield sse_event(orjson.dumps(ended_early(flight, e).body()))
        yield DONE

    def _first_token(self, flight: Flight, fmt: Format) -> None:
        if flight.first_token_at is None and fmt.times_first_token:
            flight.first_token_at = time.monotonic()
            flight.span.event("first_token")
            self.metrics.ttft.labels(flight.model).observe(flight.first_token_at - flight.started)

    async def finish(self, flight: Flight, endpoint: str, reason: str | None = None) -> None:
        """Step 5, once per request it answers: close it (services/api/gateway.py `Inflight.close` aborts it
        unless it finished) and, on the process that submitted it, end its span and count it."""
        for f in flight.flights:
            if f.closed:
                continue
            if reason:
                f.end_reason = reason
            await f.close()
            if f.owner:
                self._count(f, endpoint)

    def _count(self, flight: Inflight, endpoint: str) -> None:
        status = "ok" if flight.done else flight.end_reason
        flight.span.set(status=status, completion_tokens=flight.order.completion_tokens)
        flight.span.end(error=None if flight.done else status)  # after the last byte was sent
        model = flight.model
        self.metrics.inflight.labels(model).dec()
        self.metrics.requests.labels(model, endpoint, status).inc()
        self.metrics.duration.labels(model).observe(time.monotonic() - flight.started)
        self.metrics.prompt_tokens.labels(model).inc(flight.order.prompt_tokens)
        self.metrics.generated_tokens.labels(model).inc(flight.order.completion_tokens)


async def first_replies(flight: Flight, replies: Replies) -> Pairs:
    try:
        return await anext(replies, [])
    except ENDED_EARLY as e:
        raise ended_early(flight, e) from None


async def chain_replies(first: Pairs, rest: Replies) -> Replies:
    yield first
    async for pairs in rest:
        yield pairs
