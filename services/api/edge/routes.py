"""The API's routes: each parses its body (services/api/edge/app.py `parse_body`) and hands it to the answer path
(services/api/answer/service.py) or to a feature's API (services/api/*_api/), which the app built
(services/api/edge/app.py `create_app`)."""

from __future__ import annotations

import os
import time
from typing import Literal, TypeVar

import orjson
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from services.api import errors
from services.api.answer.admission import Admission
from services.api.answer.collaborators import ApiContext
from services.api.answer.limits import Limits
from services.api.answer.request.api_request import bare_uid
from services.api.answer.schemas.chat import ChatCompletionRequest
from services.api.answer.schemas.completions import CompletionRequest, GenerateRequest
from services.api.answer.service import ApiService
from services.api.batch_api.batches import Batches, CreateBatch
from services.api.batch_api.files import Files
from services.api.errors import ApiError
from services.api.lora_api.adapters import Adapters, LoadLoraAdapter, UnloadLoraAdapter, card_for
from services.api.messages_api.message_format import message_format_of_record
from services.api.messages_api.message_schemas import CountTokensRequest, MessagesRequest
from services.api.messages_api.message_service import Messages
from services.api.multitenancy.tenants import Tenant
from services.api.pooling_api.prefill import EmbeddingRequest, ScoreRequest
from services.api.responses_api.response_schemas import ResponseRequest
from services.api.responses_api.responses import Responses
from services.api.tokenize_api import tokenization
from shared.request_states import EndReason

M = TypeVar("M", bound=BaseModel)
Body = ChatCompletionRequest | CompletionRequest | GenerateRequest | EmbeddingRequest | ScoreRequest


def add_adapter_routes(app: FastAPI, ctx: ApiContext, adapters: Adapters) -> None:
    """vLLM's LoRA adapter routes (services/api/lora_api/adapters.py loads and unloads)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await parse_body(request, LoadLoraAdapter, ctx.limits)
        await adapters.load(body)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await parse_body(request, UnloadLoraAdapter, ctx.limits)
        await adapters.unload(body)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def add_generation_routes(app: FastAPI, svc: ApiService) -> None:
    """What generates: each body is parsed, then admitted and answered (services/api/answer/service.py)."""
    limits = svc.ctx.limits

    def route(model: type[Body]):
        async def handle(request: Request):
            return await svc.answer(request, await parse_body(request, model, limits))
        return handle

    # /v1/embeddings and /v1/score are prefill-only (services/api/pooling_api/prefill.py): one job per input, answered
    # by the engine after its prefill
    for path, model in (("/v1/chat/completions", ChatCompletionRequest), ("/v1/completions", CompletionRequest),
                        ("/generate", GenerateRequest), ("/v1/embeddings", EmbeddingRequest),
                        ("/v1/score", ScoreRequest)):
        app.post(path, name=path.rsplit("/", 1)[1])(route(model))


def add_tokenizer_routes(app: FastAPI, ctx: ApiContext, admission: Admission) -> None:
    """vLLM's /tokenize and /detokenize, answered by the model's tokenizer stage
    (services/api/tokenize_api/tokenization.py `query`), admitted like a request of one token."""
    limits = ctx.limits

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await parse_body(request, tokenization.TokenizeRequest, limits)
        return await tokenization.query(ctx, admission, request, body, "tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await parse_body(request, tokenization.DetokenizeRequest, limits)
        return await tokenization.query(ctx, admission, request, body, "detokenize")


def add_response_routes(app: FastAPI, ctx: ApiContext, responses: Responses) -> None:
    """The Responses API (services/api/responses_api/responses.py): create, read back (or stream again), cancel,
    delete."""

    @app.post("/v1/responses")
    async def create_response(request: Request):
        body = await parse_body(request, ResponseRequest, ctx.limits)
        return await responses.create(request, body)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(request: Request, response_id: str, stream: bool = False,
                                starting_after: int | None = None):
        return await responses.retrieve(request, response_id, stream, starting_after)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str):
        return await responses.cancel(response_id, ctx.tenancy.tenant_of(request))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str):
        return await responses.delete(response_id, ctx.tenancy.tenant_of(request))

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(request: Request, response_id: str, limit: int = Query(20, ge=1, le=100),
                                   order: Literal["asc", "desc"] = "desc", after: str | None = None):
        return await responses.input_items(response_id, ctx.tenancy.tenant_of(request), limit, order, after)


def add_message_routes(app: FastAPI, ctx: ApiContext, messages: Messages) -> None:
    """Anthropic's Messages API (services/api/messages_api/message_service.py); its errors in Anthropic's shape
    (services/api/errors.py `anthropic_path`)."""

    @app.post("/v1/messages")
    async def create_message(request: Request):
        return await messages.create(request, await parse_body(request, MessagesRequest, ctx.limits))

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(request: Request):
        return await messages.count_tokens(request, await parse_body(request, CountTokensRequest, ctx.limits))


def add_batch_routes(app: FastAPI, ctx: ApiContext, files: Files, batches: Batches) -> None:
    """The Files and Batch APIs (services/api/batch_api/files.py, services/api/batch_api/batches.py)."""
    add_file_routes(app, ctx, files)

    def tenant(request: Request) -> Tenant:
        return ctx.tenancy.tenant_of(request)

    @app.post("/v1/batches")
    async def create_batch(request: Request):
        return await batches.create(await parse_body(request, CreateBatch, ctx.limits), tenant(request))

    @app.get("/v1/batches")
    async def list_batches(request: Request, limit: int = Query(20, ge=1, le=100), after: str | None = None):
        return await batches.list(tenant(request), limit, after)

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(request: Request, batch_id: str):
        return await batches.get(batch_id, tenant(request))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str):
        return await batches.cancel(batch_id, tenant(request))


def add_file_routes(app: FastAPI, ctx: ApiContext, files: Files) -> None:
    def tenant(request: Request) -> Tenant:
        return ctx.tenancy.tenant_of(request)

    @app.post("/v1/files")
    async def upload_file(request: Request):
        return await files.upload(request, tenant(request))

    @app.get("/v1/files")
    async def list_files(request: Request, purpose: str | None = None, limit: int = Query(10_000, ge=1, le=10_000),
                         order: Literal["asc", "desc"] = "desc", after: str | None = None):
        return await files.list(tenant(request), purpose, limit, order, after)

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(request: Request, file_id: str):
        return await files.get(file_id, tenant(request))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str):
        return Response(await files.content(file_id, tenant(request)), media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str):
        return await files.delete(file_id, tenant(request))


def add_model_routes(app: FastAPI, ctx: ApiContext, adapters: Adapters) -> None:
    @app.get("/v1/models")
    async def models(request: Request):
        """Every model requests are taken for (that the key may use), with its `state`: `ready`, or with no
        worker in some stage (`partial`, `scaled_to_zero`), when its requests wait for workers."""
        snap = ctx.stages.snapshot
        cards = [snap.model_card(m) for m in snap.known()] + await adapters.cards(snap)
        tenant = ctx.tenancy.tenant_of(request)
        return {"object": "list", "data": [card_for(c, tenant.admin) for c in cards
                                           if ctx.tenancy.may_use(tenant, c["id"])]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str, request: Request):
        snap = ctx.stages.snapshot
        if model not in snap.servable() and time.time() - snap.at > 0.25:
            snap = await ctx.stages.refresh()  # it may have been declared, or its workers come, since then
        card = await adapters.model_card(snap, model)  # a base model's, or a LoRA adapter's
        tenant = ctx.tenancy.tenant_of(request)
        if card is None or not ctx.tenancy.may_use(tenant, model):
            raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return card_for(card, tenant.admin)


def add_request_routes(app: FastAPI, svc: ApiService) -> None:
    """A request by its uid (or response id), submitted by any API process: its record, its abort, its stream;
    only its tenant's keys and admin keys find it."""
    ctx = svc.ctx

    @app.get("/v1/requests/{uid}")
    async def get_request(uid: str, request: Request):
        record = await _record(ctx, uid, ctx.tenancy.tenant_of(request))
        return {"id": bare_uid(uid), "object": "request", **record}

    @app.delete("/v1/requests/{uid}")
    async def abort_request(uid: str, request: Request):
        record = await _record(ctx, uid, ctx.tenancy.tenant_of(request))
        await ctx.store.abort_now(bare_uid(uid), EndReason.API, record.get("model"))
        return {"id": bare_uid(uid), "object": "request.abort", "aborted": True}

    @app.get("/v1/requests/{uid}/stream")
    async def reattach(uid: str, request: Request):
        record = await _record(ctx, uid, ctx.tenancy.tenant_of(request))
        if record.get("kind") in tokenization.OPS:
            raise ApiError(400, f"`{uid}` is a /{record['kind']} request: it has no stream to follow", param="uid")
        request.scope[errors.UID] = bare_uid(uid)
        fmt = message_format_of_record(record, bare_uid(uid)) if record.get("kind") == "message" else None
        return await svc.reattach(request, uid, record, request.headers.get("last-event-id"), fmt)


def add_probe_routes(app: FastAPI, ctx: ApiContext, worker: dict | None = None) -> None:
    """What needs no key (services/api/edge/app.py OPEN_PATHS): liveness, readiness, metrics (with keys configured,
    its series labelled with tenants' names only for an admin key)."""

    @app.get("/health")
    async def health():
        """`pid`: which process answers (`rsinfer up` waits for its own API, not another server on the port); one
        of `--api-workers`' adds `worker` (its index) and `group` (its supervisor's pid)."""
        return {"status": "ok", "pid": os.getpid(), **(worker or {})}

    @app.get("/ready")
    async def ready():
        """This process can take requests: Redis answers and it is not draining. The models' workers are
        not needed (a request waits for them), so a model scaled to zero keeps the API in its Service;
        `models` shows the live workers per stage of each model for operators."""
        snap = ctx.stages.snapshot
        draining = ctx.drain.draining
        body = {"ready": snap.ready() and not draining, "redis": snap.redis_ok, "draining": draining,
                "models": snap.models}
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        return Response(ctx.metrics.render(ctx.tenancy.sees_tenant_metrics(request)), media_type=CONTENT_TYPE_LATEST)


async def parse_body(request: Request, model: type[M], limits: Limits) -> M:
    """JSON whatever the Content-Type says (`curl -d` sends form-urlencoded); errors become 400s."""
    raw = await request.body()
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    limits.nesting(raw, data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


async def _record(ctx: ApiContext, uid: str, tenant: Tenant) -> dict:
    """The request's record, or a 404 if there is none or another tenant made it (not a 403: the uid is not
    confirmed to exist)."""
    record = await ctx.store.record(bare_uid(uid))
    if not record or not ctx.tenancy.owns(tenant, record):
        raise ApiError(404, f"no request `{uid}` (finished requests are kept for the TTL)", param="uid",
                       code="request_not_found")
    return record
