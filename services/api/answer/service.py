"""The one path every generating request's answer takes (`ApiService.answer`; a reattaching client's,
`ApiService.reattach`), after the edge (services/api/edge/) parsed its body, entering each module once, in this
order:

1. admission (services/api/answer/admission.py): one call decides whether the body is taken now and builds what it
   submits (limits, the tenant's policy and quota, the model's backlog, its uids, jobs, format and record);
2. the request (services/api/answer/request/): opened (its record, tokenize job and inbox in one round trip per job)
   or attached to; it yields its ordered replies, its early ends as HTTP errors;
3. format (services/api/answer/formats.py): events -> OpenAI chunk dicts, or the final response;
4. bytes (services/api/answer/sse.py): SSE events, the response start, keep-alives, the client leaving;
5. close (`ApiRequest.close`): abort the request unless it finished, metrics, span, the quota's lease.

Every request it opens is closed in `finally` (non-stream) or when its response ends for any reason
(stream: the `SSEResponse`), so client disconnects, deadlines and errors all release the request's state
here and abort it in every stage. The process's state it runs on is `ApiService.ctx`
(services/api/answer/collaborators.py), which the feature APIs are given too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

import msgspec
from fastapi import Request as HttpRequest

from services.api import errors
from services.api.answer.admission import Admission, Admitted, Body
from services.api.answer.collaborators import build_context
from services.api.answer.formats import Format, format_of_record
from services.api.answer.request.api_request import ApiRequest
from services.api.answer.request.requests import until_disconnect
from services.api.answer.sse import SSEResponse, answer_events, shutdown_events
from services.api.errors import ApiError
from shared.heartbeats import Beating, Heartbeat
from shared.request_states import EndReason
from shared.settings import ApiSettings

log = logging.getLogger(__name__)


class ApiService:
    """The answer path (module doc) over the process's state (`ctx`, services/api/answer/collaborators.py), and that
    state's start and close."""

    def __init__(self, settings: ApiSettings):
        self.settings = settings
        self.ctx = ctx = build_context(settings)
        self.requests = ctx.requests  # the requests this process follows (draining waits for them)
        self.admission = Admission(ctx)
        beating = Beating("api", ctx.pod, "", settings.heartbeat_interval_s, settings.heartbeat_ttl_s)
        self.heartbeat = Heartbeat(ctx.redis, ctx.keys, beating, self.heartbeat_load)
        self.closing = asyncio.Event()  # set once open streams must end (shutdown after the grace period)

    @property
    def draining(self) -> bool:
        """Out of service (services/api/answer/drain.py): `/ready` 503 and new requests 503."""
        return self.ctx.drain.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.ctx.drain.draining = value

    def drain_for(self, seconds: float) -> None:
        self.ctx.drain.drain_for(seconds)

    def heartbeat_load(self) -> dict:
        """What this process's heartbeat reports (its `load` field)."""
        return {"inflight": len(self.requests.inflight), "subscriptions": self.ctx.hub.subscriptions,
                "draining": self.draining}

    async def start(self) -> None:
        stages = self.ctx.stages
        await stages.refresh()
        stages.start()
        self.heartbeat.start()
        self.ctx.tenancy.start()
        log.info("api ready: pod=%s redis_ok=%s models=%s", self.ctx.pod, stages.snapshot.redis_ok,
                 sorted(stages.snapshot.models))

    async def close(self) -> None:
        ctx = self.ctx
        await ctx.requests.close()
        await ctx.tenancy.close()
        await self.heartbeat.stop()
        await ctx.stages.stop()
        await ctx.hub.close()
        await ctx.redis.aclose()
        ctx.tracer.shutdown()

    # -- one request's path: the request -> format -> bytes -> close -------------------------------------
    async def answer(self, http: HttpRequest, body: Body):
        """Admit a generating body and answer it (`answer_admitted`)."""
        admitted = await self.admission.admit_from(http, body)
        return await self.answer_admitted(http, admitted)

    async def answer_admitted(self, http: HttpRequest, admitted: Admitted):
        """Submit an admitted body's jobs and answer them as one response (several jobs: a completion with a list
        of prompts, whose choices follow each other): a JSON body once every choice finished, or an SSE stream.
        The tenant's lease ends with the request."""
        http.scope[errors.UID] = admitted.uid  # whatever fails from here on is logged with it
        submission = admitted.submission
        opening = self.requests.open(admitted)
        if submission.stream:
            return await self.stream(http, opening, submission.fmt)
        return await self.full_answer(http, opening, submission.fmt)

    async def full_answer(self, http: HttpRequest, opening: Awaitable[ApiRequest], fmt: Format):
        """The JSON body, unless the client goes away first (then nothing); the request is closed either way."""
        req = await opening
        try:
            connected, body = await until_disconnect(http, self.full_body(req, fmt))
            return body if connected else None
        finally:
            await req.close()

    async def reattach(self, http: HttpRequest, uid: str, record: dict, last_event_id: str | None,
                       fmt: Format | None = None):
        """Stream a request submitted by any API process, from its record (or in `fmt`, a feature's format of
        it): entries up to `last_event_id` go into the format unsent."""
        fmt = fmt or format_of_record(record, uid)
        return await self.stream(http, self.requests.attach(uid, record, last_event_id), fmt, last_event_id)

    async def full_body(self, req: ApiRequest, fmt: Format) -> dict:
        """The whole answer, held here until it ends: bounded by --max-response-bytes, counted as its events
        (text and logprobs, as JSON) arrive, which is about the size of the body they make."""
        size, limit = 0, self.settings.max_response_bytes
        async for batch in req.replies():
            events = [ev for _, ev in batch]
            size += sum(len(msgspec.json.encode(ev)) for ev in events)
            if size > limit:
                await req.close(EndReason.RESPONSE_TOO_LARGE)
                raise ApiError(400, f"the answer is over {limit} bytes (--max-response-bytes) and was "
                               "stopped: stream it (`stream: true`) or ask for fewer tokens, choices or "
                               "logprobs", param="max_tokens", code="response_too_large")
            fmt.add(events)
        return fmt.response(req.counts)

    async def stream(self, http: HttpRequest, opening: Awaitable[ApiRequest], fmt: Format,
                     replay_until: str | None = None) -> SSEResponse | None:
        """Hold the response back until the first reply entries arrive (or `sse_ping_s` passes without any),
        so that an error known before generation gets its HTTP status rather than a 200 and an error event.
        The stream then starts with those entries at once: waiting costs the first token nothing. Entries up
        to `replay_until` (Last-Event-ID) go into the format but are not sent again. `opening`: the request's
        open or attach, awaited here (every step of the service's own is entered before the request's)."""
        req = await opening
        replies = req.replies(idle_s=self.settings.sse_ping_s)
        started = False
        try:
            connected, first = await until_disconnect(http, anext(replies, []))
            if not connected:
                return None
            events = answer_events(fmt.batch_chunks(first, req.counts, replay_until), replies, fmt, req.counts,
                                   replay_until)
            # The response is sent after this handler returned, so it closes the request itself, when its last
            # byte is sent or it ends early (with the reason).
            response = SSEResponse(events, req.close, self.settings.sse_ping_s, self.settings.slow_client_timeout_s,
                                   self.closing, farewell=lambda: shutdown_events(fmt))
            started = True
            return response
        finally:
            if not started:
                await req.close()
