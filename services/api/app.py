"""The OpenAI-compatible HTTP API (FastAPI): endpoints of docs/design.md, "HTTP API"."""

from __future__ import annotations

import hmac
import time
from contextlib import asynccontextmanager
from typing import TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from services.api import errors
from services.api.admin import AdminSocket, admin_socket_path
from services.api.errors import ApiError
from services.api.formats import ChatFormat, CompletionFormat, GenerateFormat
from services.api.gateway import bare_uid
from services.api.schemas import ChatCompletionRequest, CompletionRequest, GenerateRequest
from services.api.service import ApiService
from services.api.sse import RAW_SEND
from shared.settings import ApiSettings

OPEN_PATHS = ("/health", "/ready", "/metrics")
MAX_BODY_BYTES = 16 << 20
M = TypeVar("M", bound=BaseModel)


class Guard:
    """Pure ASGI middleware (it does not buffer streams): bearer-key check and body size limit."""

    def __init__(self, app: FastAPI, api_key: str | None):
        self.app, self.api_key = app, api_key
        self.service: ApiService = app.state.service

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope[RAW_SEND] = send  # streams send past the middleware stack (services/api/sse.py)
            headers = dict(scope["headers"])
            error = None
            auth = headers.get(b"authorization", b"")
            expected = f"Bearer {self.api_key}".encode()
            keyed = bool(self.api_key) and hmac.compare_digest(auth, expected)
            if self.api_key and scope["path"] not in OPEN_PATHS and not keyed:
                error = ApiError(401, "invalid or missing API key", code="invalid_api_key")
            length = headers.get(b"content-length")
            if length and length.isdigit() and int(length) > MAX_BODY_BYTES:
                error = ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")
            if error:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(settings: ApiSettings) -> Guard:
    svc = ApiService(settings)

    control = AdminSocket(svc, admin_socket_path(settings.admin_socket, settings.port), settings.drain_timeout_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await svc.start()
        try:
            await control.start()  # draining: a pod-local socket, no HTTP route (services/api/admin.py)
            yield
        finally:
            await control.close()
            await svc.close()

    app = FastAPI(title="rsinfer", lifespan=lifespan)
    app.state.service = svc
    errors.install(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse_body(request, ChatCompletionRequest)
        await svc.admit(body.model)
        job = svc.new_job(body.model, body.timeout, body.background, params=body.params(),
                          messages=body.chat_messages(), add_generation_prompt=body.add_generation_prompt,
                          continue_final_message=body.continue_final_message, tools=body.tool_dicts(),
                          tool_choice=body.tool_choice_struct(), chat_template_kwargs=body.chat_template_kwargs or {},
                          priority=body.priority)
        parse = answer_parsing(svc.stages.snapshot.model_info(body.model), body.parses_tool_calls)
        fmt = ChatFormat(f"chatcmpl-{job.uid}", body.model, int(job.created_at), job.params.n,
                         job.params.logprobs, body.include_usage, parse)
        fmt.continuous_usage = body.continuous_usage
        annotations = {**body.annotations(), **({"parse": orjson.dumps(parse).decode()} if parse else {})}
        return await svc.answer(request, [job], fmt, bool(body.stream), "chat", annotations)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest)
        await svc.admit(body.model)
        params = body.params()
        jobs = [svc.new_job(body.model, body.timeout, body.background, params=params, prompt=prompt, input_ids=ids,
                            suffix=body.suffix, priority=body.priority) for prompt, ids in body.prompts()]
        fmt = CompletionFormat(f"cmpl-{jobs[0].uid}", body.model, int(jobs[0].created_at), len(jobs) * params.n,
                               body.logprobs is not None, body.include_usage, echo=bool(body.echo),
                               best_of=params.n, keep=body.n or 1)
        fmt.continuous_usage = body.continuous_usage
        annotations = {**body.annotations(), **({"echo": "1"} if body.echo else {})}
        return await svc.answer(request, jobs, fmt, bool(body.stream), "completion", annotations)

    @app.post("/generate")
    async def generate(request: Request):
        body = await parse_body(request, GenerateRequest)
        model = body.model or _only_model(svc)
        await svc.admit(model)
        job = svc.new_job(model, None, False, params=body.params(), prompt=body.text, input_ids=body.input_ids,
                          priority=body.priority)
        fmt = GenerateFormat(job.uid, model, int(job.created_at))
        return await svc.answer(request, [job], fmt, body.stream, "generate", endpoint="generate")

    @app.get("/v1/models")
    async def models():
        """Every model requests are taken for, with its `state`: `ready`, or with no worker in some stage
        (`partial`, `scaled_to_zero`), when its requests wait for workers."""
        snap = svc.stages.snapshot
        return {"object": "list", "data": [snap.model_card(m) for m in snap.known()]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        snap = svc.stages.snapshot
        if model not in snap.servable() and time.time() - snap.at > 0.25:
            snap = await svc.stages.refresh()  # it may have been declared, or its workers come, since then
        if model not in snap.models:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return snap.model_card(model)

    @app.get("/v1/requests/{uid}")
    async def get_request(uid: str):
        record = await _record(svc, uid)
        return {"id": bare_uid(uid), "object": "request", **record}

    @app.delete("/v1/requests/{uid}")
    async def abort_request(uid: str):
        from shared import records

        record = await _record(svc, uid)
        await records.abort_now(svc.redis, svc.keys, bare_uid(uid), "api", settings.request_ttl_s, record.get("model"))
        return {"id": bare_uid(uid), "object": "request.abort", "aborted": True}

    @app.get("/v1/requests/{uid}/stream")
    async def reattach(uid: str, request: Request):
        record = await _record(svc, uid)
        return await svc.reattach(request, uid, record, request.headers.get("last-event-id"))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

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
    async def metrics():
        return Response(svc.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return Guard(app, settings.api_key)


async def parse_body(request: Request, model: type[M]) -> M:
    """JSON whatever the Content-Type says (`curl -d` sends form-urlencoded); errors become 400s."""
    raw = await request.body()
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def answer_parsing(model_info: dict, tools: bool) -> dict:
    """How chat answers of this model are split (what its tokenizer detected): reasoning, and tool calls
    when the request offers tools and lets the model call them."""
    out: dict = {}
    if model_info.get("reasoning_parser", "none") != "none":
        out["reasoning"] = model_info["reasoning_parser"]
    if tools and model_info.get("tool_call_parser", "none") != "none":
        out["tools"] = model_info["tool_call_parser"]
    return out


def _only_model(svc: ApiService) -> str:
    models = svc.stages.snapshot.known()
    if len(models) != 1:
        raise ApiError(400, "give `model`: this server serves " + (", ".join(models) or "no model"), param="model")
    return models[0]


async def _record(svc: ApiService, uid: str) -> dict:
    raw = await svc.redis.hgetall(svc.keys.request(bare_uid(uid)))
    if not raw:
        raise ApiError(404, f"no request `{uid}` (finished requests are kept for the TTL)", param="uid",
                       code="request_not_found")
    return {k.decode(): v.decode() for k, v in raw.items()}
