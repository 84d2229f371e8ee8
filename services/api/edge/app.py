"""The OpenAI-compatible HTTP API (FastAPI): endpoints of docs/design.md, "HTTP API". The routes, and the edge
every request passes first: the key, the body's size and pace (`Guard`), JSON and its nesting (`parse_body`); a
body then checks its own fields (services/api/answer/schemas/) and services/api/answer/service.py answers it."""

from __future__ import annotations

import asyncio
import os
import time
from contextlib import asynccontextmanager
from typing import Literal, TypeVar

import orjson
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from services.api import errors
from services.api.answer.limits import Limits
from services.api.answer.request.api_request import bare_uid
from services.api.answer.schemas.chat import ChatCompletionRequest
from services.api.answer.schemas.completions import CompletionRequest, GenerateRequest
from services.api.answer.schemas.submission import Budget
from services.api.answer.service import ApiService
from services.api.answer.sse import RAW_SEND
from services.api.batch_api.batch_runner import BatchRunner
from services.api.batch_api.batches import Batches, CreateBatch
from services.api.batch_api.files import Files
from services.api.edge.admin import AdminSocket, admin_socket_path
from services.api.errors import ApiError
from services.api.lora_api.adapters import Adapters, card_for
from services.api.lora_api.adapters import install as install_adapters
from services.api.multitenancy.tenancy import TENANT, Tenancy
from services.api.multitenancy.tenants import KeyCheckBusy, Tenant
from services.api.pooling_api.prefill import EmbeddingRequest, ScoreRequest
from services.api.responses_api.response_schemas import ResponseRequest
from services.api.responses_api.responses import Responses
from services.api.tokenize_api import tokenization
from shared.messages import TokenizerQuery
from shared.request_states import EndReason
from shared.settings import ApiSettings

OPEN_PATHS = ("/health", "/ready", "/metrics")
M = TypeVar("M", bound=BaseModel)
Body = ChatCompletionRequest | CompletionRequest | GenerateRequest | EmbeddingRequest | ScoreRequest


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over {limit} bytes (--max-body-bytes)", code="body_too_large",
                    close=True)


class BodyReader:
    """The app's `receive`: counts a body's bytes as they arrive, whatever the framing (a chunked body has no
    Content-Length), and waits at most `timeout` for each piece; past either the request is answered (413,
    408) and its connection closed. Once the body is whole it is the server's receive (disconnects)."""

    def __init__(self, receive, limit: int, timeout: float):
        self.receive, self.limit, self.timeout = receive, limit, timeout
        self.seen, self.whole = 0, False

    async def __call__(self):
        if self.whole:
            return await self.receive()
        try:
            async with asyncio.timeout(self.timeout):
                message = await self.receive()
        except TimeoutError:
            raise ApiError(408, f"no bytes of the request body came for {self.timeout:g} s (--body-timeout-s)",
                           code="body_timeout", close=True) from None
        if message["type"] != "http.request":
            self.whole = True
            return message
        self.seen += len(message.get("body", b""))
        if self.seen > self.limit:
            raise body_too_large(self.limit)
        self.whole = not message.get("more_body", False)
        return message


class Guard:
    """Pure ASGI middleware (it does not buffer streams): the bearer key's tenant
    (services/api/multitenancy/tenancy.py), the body's size and pace, and the last word on unexpected errors."""

    def __init__(self, app: FastAPI, settings: ApiSettings):
        self.app = app
        self.max_body, self.body_timeout = settings.max_body_bytes, settings.body_timeout_s
        self.service: ApiService = app.state.service
        self.tenancy: Tenancy = self.service.tenancy

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[RAW_SEND] = send  # streams send past the middleware stack (services/api/answer/sse.py)
        headers = dict(scope["headers"])
        error = await self.authenticate(scope, headers.get(b"authorization", b""))
        length = headers.get(b"content-length")
        if length and length.isdigit() and int(length) > self.max_body:
            error = body_too_large(self.max_body)
        if error:
            await error.response()(scope, receive, send)
            return
        try:
            await self.app(scope, BodyReader(receive, self.max_body, self.body_timeout), send)
        except Exception as e:  # answered with a 500 already (errors.install); Starlette raises it again
            errors.log_unexpected(scope, e)

    async def authenticate(self, scope: dict, auth: bytes) -> ApiError | None:
        """The key's tenant into the scope (services/api/multitenancy/tenancy.py `TENANT`), or the 401 or 403 of the
        request."""
        path = scope["path"]
        if path in OPEN_PATHS and not self.tenancy.needs_admin(path) and not (path == "/metrics" and auth):
            return None  # a key on /metrics is checked: an admin's shows the tenants' series
        scheme, _, key = auth.partition(b" ")
        try:
            tenant = await self.tenancy.ring.find(key.strip() if scheme.lower() == b"bearer" else None)
        except KeyCheckBusy:
            return ApiError(503, "too many API keys are being checked at once; retry", code="overloaded",
                            retry_after=1)
        if tenant is None:
            return ApiError(401, "invalid or missing API key", code="invalid_api_key")
        if self.tenancy.needs_admin(path) and not tenant.admin:
            return ApiError(403, f"`{path}` needs an admin key", code="admin_required")
        scope[TENANT] = tenant
        return None


def create_app(settings: ApiSettings) -> Guard:
    svc = ApiService(settings)

    control = AdminSocket(svc, admin_socket_path(settings.admin_socket, settings.port), settings.drain_timeout_s,
                          own_dir=not settings.admin_socket)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await svc.start()
        await adapters.register_configured()  # --lora-modules
        runner.start()
        try:
            await control.start()  # draining: a pod-local socket, no HTTP route (services/api/edge/admin.py)
            yield
        finally:
            await control.close()
            await runner.close()
            await responses.close()
            await files.close()
            await adapters.close()
            await svc.close()

    app = FastAPI(title="rsinfer", lifespan=lifespan)
    app.state.service = svc
    errors.install(app)
    adapters = install_adapters(app, svc)  # LoRA: load/unload routes, a request's adapter
    # (services/api/lora_api/adapters.py)
    add_generation_routes(app, svc)
    add_tokenizer_routes(app, svc, adapters)
    responses = Responses(svc)
    add_response_routes(app, svc, responses)
    files = Files(settings, svc.redis, svc.keys, svc.tenancy)
    batches = Batches(svc, adapters, responses, files)
    runner = BatchRunner(batches)  # this process's part in running batches (services/api/batch_api/batches.py)
    add_batch_routes(app, svc, files, batches)
    add_model_routes(app, svc, adapters)
    add_request_routes(app, svc)
    add_probe_routes(app, svc)
    return Guard(app, settings)


def add_generation_routes(app: FastAPI, svc: ApiService) -> None:
    """What generates: each body is parsed, then admitted and answered (services/api/answer/service.py)."""
    limits = svc.limits

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


def add_tokenizer_routes(app: FastAPI, svc: ApiService, adapters: Adapters) -> None:
    """vLLM's /tokenize and /detokenize, answered by the model's tokenizer stage
    (services/api/tokenize_api/tokenization.py): admitted like a request of one token, so a draining server or an
    unknown model refuse it (a query is not counted in the model's queue: no scheduler takes it, and the
    tokenizers read on past any backlog)."""
    limits = svc.limits

    async def ask(request: Request, body: tokenization.TokenizeRequest | tokenization.DetokenizeRequest, op: str):
        body.checked(svc)
        tenant, name = svc.tenancy.tenant_of(request), body.model or svc.admission.only_model()
        svc.tenancy.authorize(tenant, name)
        model, adapter = await adapters.target(name)  # an adapter shares its base's tokenizer
        svc.tenancy.authorize_adapter(tenant, adapter)
        await svc.admission.room(model, Budget(prompts=1, choices=1, max_tokens=1))
        now = time.time()
        query = TokenizerQuery(uid=svc.hub.new_uid(), model=model, pod=svc.pod, created_at=now,
                               deadline=now + svc.settings.request_timeout_s, op=op, **body.fields())
        request.scope[errors.UID] = query.uid
        async with svc.tenancy.admitted(tenant):  # a quota's concurrency and requests per minute
            return await tokenization.ask(svc, request, query, svc.tenancy.record_fields(tenant))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await ask(request, await parse_body(request, tokenization.TokenizeRequest, limits), "tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await ask(request, await parse_body(request, tokenization.DetokenizeRequest, limits), "detokenize")


def add_response_routes(app: FastAPI, svc: ApiService, responses: Responses) -> None:
    """The Responses API (services/api/responses_api/responses.py): create, read back (or stream again), cancel,
    delete."""

    @app.post("/v1/responses")
    async def create_response(request: Request):
        body = await parse_body(request, ResponseRequest, svc.limits)
        return await responses.create(request, body)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(request: Request, response_id: str, stream: bool = False,
                                starting_after: int | None = None):
        return await responses.retrieve(request, response_id, stream, starting_after)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str):
        return await responses.cancel(response_id, svc.tenancy.tenant_of(request))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str):
        return await responses.delete(response_id, svc.tenancy.tenant_of(request))

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(request: Request, response_id: str, limit: int = Query(20, ge=1, le=100),
                                   order: Literal["asc", "desc"] = "desc", after: str | None = None):
        return await responses.input_items(response_id, svc.tenancy.tenant_of(request), limit, order, after)


def add_batch_routes(app: FastAPI, svc: ApiService, files: Files, batches: Batches) -> None:
    """The Files and Batch APIs (services/api/batch_api/files.py, services/api/batch_api/batches.py)."""
    add_file_routes(app, svc, files)

    def tenant(request: Request) -> Tenant:
        return svc.tenancy.tenant_of(request)

    @app.post("/v1/batches")
    async def create_batch(request: Request):
        return await batches.create(await parse_body(request, CreateBatch, svc.limits), tenant(request))

    @app.get("/v1/batches")
    async def list_batches(request: Request, limit: int = Query(20, ge=1, le=100), after: str | None = None):
        return await batches.list(tenant(request), limit, after)

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(request: Request, batch_id: str):
        return await batches.get(batch_id, tenant(request))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str):
        return await batches.cancel(batch_id, tenant(request))


def add_file_routes(app: FastAPI, svc: ApiService, files: Files) -> None:
    def tenant(request: Request) -> Tenant:
        return svc.tenancy.tenant_of(request)

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


def add_model_routes(app: FastAPI, svc: ApiService, adapters: Adapters) -> None:
    @app.get("/v1/models")
    async def models(request: Request):
        """Every model requests are taken for (that the key may use), with its `state`: `ready`, or with no
        worker in some stage (`partial`, `scaled_to_zero`), when its requests wait for workers."""
        snap = svc.stages.snapshot
        cards = [snap.model_card(m) for m in snap.known()] + await adapters.cards(snap)
        tenant = svc.tenancy.tenant_of(request)
        return {"object": "list", "data": [card_for(c, tenant.admin) for c in cards
                                           if svc.tenancy.may_use(tenant, c["id"])]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str, request: Request):
        snap = svc.stages.snapshot
        if model not in snap.servable() and time.time() - snap.at > 0.25:
            snap = await svc.stages.refresh()  # it may have been declared, or its workers come, since then
        card = await adapters.model_card(snap, model)  # a base model's, or a LoRA adapter's
        tenant = svc.tenancy.tenant_of(request)
        if card is None or not svc.tenancy.may_use(tenant, model):
            raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return card_for(card, tenant.admin)


def add_request_routes(app: FastAPI, svc: ApiService) -> None:
    """A request by its uid (or response id), submitted by any API process: its record, its abort, its stream;
    only its tenant's keys and admin keys find it."""

    @app.get("/v1/requests/{uid}")
    async def get_request(uid: str, request: Request):
        record = await _record(svc, uid, svc.tenancy.tenant_of(request))
        return {"id": bare_uid(uid), "object": "request", **record}

    @app.delete("/v1/requests/{uid}")
    async def abort_request(uid: str, request: Request):
        record = await _record(svc, uid, svc.tenancy.tenant_of(request))
        await svc.store.abort_now(bare_uid(uid), EndReason.API, record.get("model"))
        return {"id": bare_uid(uid), "object": "request.abort", "aborted": True}

    @app.get("/v1/requests/{uid}/stream")
    async def reattach(uid: str, request: Request):
        record = await _record(svc, uid, svc.tenancy.tenant_of(request))
        if record.get("kind") in tokenization.OPS:
            raise ApiError(400, f"`{uid}` is a /{record['kind']} request: it has no stream to follow", param="uid")
        request.scope[errors.UID] = bare_uid(uid)
        return await svc.reattach(request, uid, record, request.headers.get("last-event-id"))


def add_probe_routes(app: FastAPI, svc: ApiService) -> None:
    """What needs no key (OPEN_PATHS): liveness, readiness, metrics (with keys configured, its series labelled
    with tenants' names only for an admin key)."""

    @app.get("/health")
    async def health():
        """`pid`: which process answers (`rsinfer up` waits for its own API, not another server on the port)."""
        return {"status": "ok", "pid": os.getpid()}

    @app.get("/ready")
    async def ready():
        """This process can take requests: Redis answers and it is not draining. The models' workers are
        not needed (a request waits for them), so a model scaled to zero keeps the API in its Service;
        `models` shows the live workers per stage of each model for operators."""
        snap = svc.stages.snapshot
        body = {"ready": snap.ready() and not svc.draining, "redis": snap.redis_ok, "draining": svc.draining,
                "models": snap.models}
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        return Response(svc.metrics.render(svc.tenancy.sees_tenant_metrics(request)), media_type=CONTENT_TYPE_LATEST)


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


async def _record(svc: ApiService, uid: str, tenant: Tenant) -> dict:
    """The request's record, or a 404 if there is none or another tenant made it (not a 403: the uid is not
    confirmed to exist)."""
    record = await svc.store.record(bare_uid(uid))
    if not record or not svc.tenancy.owns(tenant, record):
        raise ApiError(404, f"no request `{uid}` (finished requests are kept for the TTL)", param="uid",
                       code="request_not_found")
    return record
