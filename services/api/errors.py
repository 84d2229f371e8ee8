"""Every HTTP error in OpenAI's shape {"error": {"message", "type", "param", "code"}} with the right
status: 400 for any bad input (never FastAPI's 422), 401, 404, 408, 413, 431, 429/503 with Retry-After, 504;
`x-should-retry: false` on those a retry cannot fix (every 4xx but 408, 409 and 429, and the deadline's 504).

An unexpected error is a 500 and one log line with the request's uid (`log_unexpected`); its traceback is
logged at DEBUG only."""

from __future__ import annotations

import contextlib
import logging
import traceback
from dataclasses import KW_ONLY, dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
         410: "invalid_request_error", 413: "invalid_request_error", 431: "invalid_request_error",
         429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}
# Anthropic's error types by status, on its routes (`anthropic_path`): 503 (shutting down, Redis away) is its
# 529 overloaded_error, a timeout its timeout_error; and by OpenAI's type, for an error event in a stream.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "timeout_error", 410: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}
ANTHROPIC_OF_OPENAI = {"invalid_request_error": "invalid_request_error", "authentication_error": "authentication_error",
                       "permission_error": "permission_error", "rate_limit_error": "rate_limit_error",
                       "service_unavailable": "overloaded_error", "timeout": "timeout_error"}
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
UID = "rsinfer.uid"  # scope key: the uid of the request a handler submitted (services/api/edge/app.py), for logs


# Extensions other servers accept that rsinfer does not (yet): refused with what they are, not just "unknown".
UNSUPPORTED_EXTENSIONS = {
    **dict.fromkeys(("guided_decoding_backend", "structured_outputs", "guided_whitespace_pattern"),
                    "structured outputs take `response_format`, `regex`, `json`, `ebnf` or vLLM's `guided_*` "
                    "fields; the backend is llguidance"),
    "structural_tag": "structural tags are not supported; tools with tool_choice \"required\" are constrained",
    **dict.fromkeys(("chat_template", "documents", "mm_processor_kwargs"),
                    "custom chat templates are not supported (chat_template_kwargs are)"),
    "lora_request": "name a LoRA adapter as `model` (or in SGLang's `lora_path`); adapters are loaded with "
                    "POST /v1/load_lora_adapter or --lora-modules",
    **dict.fromkeys(("include_stop_str_in_output", "no_stop_trim"), "stop strings are always removed from the "
                    "output"),
    "spaces_between_special_tokens": "special tokens are decoded as the tokenizer joins them",
    "return_hidden_states": "hidden states are not returned",
    "prompt_logprobs": "prompt logprobs are not supported",
}


class BadRequest(ValueError):
    """A request that is well-formed JSON but cannot be served as asked (-> 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ShapeError(ValueError):
    """A union field given a value of none of its shapes: the refusal is one sentence naming the field and what it
    takes (`as_api_error` adds the field's place in the body)."""

    def __init__(self, shapes: str):
        super().__init__(f"must be {shapes}")
        self.shapes = shapes


@dataclass(eq=False)
class ApiError(Exception):
    """An HTTP error: OpenAI's error object (`message`, `type`, `param`, `code`) and how it is answered (`status`,
    `retry_after`, `close`)."""

    status: int
    message: str
    _: KW_ONLY
    param: str | None = None
    code: str | None = None
    type: str | None = None  # by default the status's (TYPES)
    retry_after: float | None = None  # seconds, for a Retry-After header
    close: bool = False  # end the connection after the answer (a body not read to its end)
    headers: dict[str, str] | None = None  # more headers of the answer (a 429's x-ratelimit-*)

    def __post_init__(self) -> None:
        super().__init__(self.message)
        self.type = self.type or TYPES.get(self.status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @property
    def retryable(self) -> bool:
        """Whether the same request may succeed if sent again: a timeout reading it (408), a conflict (409), a
        limit (429) or a failure of the server (5xx); never a request refused for what it is (4xx), nor one
        that ran out its own deadline (504: a retry would run the whole generation again)."""
        return self.status in (408, 409, 429) or (self.status >= 500 and self.status != 504)

    def header_pairs(self) -> dict[str, str]:
        """The answer's headers: Retry-After; `x-should-retry: false` where a retry cannot help (OpenAI's SDKs,
        which retry 408, 409, 429 and 5xx by default, honour it)."""
        headers = {"Retry-After": str(max(1, round(self.retry_after)))} if self.retry_after else {}
        if not self.retryable:
            headers["x-should-retry"] = "false"
        if self.close:
            headers["Connection"] = "close"
        headers.update(self.headers or {})
        return headers

    def response(self, anthropic: bool = False) -> JSONResponse:
        """`anthropic`: in Anthropic's shape and statuses (its routes', `anthropic_path`)."""
        if anthropic:
            body = {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(self.status, "api_error"),
                                               "message": self.named_message()}}
            status = 529 if self.status == 503 else self.status
            return JSONResponse(body, status_code=status, headers=self.header_pairs() or None)
        return JSONResponse(self.body(), status_code=self.status, headers=self.header_pairs() or None)

    def named_message(self) -> str:
        """The message naming its field (Anthropic's shape has no `param`)."""
        if self.param and self.param not in self.message:
            return f"{self.param}: {self.message}"
        return self.message


def anthropic_path(path: str) -> bool:
    """Whether a route answers errors in Anthropic's shape (its Messages API, services/api/messages_api/)."""
    return path in ANTHROPIC_PATHS


def anthropic_error(err: dict) -> dict:
    """An error object in OpenAI's shape (ApiError.body()["error"]) as Anthropic's error event of a stream."""
    message = err.get("message", "")
    if err.get("param") and err["param"] not in message:
        message = f"{err['param']}: {message}"
    return {"type": "error", "error": {"type": ANTHROPIC_OF_OPENAI.get(err.get("type") or "", "api_error"),
                                       "message": message}}


def redis_down() -> ApiError:
    return ApiError(503, "the request broker (Redis) is unreachable; retry shortly", code="broker_unavailable",
                    retry_after=1)


# Redis at its maxmemory (noeviction) refuses writes until the requests in it end and their keys expire: that
# takes longer than a blip of the connection.
BROKER_FULL_RETRY_S = 2


def broker_full() -> ApiError:
    """Redis refused a write for memory (OOM, `maxmemory` with `noeviction`): backpressure. Nothing of the
    request was queued (services/api/answer/request/single.py writes it in one transaction)."""
    return ApiError(503, "the request broker (Redis) is full; retry shortly", code="broker_full",
                    retry_after=BROKER_FULL_RETRY_S)


def broker_busy() -> ApiError:
    """Every connection of this process's Redis pool stayed in use past the pool's wait (shared/redis_conn.py
    `connect`): this process is overloaded, Redis is not down. Nothing of the request was queued."""
    return ApiError(503, "this server is overloaded (all its broker connections are busy); retry shortly",
                    code="overloaded", retry_after=1)


def broker_error(exc: RedisError) -> ApiError:
    """The answer for a Redis error at the edge: full, busy (the pool ran dry) or unreachable."""
    if isinstance(exc, OutOfMemoryError):
        return broker_full()
    # redis-py's BlockingConnectionPool raises ConnectionError("No connection available.") from its wait's
    # timeout: a storm holding the pool's connections, not a broker that cannot be reached.
    if isinstance(exc, RedisConnectionError) and isinstance(exc.__cause__, TimeoutError) \
            and str(exc).startswith("No connection available"):
        return broker_busy()
    return redis_down()


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if first.get("type") == "extra_forbidden":
        name = ".".join(loc)
        why = UNSUPPORTED_EXTENSIONS.get(loc[-1] if loc else "")
        return (f"`{name}` is not supported: {why}" if why else
                f"Unrecognized request argument supplied: {name}"), (loc[0] if loc else None)
    ctx_error = (first.get("ctx") or {}).get("error")
    if isinstance(ctx_error, BadRequest):
        return str(ctx_error), ctx_error.param
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    where = ".".join(loc)
    if isinstance(ctx_error, ShapeError):  # a union field: one sentence, not an error per member of the union
        return f"`{where}` must be {ctx_error.shapes}", (loc[0] if loc else None)
    return (f"{where}: {msg}" if where else msg), (loc[0] if loc else None)


def as_api_error(exc: Exception) -> ApiError | None:
    """The HTTP error a body's own checks raised (what the handlers below answer), for work that has no HTTP
    request of its own (a batch's lines, services/api/batch_api/batches.py); None for anything else."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValidationError):
        exc = RequestValidationError(exc.errors())
    if isinstance(exc, RequestValidationError):
        message, param = _validation_message(exc)
        return ApiError(400, message, param=param)
    if isinstance(exc, BadRequest):
        return ApiError(400, str(exc), param=exc.param)
    return None


def install(app: FastAPI) -> None:
    def answer(request: Request, error: ApiError) -> JSONResponse:
        return error.response(anthropic_path(request.scope.get("path", "")))

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return answer(request, ApiError(400, message, param=param))

    @app.exception_handler(BadRequest)
    async def _bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        return answer(request, ApiError(400, str(exc), param=exc.param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return answer(request, ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(RedisError)
    async def _redis(request: Request, exc: RedisError) -> JSONResponse:
        log.warning("redis error: %s", exc)
        return answer(request, broker_error(exc))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log_unexpected(request.scope, exc)
        return answer(request, ApiError(500, "internal error", type="server_error"))


def log_unexpected(scope: dict, exc: BaseException) -> None:
    """One line per unexpected error, with the request's uid and where it was raised, however many layers see
    it (the 500 handler, then services/api/edge/app.py `Guard`, as Starlette raises it again for the server)."""
    if getattr(exc, "_rsinfer_logged", False):
        return
    with contextlib.suppress(AttributeError):
        exc._rsinfer_logged = True  # type: ignore[attr-defined]
    frame = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" at {frame[0].filename}:{frame[0].lineno}" if frame else ""
    log.error("uid=%s unexpected error on %s %s: %s: %s%s", scope.get(UID, "-"), scope.get("method", ""),
              scope.get("path", ""), type(exc).__name__, str(exc)[:500], where)
    log.debug("uid=%s traceback", scope.get(UID, "-"), exc_info=exc)
