"""The Responses API (`/v1/responses`): a response is a chat request through the pipeline (its tokenize job, record
and reply stream, services/api/answer/service.py answers it) plus a stored document any API process reads.

A request is admitted as every generating body is (services/api/answer/admission.py `Admission.admit`: limits, the
tenant's policy, room, its uids and job, the tenant's quota); then its stored response is counted against its
tenant's bounds and written with the request, on the pipeline that opens it
(services/api/responses_api/response_store.py): nothing is stored for a request refused on the way, nor past what the
model's context can take. A response that continues another (`previous_response_id`) stores only its own input and the
other's id; the conversation is read link by link (`conversation`), within --max-response-chain links and
--max-stored-response-bytes. Until it ended every API process can rebuild the object from the reply stream
(`ResponseFormat` is a pure function of it), so:

- `GET /v1/responses/{id}` answers with the stored final object, or rebuilds it once the request ended (and
  stores it; a request a stage refused ends `failed` with the error), or shows it queued / in progress;
- `GET /v1/responses/{id}?stream=true&starting_after=N` re-reads the reply stream from its start and sends the
  events numbered after N (only for responses created with `background` and `stream`, as at OpenAI);
- a `background` response runs to its end with nobody attached: its client leaving does not abort it (the
  request's close policy, services/api/answer/request/single.py), and the process that took it follows it to store its
  final object; if that process is gone, the next GET rebuilds it;
- a response whose id never reached its client (its create answered with an error, or its client left before the
  answer) is deleted at once;
- cancel aborts it like DELETE /v1/requests/{uid} and returns its final object (a second cancel the same);
  DELETE aborts it if it runs and deletes the stored response.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import Request as HttpRequest
from redis.exceptions import RedisError

from services.api import errors
from services.api.answer.admission import Admitted
from services.api.answer.collaborators import ApiContext
from services.api.answer.limits import fits_context
from services.api.answer.request.early_end import EndedEarly
from services.api.answer.schemas.field_checks import BadRequest
from services.api.answer.schemas.sampling_fields import SloTargets
from services.api.answer.schemas.submission import Stamp, Submission
from services.api.answer.service import ApiService
from services.api.errors import ApiError
from services.api.multitenancy.tenants import Tenant
from services.api.responses_api.response_format import ResponseFormat
from services.api.responses_api.response_items import as_input
from services.api.responses_api.response_schemas import ResponseRequest, response_uid
from services.api.responses_api.response_store import ResponseStore, Stored
from services.api.responses_api.sealing import Sealer, key_from_setting
from shared.messages import SamplingParams
from shared.request_states import NOT_SCHEDULED, TERMINAL, EndReason
from shared.tasks import stop_task

log = logging.getLogger(__name__)

REBUILD_S = 10.0  # longest wait for an ended (or cancelled) request's reply stream to be read to its end


def not_found(response_id: str) -> ApiError:
    return ApiError(404, f"no response `{response_id}` (stored responses are kept for --response-ttl-s)",
                    param="response_id", code="response_not_found")


def answer_parsing(body: ResponseRequest, model_info: dict, tenant: str) -> dict:
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
    if body.encrypts():
        out["seal"] = tenant  # reasoning items carry encrypted_content, sealed for this tenant
    return out


def format_of_doc(meta: dict[str, Any], uid: str, sealer: Sealer | None = None) -> ResponseFormat:
    fmt = ResponseFormat(meta["shown"], meta.get("parse"), uid, int(meta.get("created", 0)))
    fmt.sealer = sealer
    return fmt


@dataclass
class Conversation:
    """What a response continues (`previous_response_id`): the items of the conversation so far, oldest first,
    and the responses it was read from (uid, owner), whose expiry its new response refreshes."""

    items: list[dict[str, Any]] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)
    size: int = 0  # bytes of its stored items


@dataclass
class ResponseBody:
    """A Responses request as services/api/answer/admission.py takes a body: the request with the conversation it
    continues and its input items (read and checked before), and where its response is stored (`stored`: its
    fields, once `submission` built them; empty with `store: false`)."""

    request: ResponseRequest
    tenant: Tenant
    history: Conversation
    items: list[dict[str, Any]]
    store: ResponseStore
    sealer: Sealer | None = None
    lora_path: str | None = None
    stored: dict[str, bytes] = field(default_factory=dict)

    @property
    def model(self) -> str:
        return self.request.model

    @property
    def background(self) -> bool | None:
        return self.request.background

    @property
    def cache_salt(self) -> str | None:
        """`cache_salt`, and OpenAI's `prompt_cache_key` with it: requests that name different keys share no
        prefix-cache pages, and those that name one key route to the pages cached for it (shared/pages.py)."""
        salt, key = self.request.cache_salt, self.request.prompt_cache_key
        return salt if key is None else f"{salt or ''}\x1fprompt_cache_key:{key}"

    @property
    def slo(self) -> SloTargets | None:
        return self.request.slo

    def checked(self, limits) -> SamplingParams:
        return self.request.checked(limits, len(self.history.items) + len(self.items))

    def budget(self, params: SamplingParams):
        return self.request.budget(params)

    def submission(self, params: SamplingParams, stamp: Stamp) -> Submission:
        """The job and format, and what it stores (written with its record), bounded by the model's context and
        --max-stored-response-bytes before anything is written."""
        body = self.request
        messages = body.messages(self.history.items, self.items)
        fits_context(messages, None, stamp.model_info, "input")
        parse = answer_parsing(body, stamp.model_info, self.tenant.name)
        fmt = ResponseFormat(body.shown(body.previous_response_id), parse)
        fmt.sealer = self.sealer
        sub = body.submission(params, stamp, messages, fmt)
        if body.store is False:
            return sub
        prev = self.history.links[0][0] if self.history.links else None
        meta = {"shown": fmt.shown, "parse": parse, "created": fmt.created, "prev": prev,
                "resumable": bool(body.background and body.stream)}
        self.stored = self.store.encoded(meta, self.items)
        return dataclasses.replace(sub, writes=self.store.writes(self.tenant.name, fmt.uid, self.stored,
                                                                 self.history.links))


class Responses:
    """The routes' work (services/api/edge/routes.py `add_response_routes` parses and calls it)."""

    def __init__(self, ctx: ApiContext, service: ApiService):
        self.ctx, self.service, self.max_chain = ctx, service, ctx.settings.max_response_chain
        self.store = ResponseStore(ctx.redis, ctx.keys, ctx.settings, ctx.metrics.responses)
        self.sealer = Sealer(key_from_setting(ctx.settings.responses_key))
        self.followers: set[asyncio.Task] = set()  # background responses this process follows to their end

    async def close(self) -> None:
        """Stop following: a follower in a Redis read can swallow its first cancellation (shared/tasks.py)."""
        await asyncio.gather(*(stop_task(task) for task in list(self.followers)))

    # -- create ----------------------------------------------------------------------------------------------
    async def create(self, http: HttpRequest, body: ResponseRequest):
        tenant = self.ctx.tenancy.tenant_of(http)
        admitted, fmt = await self.prepare(body, tenant, headers=http.headers)
        http.scope[errors.UID] = admitted.uid
        background = bool(body.background and not body.stream)
        answer = None
        try:
            answer = await (self.start_background(admitted, fmt, tenant) if background else
                            self.service.answer_admitted(http, admitted))
        finally:
            if answer is None and body.store is not False:
                await self.forget(fmt.uid, tenant)  # its id never reached the client
        if isinstance(answer, dict) and not background and fmt.on_end is not None:
            await fmt.on_end(answer)
        return answer

    async def prepare(self, body: ResponseRequest, tenant: Tenant, new_uid: Callable[[], str] | None = None,
                      headers: Mapping[str, str] | None = None) -> tuple[Admitted, ResponseFormat]:
        """What a body submits, once admitted for `tenant` (services/api/answer/admission.py, as a chat request) and its
        stored response (with `store`) counted against the tenant's bounds: it is written when the request is
        opened; `new_uid`: the uid its job takes (a batch's line has its own), else the reply hub's."""
        history = await self.conversation(body.previous_response_id, tenant)
        items = body.input_items(lambda value, param: self.sealer.open(value, body.model, tenant.name, param))
        prepared = ResponseBody(body, tenant, history, items, self.store, self.sealer)
        admitted = await self.service.admission.admit(prepared, tenant, new_uid, headers)
        fmt = admitted.submission.fmt
        assert isinstance(fmt, ResponseFormat)
        if prepared.stored:
            try:
                await self.store.reserve(tenant.name, fmt.uid, sum(len(v) for v in prepared.stored.values()))
            except BaseException:
                if admitted.lease is not None:  # the request is not opened: its quota is not held
                    await admitted.lease.release()
                raise
            uid, owner = fmt.uid, tenant.name
            fmt.on_end = lambda final: self.store.finish(uid, owner, final)
        return admitted, fmt

    async def forget(self, uid: str, tenant: Tenant) -> None:
        """Delete a response whose id never reached its client (nothing can read it), even while cancelled; if
        Redis fails, its TTL ends it."""
        with anyio.CancelScope(shield=True):
            try:
                await self.store.delete(uid, tenant.name)
            except (RedisError, OSError) as e:
                log.warning("uid=%s could not delete the stored response of a request that failed: %s", uid, e)

    async def start_background(self, admitted: Admitted, fmt: ResponseFormat, tenant: Tenant) -> dict:
        """Submit it (its lease taken), answer at once (queued), and follow it here to store its final object."""
        req = await self.ctx.requests.open(admitted, "background")

        async def follow() -> None:
            try:
                await self.store.finish(fmt.uid, tenant.name, await self.ended(req, fmt))
            except (ApiError, RedisError, OSError) as e:  # the next GET rebuilds it
                log.warning("uid=%s background response not stored: %s", fmt.uid, e)
            finally:
                await req.close()

        task = asyncio.create_task(follow())
        self.followers.add(task)
        task.add_done_callback(self.followers.discard)
        return fmt.obj("queued")

    async def ended(self, req, fmt: ResponseFormat) -> dict[str, Any]:
        """The final object once the request ended: `failed` with the error if a stage refused it, it ran past
        its deadline or its answer past --max-response-bytes."""
        try:
            return await self.service.full_body(req, fmt)
        except ApiError as e:
            if isinstance(e, EndedEarly) and e.reason == EndReason.BROKER_UNAVAILABLE:
                raise  # not how the response ended: Redis is out of reach
            log.info("uid=%s response failed: %s", fmt.uid, e.message)
            fmt.failure_chunks(e.body())
            assert fmt.final is not None
            return fmt.final

    async def conversation(self, response_id: str | None, tenant: Tenant) -> Conversation:
        """The conversation `response_id` (of the same tenant) ended with, read back link by link (each stored
        response holds its own input and output and names the one before it): a 404 for one not found, a 400
        past --max-response-chain links, --max-response-items items or --max-stored-response-bytes."""
        out = Conversation()
        uid = response_uid(response_id, "previous_response_id") if response_id else None
        turns: list[list[dict[str, Any]]] = []
        while uid is not None:
            if len(out.links) >= self.max_chain:
                raise too_long(response_id, f"chains more than {self.max_chain} responses (--max-response-chain)")
            link = await self._link(uid, tenant, response_id, first=not out.links)
            final = link.json("final") or await self.final(uid, link.json("meta"), link.owner)
            if final is None:
                raise ApiError(400, f"previous response `{response_id}` has not ended yet",
                               param="previous_response_id")
            turns.append([*link.json("input"), *as_input(final["output"])])
            out.links.append((uid, link.owner))
            out.size += len(link.fields["input"] or b"") + len(link.fields["final"] or b"")
            if out.size > self.store.max_bytes or sum(map(len, turns)) > self.ctx.settings.max_response_items:
                raise too_long(response_id, "holds more than --max-stored-response-bytes or --max-response-items")
            uid = link.json("meta").get("prev")
        out.items = [item for turn in reversed(turns) for item in turn]
        return out

    async def _link(self, uid: str, tenant: Tenant, response_id: str, first: bool) -> Stored:
        link = await self.store.read(uid, tenant.name, tenant.admin, "meta", "input", "final")
        if link is None or link.fields["meta"] is None:
            where = "is not a stored response" if first else f"continues `resp_{uid}`, which was deleted or expired"
            raise ApiError(404, f"previous_response_id `{response_id}` {where} (stored responses are kept for "
                           "--response-ttl-s)", param="previous_response_id", code="previous_response_not_found")
        return link

    # -- read back -------------------------------------------------------------------------------------------
    async def doc(self, response_id: str, tenant: Tenant, *fields: str) -> Stored:
        """`fields` of a stored response of `tenant` (another tenant's is not found, and none of it read: its
        existence is not confirmed)."""
        uid = response_uid(response_id)
        stored = await self.store.read(uid, tenant.name, tenant.admin, *fields)
        if stored is None or any(stored.fields[f] is None for f in fields if f != "final"):
            raise not_found(response_id)
        return stored

    async def final(self, uid: str, meta: dict[str, Any], owner: str,
                    final: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The final object: stored (`final`), or rebuilt from the reply stream once the request ended (then
        stored); None while it runs."""
        if final:
            return final
        record = await self.ctx.store.record(uid)
        if not record:  # the request's keys expired before its final object was stored
            return {**format_of_doc(meta, uid, self.sealer).obj("failed"),
                    "error": {"code": "server_error", "message": "response_expired: the response's output "
                                                          "expired before it was stored"}}
        if record.get("status") not in TERMINAL:
            return None
        return await self.rebuild(uid, meta, owner, record)

    async def rebuild(self, uid: str, meta: dict[str, Any], owner: str, record: dict) -> dict[str, Any] | None:
        """The final object from the reply stream, read to its end (then stored); None if it does not end within
        REBUILD_S (an aborted request no worker has picked up yet)."""
        fmt = format_of_doc(meta, uid, self.sealer)
        req = await self.ctx.requests.attach(uid, record, None)
        try:
            async with asyncio.timeout(REBUILD_S):
                final = await self.ended(req, fmt)
        except TimeoutError:
            return None
        finally:
            await req.close()
        await self.store.finish(uid, owner, final)
        return final

    async def retrieve(self, http: HttpRequest, response_id: str, stream: bool, starting_after: int | None):
        doc = await self.doc(response_id, self.ctx.tenancy.tenant_of(http), "meta", "final")
        uid, meta = doc.uid, doc.json("meta")
        if stream:
            return await self.resume(http, doc, starting_after)
        final = await self.final(uid, meta, doc.owner, doc.json("final"))
        if final is not None:
            return final
        status = (await self.ctx.store.field([uid], "status"))[uid]
        return format_of_doc(meta, uid, self.sealer).obj("queued" if status in NOT_SCHEDULED else "in_progress")

    async def resume(self, http: HttpRequest, doc: Stored, starting_after: int | None):
        """The stream's events again, from its start or after event `starting_after`."""
        uid, meta = doc.uid, doc.json("meta")
        if not meta.get("resumable"):
            raise ApiError(400, "only responses created with `background` and `stream` can be streamed again",
                           param="stream")
        record = await self.ctx.store.record(uid)
        if not record:
            raise ApiError(410, f"the events of `resp_{uid}` expired (--request-ttl-s)", param="response_id",
                           code="reply_expired")
        fmt = format_of_doc(meta, uid, self.sealer)
        fmt.skip_through = -1 if starting_after is None else starting_after
        fmt.on_end = lambda final: self.store.finish(uid, doc.owner, final)
        return await self.service.stream(http, self.ctx.requests.attach(uid, record, None), fmt)

    # -- end -------------------------------------------------------------------------------------------------
    async def cancel(self, response_id: str, tenant: Tenant) -> dict[str, Any]:
        """Abort a background response; its final object (cancelled, or how it ended before)."""
        doc = await self.doc(response_id, tenant, "meta", "final")
        uid, meta = doc.uid, doc.json("meta")
        if not meta["shown"].get("background"):
            raise ApiError(400, "only background responses can be cancelled", param="response_id")
        if doc.fields["final"]:
            return doc.json("final")
        record = await self.ctx.store.record(uid)
        if record and record.get("status") not in TERMINAL:
            await self.ctx.store.abort_now(uid, EndReason.API, record.get("model"))
        final = (await self.final(uid, meta, doc.owner) if not record else
                 await self.rebuild(uid, meta, doc.owner, record))
        return final or format_of_doc(meta, uid, self.sealer).obj("cancelled")

    async def delete(self, response_id: str, tenant: Tenant) -> dict[str, Any]:
        doc = await self.doc(response_id, tenant)
        record = await self.ctx.store.record(doc.uid)
        if record and record.get("status") not in TERMINAL:
            await self.ctx.store.abort_now(doc.uid, EndReason.API, record.get("model"))
        await self.store.delete(doc.uid, doc.owner)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def input_items(self, response_id: str, tenant: Tenant, limit: int, order: str, after: str | None
                          ) -> dict[str, Any]:
        """This response's input items (OpenAI's list shape), newest first unless `order` is asc."""
        doc = await self.doc(response_id, tenant, "input")
        uid = doc.uid
        items = [{"id": f"in_{uid}_{k}", **item, "status": "completed"} for k, item in enumerate(doc.json("input"))]
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


def too_long(response_id: str | None, why: str) -> ApiError:
    return ApiError(400, f"the conversation of previous_response_id `{response_id}` {why}: start a new one with "
                    "the turns it needs as `input`", param="previous_response_id", code="request_too_large")
