"""The API's HTTP/1.1 server protocol: uvicorn's httptools protocol (its C parser; services/api/main.py) with
the limits it lacks, each a setting of shared/settings.py ApiSettings:

- a request's head (request line and headers) must arrive within `header_timeout_s` of the connection opening,
  or of its first byte on a kept-alive connection, else the connection is closed (408 if any byte came):
  uvicorn times only the idle wait between requests (`keep_alive_s`), so a half-sent request stayed open;
- a head over `max_header_bytes` is refused with 431 as it arrives (httptools buffers a header line whole);
- past `max_connections` open connections a request is answered 503 with Retry-After in OpenAI's shape
  (uvicorn's `limit_concurrency`, whose own answer is plain text).

The request body's size and pace are bounded in services/api/edge/app.py (`BodyReader`).
"""

from __future__ import annotations

import asyncio

import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from services.api.errors import ApiError, anthropic_path
from shared.settings import ApiSettings


def raw_response(error: ApiError) -> bytes:
    """A whole HTTP response for an error found before any request reached the app; the connection closes."""
    body = orjson.dumps(error.body())
    more = "".join(f"{k.lower()}: {v}\r\n" for k, v in error.header_pairs().items() if k.lower() != "connection")
    return (STATUS_LINE[error.status] + b"content-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n" + more.encode() + b"connection: close\r\n\r\n" + body)


class EdgeProtocol(HttpToolsProtocol):
    """Set up per process by `edge_protocol` (uvicorn makes one instance per connection)."""

    header_timeout_s = 15.0
    max_header_bytes = 64 << 10
    max_connections = 4096

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.head_bytes, self.reading_head, self.refused = 0, True, False
        self.head_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # answered and closing: the rest is not parsed
        if self.reading_head:
            if self.head_timer is None:
                self._arm_head_timer()  # the first byte of a kept-alive connection's next request
            self.head_bytes += len(data)
        super().data_received(data)
        if self.reading_head and self.head_bytes > self.max_header_bytes:
            self._refuse(self._head_too_large())

    def on_headers_complete(self) -> None:
        self.reading_head = False
        self._cancel_head_timer()
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.max_header_bytes:
            self._refuse(self._head_too_large())
            return
        if len(self.connections) <= self.max_connections and len(self.tasks) < self.max_connections:
            super().on_headers_complete()
            return
        app, self.app = self.app, overloaded(self.max_connections)
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def on_body(self, body: bytes) -> None:
        if not self.refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self.refused:
            self.reading_head, self.head_bytes = True, 0  # what comes next is the next request's head
            super().on_message_complete()

    def _head_too_large(self) -> ApiError:
        return ApiError(431, f"the request head is over {self.max_header_bytes} bytes (--max-header-bytes)",
                        code="headers_too_large")

    def _arm_head_timer(self) -> None:
        self.head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if not self.reading_head or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_head_timer()  # a pipelined request's head waits while the one before it is answered
            return
        if self.head_bytes:
            self._refuse(ApiError(408, f"the request head did not arrive within {self.header_timeout_s:g} s "
                                  "(--header-timeout-s)", code="header_timeout"))
        else:
            self.refused = True
            self.transport.close()

    def _refuse(self, error: ApiError) -> None:
        self.refused = True
        self._cancel_head_timer()
        if not self.transport.is_closing():
            self.transport.write(raw_response(error))
            self.transport.close()


def overloaded(limit: int):
    """The app a request past the connection limit is given instead of the API."""
    error = ApiError(503, f"this server has over {limit} connections open (--max-connections); retry shortly",
                     code="overloaded", retry_after=1, close=True)

    async def app(scope, receive, send) -> None:
        await error.response(anthropic_path(scope.get("path", "")))(scope, receive, send)

    return app


def edge_protocol(settings: ApiSettings) -> type[EdgeProtocol]:
    """The protocol class uvicorn runs this process with: EdgeProtocol with the settings' limits."""
    return type("ApiProtocol", (EdgeProtocol,), {"header_timeout_s": settings.header_timeout_s,
                                                "max_header_bytes": settings.max_header_bytes,
                                                "max_connections": settings.max_connections})
