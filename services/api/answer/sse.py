"""Step 4 of a request's path (services/api/answer/service.py `ApiService.answer`): the bytes. `answer_events` turns a
request's ordered replies, through its format, into SSE events (`sse_event` frames each chunk), and every stream
is sent with `SSEResponse`: a plain ASGI response, lean on the per-chunk path.

Per batch of replies it does one `send` (its chunks joined; the stream's closing events go with the end of
its body) and nothing else: no task group, lock or cancel scope per send (sse-starlette's
cost), and the send goes straight to the server, past the middleware stack's wrappers (`Guard` hands us the
server's `send`; they only note that a response started, and nothing after the start can be turned into
another response). Around the chunks, three watchers, each one task for the stream's whole life:

- the client leaving (`http.disconnect`) ends the stream at once, as cancellation of the chunk source;
- a client that accepts nothing for `send_timeout` seconds ends it with reason `EndReason.SLOW_CLIENT`;
- every `ping_s` a keep-alive comment line (`PING`) is sent;
- the server shutting down (`closing` set, once the grace period is over) ends it: with the format's error
  event and [DONE] (`shutdown_events`), so that the client sees why, and the response ends as HTTP says.

`on_close(reason)` runs when the response ends for any reason (step 5, finishing the request).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import anyio
import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from services.api.errors import ApiError, log_unexpected
from shared.request_states import EndReason

if TYPE_CHECKING:
    from services.api.answer.formats import Counts, Format
    from services.api.answer.request.api_request import Batch

RAW_SEND = "rsinfer.raw_send"  # scope key: the server's own send (services/api/edge/app.py Guard)
HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
           (b"x-accel-buffering", b"no"), (b"connection", b"keep-alive")]
# A keep-alive is one comment line with no blank line after it. A blank line would end an "event" with no
# data, and the openai SDK decodes such an event (once any event had an `id:`) as JSON and raises; a comment
# line alone is ignored by every SSE parser and still keeps proxies from closing an idle connection.
PING = b": ping\n"


def sse_event(data: bytes, event_id: str | None = None, _chunk: dict | None = None) -> bytes:
    if event_id:
        return b"id: %s\ndata: %s\n\n" % (event_id.encode(), data)
    return b"data: %s\n\n" % data


def named_event(data: bytes, event_id: str | None, chunk: dict) -> bytes:
    """An event with its type in an `event:` line, as the Responses and Messages APIs send them."""
    head = f"id: {event_id}\n".encode() if event_id else b""
    return head + b"event: " + chunk["type"].encode() + b"\ndata: " + data + b"\n\n"


DONE = sse_event(b"[DONE]")


class Ending(bytes):
    """The last bytes of a stream (its closing chunks and [DONE]): `SSEResponse` sends them as the response's
    last body, once the events' source ended, in one write with the chunked body's end."""


async def answer_events(first: tuple[list[dict], str | None], rest: AsyncIterator[Batch], fmt: Format,
                        counts: Counts, replay_until: str | None = None) -> AsyncIterator[bytes]:
    """A stream's events, one bytes per batch (one write to the client): the first batch's chunks (formatted
    while the response was held back), then each batch of ordered replies as it comes (`Format.batch_chunks`:
    entries up to `replay_until` are not sent again), and last (`Ending`) the format's closing chunks (the
    usage if asked) and [DONE] where the format ends so. An end before the request finished
    (services/api/answer/request/early_end.py EndedEarly) is the format's failure chunks (the error's body)."""
    frame = named_event if fmt.named_events else sse_event
    try:
        chunks, event_id = first
        if chunks:
            yield b"".join([frame(orjson.dumps(chunk), event_id, chunk) for chunk in chunks])
        async for batch in rest:
            if not batch:
                continue  # nothing arrived for a while (pings keep the connection)
            chunks, event_id = fmt.batch_chunks(batch, counts, replay_until)
            if chunks:
                yield b"".join([frame(orjson.dumps(chunk), event_id, chunk) for chunk in chunks])
        last = [frame(orjson.dumps(chunk), None, chunk) for chunk in fmt.closing_chunks(counts)]
    except ApiError as e:
        last = [frame(orjson.dumps(chunk), None, chunk) for chunk in fmt.failure_chunks(e.body())]
    yield Ending(b"".join(last) + (DONE if fmt.sends_done else b""))
    await fmt.settle()


def shutdown_events(fmt: Format) -> bytes:
    """The end of a stream the server stops before its request finished: the format's error event, and [DONE]
    where the format ends so."""
    error = ApiError(503, "the server is shutting down and ended this stream before the request finished; "
                     "send it again", code=EndReason.SERVER_SHUTDOWN)
    frame = named_event if fmt.named_events else sse_event
    events = b"".join(frame(orjson.dumps(chunk), None, chunk) for chunk in fmt.failure_chunks(error.body()))
    return events + (DONE if fmt.sends_done else b"")


class SSEResponse(Response):
    """`farewell`: the last events of a stream ended by the server's shutdown (`shutdown_events`)."""

    def __init__(self, chunks: AsyncIterator[bytes], on_close: Callable[[str | None], Awaitable[None]],
                 ping_s: float, send_timeout: float, closing: asyncio.Event, *,
                 farewell: Callable[[], bytes] | None = None):
        # A Response for the framework's sake (it passes responses through as they are); nothing of its body.
        self.status_code, self.background, self.raw_headers = 200, None, HEADERS
        self.chunks, self.on_close, self.farewell = chunks, on_close, farewell
        self.ping_s, self.send_timeout, self.closing = ping_s, send_timeout, closing
        self.last_send = time.monotonic()
        self.sending_since: float | None = None
        self.ended = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        send = scope.get(RAW_SEND, send)
        reason: str | None = None
        try:
            await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
            reason = await self._run(receive, send)
        except OSError:
            reason = EndReason.CLIENT_GONE
        except Exception as e:  # a bug: one line with the request's uid (services/api/errors.py)
            log_unexpected(scope, e)
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await self._end(reason)

    async def _end(self, reason: str | None) -> None:
        with contextlib.suppress(Exception):
            await self.chunks.aclose()
        await self.on_close(reason)

    async def _run(self, receive: Receive, send: Send) -> str | None:
        """Pump the chunks until they end or a watcher ends the stream; the reason it ended early, if it did."""
        pump = asyncio.ensure_future(self._pump(send))
        watchers = {asyncio.ensure_future(w): why for w, why in (
            (self._disconnected(receive), EndReason.CLIENT_GONE), (self._stalled(), EndReason.SLOW_CLIENT),
            (self.closing.wait(), EndReason.SERVER_SHUTDOWN), (self._ping(send), None))}
        try:
            done, _ = await asyncio.wait({pump, *watchers}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, *watchers):
                task.cancel()
            await asyncio.gather(pump, *watchers, return_exceptions=True)
        if pump in done:
            pump.result()  # an error in the chunk source is logged by the caller
            return None
        reason = next(watchers[t] for t in done if t in watchers)
        if reason == EndReason.SERVER_SHUTDOWN and self.farewell is not None:
            with contextlib.suppress(Exception):  # the client may be gone too
                await self._send(send, self.farewell())
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        return reason

    async def _pump(self, send: Send) -> None:
        """Send the chunks as they come, and the `Ending` as the response's last body once the source ended (the
        Responses API stores its final object after its last event, before the response ends)."""
        ending = b""
        async for chunk in self.chunks:
            if chunk.__class__ is Ending:
                ending += chunk
            else:
                await self._send(send, chunk)
        self.ended = True  # no ping after the body's end
        with contextlib.suppress(Exception):
            await self._send(send, ending, more_body=False)

    async def _send(self, send: Send, body: bytes, more_body: bool = True) -> None:
        self.sending_since = time.monotonic()
        await send({"type": "http.response.body", "body": body, "more_body": more_body})
        self.last_send, self.sending_since = time.monotonic(), None

    async def _disconnected(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def _stalled(self) -> None:
        """Returns once one send has waited `send_timeout` for the client to take it."""
        while True:
            since = self.sending_since
            now = time.monotonic()
            if since is not None and now - since >= self.send_timeout:
                return
            await asyncio.sleep(self.send_timeout - (now - since) if since is not None else self.send_timeout / 2)

    async def _ping(self, send: Send) -> None:
        """Every `ping_s`, busy or not (a proxy may count only its own idle time), unless a send is pending."""
        while True:
            await asyncio.sleep(self.ping_s)
            if self.sending_since is None and not self.ended:
                await self._send(send, PING)
