"""The OpenAI-compatible HTTP API (FastAPI): endpoints of docs/design.md, "HTTP API". The app (`create_app`: the
answer path, the feature APIs and their routes, services/api/edge/routes.py), and the edge every request passes
first: the key, the body's size and pace (`Guard`), JSON and its nesting (services/api/edge/routes.py
`parse_body`); a body then checks its own fields (services/api/answer/schemas/) and services/api/answer/service.py
answers it."""

from __future__ import annotations

import asyncio
import logging
import os
from contextlib import asynccontextmanager

from fastapi import FastAPI

from services.api import errors
from services.api.answer.service import ApiService
from services.api.answer.sse import RAW_SEND
from services.api.batch_api.batch_runner import BatchRunner
from services.api.batch_api.batches import Batches
from services.api.batch_api.files import Files
from services.api.edge import routes
from services.api.edge.admin import AdminSocket, admin_socket_path
from services.api.errors import ApiError
from services.api.lora_api.adapters import Adapters, LoraCollector
from services.api.messages_api.message_service import Messages
from services.api.multitenancy.tenancy import TENANT, Tenancy
from services.api.multitenancy.tenants import KeyCheckBusy
from services.api.responses_api.responses import Responses
from shared import heap
from shared.settings import ApiSettings

log = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/ready", "/metrics")


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
        self.tenancy: Tenancy = self.service.ctx.tenancy

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[RAW_SEND] = send  # streams send past the middleware stack (services/api/answer/sse.py)
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization") or (b"Bearer " + headers[b"x-api-key"] if b"x-api-key" in headers
                                                   else b"")  # Anthropic's clients send their key as x-api-key
        error = await self.authenticate(scope, auth)
        length = headers.get(b"content-length")
        if length and length.isdigit() and int(length) > self.max_body:
            error = body_too_large(self.max_body)
        if error:
            await error.response(errors.anthropic_path(scope["path"]))(scope, receive, send)
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


def create_app(settings: ApiSettings, worker: int | None = None) -> Guard:
    """`worker`: which of `--api-workers`' processes this is (rsinfer/api_workers.py), None where it is the one."""
    svc = ApiService(settings)
    ctx = svc.ctx
    control = AdminSocket(ctx, admin_socket_path(settings.admin_socket, settings.port, worker),
                          settings.drain_timeout_s, own_dir=not settings.admin_socket)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await svc.start()
        await adapters.register_configured()  # --lora-modules
        runner.start()
        heap.freeze_startup("api")
        try:
            try:
                await control.start()  # draining: a pod-local socket, no HTTP route (services/api/edge/admin.py)
            except Exception as e:  # said now: uvicorn's traceback comes only once the closes below are done
                log.error("api not started: %s", e)
                raise
            yield
        finally:
            await control.close()
            await runner.close()
            await responses.close()
            await files.close()
            await adapters.close()
            await svc.close()

    # rsinfer traces a request across its stages itself (shared/tracing.py); FastAPI's own telemetry would add
    # server spans beside those and, off, still look up the global providers and the environment per request
    app = FastAPI(title="rsinfer", lifespan=lifespan, telemetry={"tracing": False, "metrics": False, "logs": False})
    app.state.service = svc
    errors.install(app)
    adapters = Adapters(ctx)  # LoRA: load and unload, the adapters' cards (services/api/lora_api/adapters.py)
    ctx.metrics.add_collector(LoraCollector(ctx.stages))
    routes.add_adapter_routes(app, ctx, adapters)
    routes.add_generation_routes(app, svc)
    routes.add_tokenizer_routes(app, ctx, svc.admission)
    responses = Responses(ctx, svc)
    routes.add_response_routes(app, ctx, responses)
    routes.add_message_routes(app, ctx, Messages(ctx, svc))
    files = Files(settings, ctx.redis, ctx.keys, ctx.tenancy)
    batches = Batches(ctx, svc, responses, files)
    runner = BatchRunner(batches)  # this process's part in running batches (services/api/batch_api/batches.py)
    routes.add_batch_routes(app, ctx, files, batches)
    routes.add_model_routes(app, ctx, adapters)
    routes.add_request_routes(app, svc)
    routes.add_probe_routes(app, ctx, {} if worker is None else {"worker": worker, "group": os.getppid()})
    return Guard(app, settings)
