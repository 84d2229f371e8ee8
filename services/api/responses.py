"""The Responses API (`/v1/responses`): a response is a chat request through the pipeline (its tokenize job, record
and reply stream, services/api/service.py answers it) plus a stored document any API process reads.

The stored response (`Keys.response`, one JSON string with a TTL of --response-ttl-s, at most
--max-stored-response-bytes) holds what the response object echoes, how its answers are parsed, its input items
and the conversation before them (`previous_response_id`) and, once it ended, its final object. Until then every
API process can rebuild the object from the reply stream (`ResponseFormat` is a pure function of it), so:

- `GET /v1/responses/{id}` answers with the stored final object, or rebuilds it once the request ended (and
  stores it), or shows it queued / in progress;
- `GET /v1/responses/{id}?stream=true&starting_after=N` re-reads the reply stream from its start and sends the
  events numbered after N (only for responses created with `background` and `stream`, as at OpenAI);
- a `background` response runs to its end with nobody attached: its client leaving does not abort it (the
  request's close policy, services/api/request.py), and the process that took it follows it to store its final
  object; if that process is gone, the next GET rebuilds it;
- cancel aborts it like DELETE /v1/requests/{uid} and returns its final object (a second cancel the same);
  DELETE aborts it if it runs and deletes the stored response.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import Request as HttpRequest
from prometheus_client import Counter
from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.api import errors
from services.api.adapters import Adapters
from services.api.admission import Admitted
from services.api.errors import ApiError
from services.api.response_format import ResponseFormat
from services.api.response_schemas import ResponseRequest, as_input, response_uid
from services.api.schemas import BadRequest
from services.api.service import ApiService
from services.api.tenants import Tenant
from shared.keys import Keys
from shared.request_states import NOT_SCHEDULED, TERMINAL, EndReason

log = logging.getLogger(__name__)

REBUILD_S = 10.0  # longest wait for an ended (or cancelled) request's reply stream to be read to its end


def not_found(response_id: str) -> ApiError:
    return ApiError(404, f"no response `{response_id}` (stored responses are kept for --response-ttl-s)",
                    param="response_id", code="response_not_found")


class ResponseStore:
    """Stored responses in Redis: one JSON document each, under the request's hash tag, with a TTL; `ended` counts
    those whose final object it stored (by status)."""

    def __init__(self, redis: Redis, keys: Keys, ttl_s: int, max_bytes: int, ended: Counter | None = None):
        self.redis, self.keys, self.ttl_s, self.max_bytes, self.ended = redis, keys, ttl_s, max_bytes, ended

    async def put(self, uid: str, doc: dict[str, Any]) -> None:
        await self.redis.set(self.keys.response(uid), self.encoded(doc, "input"), ex=self.ttl_s)

    def encoded(self, doc: dict[str, Any], param: str) -> bytes:
        raw = orjson.dumps(doc)
        if len(raw) > self.max_bytes:
            raise ApiError(400, f"the stored response would be {len(raw)} bytes; at most {self.max_bytes} "
                           "(--max-stored-response-bytes): send a shorter conversation, or `store: false`",
                           param=param, code="request_too_large")
        return raw

    async def get(self, uid: str) -> dict[str, Any] | None:
        raw = await self.redis.get(self.keys.response(uid))
        return orjson.loads(raw) if raw else None

    async def finish(self, uid: str, final: dict[str, Any]) -> None:
        """Keep the final object with the document (once; an output too large to store is left to the reply
        stream)."""
        doc = await self.get(uid)
        if doc is None or doc.get("final"):
            return
        doc["final"] = final
        try:
            raw = self.encoded(doc, "output")
        except ApiError:
            log.warning("uid=%s final response over --max-stored-response-bytes: not stored", uid)
            return
        await self.redis.set(self.keys.response(uid), raw, ex=self.ttl_s)
        if self.ended is not None:
            self.ended.labels(final["status"]).inc()

    async def delete(self, uid: str) -> bool:
        return bool(await self.redis.delete(self.keys.response(uid)))


def answer_parsing(body: ResponseRequest, model_info: dict) -> dict:
    """How the model's answers are split: reasoning where its tokenizer detected a reasoning format, tool calls
    when the request offers tools it may call."""
    out: dict = {}
    if model_info.get("reasoning_parser", "none") != "none":
        out["reasoning"] = model_info["reasoning_parser"]
    elif body.reasoning is not None and body.reasoning.effort not in (None, "none"):
        raise BadRequest(f"`reasoning` is not supported by model `{body.model}` (its template does not reason)",
                         "reasoning")
    if body.tools and body.tool_choice != "none" and model_info.get("tool_call_parser", "none") != "none":
        out["tools"] = model_info["tool_call_parser"]
    return out


def format_of_doc(doc: dict[str, Any], uid: str) -> ResponseFormat:
    return ResponseFormat(doc["shown"], doc.get("parse"), uid, int(doc.get("created", 0)))


class Responses:
    """The routes' work (services/api/app.py `add_response_routes` parses and calls it)."""

    def __init__(self, svc: ApiService, adapters: Adapters):
        s = svc.settings
        self.svc, self.adapters = svc, adapters
        self.store = ResponseStore(svc.redis, svc.keys, s.response_ttl_s, s.max_stored_response_bytes,
                                   svc.metrics.responses)
        self.followers: set[asyncio.Task] = set()  # background responses this process follows to their end

    async def close(self) -> None:
        for task in list(self.followers):
            task.cancel()
        for task in list(self.followers):
            with contextlib.suppress(asyncio.CancelledError, RedisError, OSError, ApiError):
                await task

    # -- create ----------------------------------------------------------------------------------------------
    async def create(self, http: HttpRequest, body: ResponseRequest):
        admitted, fmt = await self.prepare(body, self.svc.tenancy.tenant_of(http))
        http.scope[errors.UID] = admitted.uid
        if body.background and not body.stream:
            return await self.start_background(admitted, fmt)
        answer = await self.svc.answer_admitted(http, admitted)
        if isinstance(answer, dict) and fmt.on_end is not None:
            await fmt.on_end(answer)
        return answer

    async def prepare(self, body: ResponseRequest, tenant: Tenant, new_uid: Callable[[], str] | None = None
                      ) -> tuple[Admitted, ResponseFormat]:
        """What a body submits, once checked and admitted for `tenant` (services/api/admission.py: the same steps
        as a chat request's), and its stored document written (with `store`); `new_uid`: the uid its job takes
        (a batch's line has its own), else the reply hub's."""
        admission = self.svc.admission
        self.svc.tenancy.authorize(tenant, body.model, background=body.background)
        history = await self.history(body.previous_response_id, tenant) if body.previous_response_id else []
        items = body.input_items()
        params = body.checked(self.svc.limits, len(history) + len(items))
        model, adapter = await self.adapters.target(body.model, None)
        budget = body.budget(params)
        await admission.room(model, budget)
        stamp = admission.stamp(model, adapter, budget.prompts, new_uid)
        parse = answer_parsing(body, stamp.model_info)
        fmt = ResponseFormat(body.shown(body.previous_response_id), parse)
        submission = body.submission(params, stamp, body.messages(history, items), fmt)
        if body.store is not False:
            uid = fmt.uid
            doc = {"shown": fmt.shown, "parse": parse, "created": fmt.created, "input": items, "history": history,
                   "resumable": bool(body.background and body.stream), "tenant": tenant.name}
            await self.store.put(uid, doc)
            fmt.on_end = lambda final: self.store.finish(uid, final)
        return await admission.leased(submission, tenant), fmt

    async def start_background(self, admitted: Admitted, fmt: ResponseFormat) -> dict:
        """Submit it (its lease taken), answer at once (queued), and follow it here to store its final object."""
        req = await self.svc.requests.open(admitted, "background")

        async def follow() -> None:
            try:
                final = await self.svc.full_body(req, fmt)
                await self.store.finish(fmt.uid, final)
            except ApiError as e:
                log.info("uid=%s background response ended early: %s", fmt.uid, e.message)
            finally:
                await req.close()

        task = asyncio.create_task(follow())
        self.followers.add(task)
        task.add_done_callback(self.followers.discard)
        return fmt.obj("queued")

    async def history(self, response_id: str, tenant: Tenant) -> list[dict[str, Any]]:
        """The conversation a previous response (of the same tenant) ended with: its history, input and output
        items."""
        uid = response_uid(response_id, "previous_response_id")
        doc = await self.store.get(uid)
        if doc is None or not self.svc.tenancy.owns(tenant, doc):
            raise ApiError(404, f"previous_response_id `{response_id}` is not a stored response (stored responses "
                           "are kept for --response-ttl-s)", param="previous_response_id",
                           code="previous_response_not_found")
        final = await self.final(uid, doc)
        if final is None:
            raise ApiError(400, f"previous response `{response_id}` has not ended yet", param="previous_response_id")
        return [*doc["history"], *doc["input"], *as_input(final["output"])]

    # -- read back -------------------------------------------------------------------------------------------
    async def doc(self, response_id: str, tenant: Tenant) -> tuple[str, dict[str, Any]]:
        """A stored response of `tenant` (another tenant's is not found: its existence is not confirmed)."""
        uid = response_uid(response_id)
        doc = await self.store.get(uid)
        if doc is None or not self.svc.tenancy.owns(tenant, doc):
            raise not_found(response_id)
        return uid, doc

    async def final(self, uid: str, doc: dict[str, Any]) -> dict[str, Any] | None:
        """The final object: stored, or rebuilt from the reply stream once the request ended (then stored);
        None while it runs."""
        if doc.get("final"):
            return doc["final"]
        record = await self.svc.store.record(uid)
        if not record:  # the request's keys expired before its final object was stored
            return {**format_of_doc(doc, uid).obj("failed"),
                    "error": {"code": "server_error", "message": "response_expired: the response's output "
                                                          "expired before it was stored"}}
        if record.get("status") not in TERMINAL:
            return None
        return await self.rebuild(uid, doc, record)

    async def rebuild(self, uid: str, doc: dict[str, Any], record: dict) -> dict[str, Any] | None:
        """The final object from the reply stream, read to its end (then stored); None if it does not end within
        REBUILD_S (an aborted request no worker has picked up yet)."""
        fmt = format_of_doc(doc, uid)
        req = await self.svc.requests.attach(uid, record, None)
        try:
            async with asyncio.timeout(REBUILD_S):
                final = await self.svc.full_body(req, fmt)
        except TimeoutError:
            return None
        finally:
            await req.close()
        await self.store.finish(uid, final)
        return final

    async def retrieve(self, http: HttpRequest, response_id: str, stream: bool, starting_after: int | None):
        uid, doc = await self.doc(response_id, self.svc.tenancy.tenant_of(http))
        if stream:
            return await self.resume(http, uid, doc, starting_after)
        final = await self.final(uid, doc)
        if final is not None:
            return final
        status = (await self.svc.store.field([uid], "status"))[uid]
        return format_of_doc(doc, uid).obj("queued" if status in NOT_SCHEDULED else "in_progress")

    async def resume(self, http: HttpRequest, uid: str, doc: dict[str, Any], starting_after: int | None):
        """The stream's events again, from its start or after event `starting_after`."""
        if not doc.get("resumable"):
            raise ApiError(400, "only responses created with `background` and `stream` can be streamed again",
                           param="stream")
        record = await self.svc.store.record(uid)
        if not record:
            raise ApiError(410, f"the events of `resp_{uid}` expired (--request-ttl-s)", param="response_id",
                           code="reply_expired")
        fmt = format_of_doc(doc, uid)
        fmt.skip_through = -1 if starting_after is None else starting_after
        fmt.on_end = lambda final: self.store.finish(uid, final)
        return await self.svc.stream(http, self.svc.requests.attach(uid, record, None), fmt)

    # -- end -------------------------------------------------------------------------------------------------
    async def cancel(self, response_id: str, tenant: Tenant) -> dict[str, Any]:
        """Abort a background response; its final object (cancelled, or how it ended before)."""
        uid, doc = await self.doc(response_id, tenant)
        if not doc["shown"].get("background"):
            raise ApiError(400, "only background responses can be cancelled", param="response_id")
        if doc.get("final"):
            return doc["final"]
        record = await self.svc.store.record(uid)
        if record and record.get("status") not in TERMINAL:
            await self.svc.store.abort_now(uid, EndReason.API, record.get("model"))
        final = await self.final(uid, doc) if not record else await self.rebuild(uid, doc, record)
        return final or format_of_doc(doc, uid).obj("cancelled")

    async def delete(self, response_id: str, tenant: Tenant) -> dict[str, Any]:
        uid, _ = await self.doc(response_id, tenant)
        record = await self.svc.store.record(uid)
        if record and record.get("status") not in TERMINAL:
            await self.svc.store.abort_now(uid, EndReason.API, record.get("model"))
        await self.store.delete(uid)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def input_items(self, response_id: str, tenant: Tenant, limit: int, order: str, after: str | None
                          ) -> dict[str, Any]:
        """This response's input items (OpenAI's list shape), newest first unless `order` is asc."""
        uid, doc = await self.doc(response_id, tenant)
        items = [{"id": f"in_{uid}_{k}", **item, "status": "completed"} for k, item in enumerate(doc["input"])]
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise ApiError(400, f"`after` names no input item of `{response_id}`", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
