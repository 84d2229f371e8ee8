"""An unexpected error is one log line with the request's uid, never two tracebacks (issue 18, item 7)."""

from __future__ import annotations

import asyncio
import logging
import types

import httpx
import pytest

from services.api.answer.sse import SSEResponse
from services.api.edge.app import create_app
from services.api.errors import UID
from shared.settings import ApiSettings

pytestmark = pytest.mark.timeout(30)
DEAD_REDIS = "redis://127.0.0.1:1/0"


def error_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_500_is_one_log_line_with_the_uid(caplog):
    """An unexpected error answers 500 and logs one line naming the request; Starlette's raising it again for
    the server (which logged a second traceback) stops at the Guard."""
    app = create_app(ApiSettings(redis_url=DEAD_REDIS))
    svc = app.service

    async def admit(*_a, **_k):  # taken, with its uid (services/api/answer/admission.py), no Redis needed
        return types.SimpleNamespace(uid="u-1", submission=types.SimpleNamespace(stream=False, fmt=None))

    async def open_request(*_a, **_k):
        raise RuntimeError("boom")

    svc.admission.admit, svc.requests.open = admit, open_request
    caplog.set_level(logging.DEBUG)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=True)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
        resp = await client.post("/v1/chat/completions", json={"model": "m", "messages": [
            {"role": "user", "content": "hi"}], "max_tokens": 1})
    assert resp.status_code == 500 and resp.json()["error"]["type"] == "server_error"
    errors = error_lines(caplog)
    assert len(errors) == 1, [r.getMessage() for r in errors]
    line = errors[0].getMessage()
    assert line.startswith("uid=") and "uid=-" not in line and "RuntimeError: boom" in line, line
    assert errors[0].exc_info is None and "\n" not in line


async def test_a_failing_stream_is_one_log_line_with_the_uid(caplog):
    async def chunks():
        yield b"data: {}\n\n"
        raise RuntimeError("chunk source broke")

    ended = []

    async def on_close(reason):
        ended.append(reason)

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        await asyncio.Event().wait()  # a client that stays connected (the stream's end cancels this)
        return {"type": "http.disconnect"}

    caplog.set_level(logging.DEBUG)
    response = SSEResponse(chunks(), on_close, 5.0, 5.0, asyncio.Event())
    await response({"type": "http", UID: "u-1", "method": "POST", "path": "/v1/completions"}, receive, send)
    (line,) = [r.getMessage() for r in error_lines(caplog)]
    assert line.startswith("uid=u-1 ") and "RuntimeError: chunk source broke" in line, line
    assert ended == [None] and sent[0]["status"] == 200
