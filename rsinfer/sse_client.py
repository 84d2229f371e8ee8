"""The one SSE client: `rsinfer bench`, the benchmarks (bench/harness.py) and the tests' streaming clients
(tests/support/streaming.py, tests/support/chaos_kit.py) stream with it.

It speaks HTTP/1.1 over plain asyncio sockets: an httpx client saturates at a few thousand tokens/s and ends up
measuring itself, and a raw socket also says exactly how a stream ended (`ConnectFailed`: no connection;
`StreamBroken`: the connection ended before the response did). Lines split at "\\n" only: JSON leaves U+2028,
U+0085 and the other str.splitlines breaks unescaped inside strings, and the demo model's text contains them.

- `open_stream` sends one `Request` and yields the `Response` (status, headers, body, SSE events).
- `Reply` is what a stream delivered: text and finish reason per choice, event ids, the request's id, usage,
  the error (a refusal, an error event, a broken connection) and when every event arrived. A reattach
  (GET /v1/requests/<uid>/stream with Last-Event-ID) carries the same Reply on.
- `stream` is both in one call, and never raises for what the server or the network did; `StreamThread`
  runs one in a thread of its own, for callers with no event loop.
- `run_load` sends many, a bounded number at a time, from one or several client processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Any

import orjson


class ConnectFailed(OSError):
    """No connection to the server (refused, unreachable): nothing was sent."""


class StreamBroken(OSError):
    """The connection ended (closed, reset, garbled) before the response did."""


@dataclass(frozen=True)
class Request:
    """One streamed request: `url` the server's base URL; `body` JSON (bytes as they are); `timeout` seconds for
    the whole request, `idle_timeout` seconds without a byte of the response (None: no limit)."""

    url: str
    body: bytes | dict | None = None
    path: str = "/v1/completions"
    method: str = "POST"
    headers: Mapping[str, str] | None = None
    timeout: float | None = None
    idle_timeout: float | None = None

    def head(self, body: bytes) -> bytes:
        lines = [f"{self.method} {self.path} HTTP/1.1", f"Host: {urllib.parse.urlsplit(self.url).netloc}",
                 "Accept: text/event-stream", "Connection: close"]
        if body or self.method == "POST":
            lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in (self.headers or {}).items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode()


@dataclass(frozen=True)
class Event:
    """One SSE event: its `id:` (None if it had none) and its `data:`."""

    id: str | None
    data: bytes


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (inherited by the processes started after); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# ---- one request: the response and its events


class Response:
    """An HTTP/1.1 response being read: chunked, with a Content-Length, or up to the end of the connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: int,
                 headers: dict[str, str]):
        self.reader, self.writer, self.status, self.headers = reader, writer, status, headers
        self.on_data: Callable[[], None] | None = None  # called on every piece of the body (a keep-alive too)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; StreamBroken if the connection ends first."""
        r = self.reader
        try:
            if self.headers.get("transfer-encoding", "").lower() == "chunked":
                while size := int((await r.readuntil(b"\r\n")).split(b";")[0], 16):
                    data = await r.readexactly(size + 2)
                    if self.on_data:
                        self.on_data()
                    yield data[:-2]
                while await r.readuntil(b"\r\n") != b"\r\n":  # trailers
                    pass
            elif "content-length" in self.headers:
                yield await r.readexactly(int(self.headers["content-length"]))
            else:
                while data := await r.read(65536):
                    if self.on_data:
                        self.on_data()
                    yield data
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError) as e:
            raise StreamBroken(f"the response ended early: {e!r}") from e

    async def read(self) -> bytes:
        return b"".join([data async for data in self.chunks()])

    async def events(self) -> AsyncIterator[Event]:
        """The body's SSE events (comments such as keep-alive pings and events with no data skipped)."""
        buf = b""
        async for data in self.chunks():
            buf += data
            while (end := buf.find(b"\n\n")) >= 0:
                block, buf = buf[:end], buf[end + 2:]
                event_id, payload = None, None
                for line in block.split(b"\n"):
                    line = line.removesuffix(b"\r")
                    if line.startswith(b"data: "):
                        payload = line[6:]
                    elif line.startswith(b"id: "):
                        event_id = line[4:].decode()
                if payload is not None:
                    yield Event(event_id, payload)


@contextlib.asynccontextmanager
async def open_stream(request: Request) -> AsyncIterator[Response]:
    """Send `request` and yield its response once the head is in (its timeouts are `stream`'s to apply); the
    connection is closed on leaving. ConnectFailed if there is no connection, StreamBroken if it ends before the
    response's head."""
    url, body = request.url, request.body
    payload = body if isinstance(body, bytes) else orjson.dumps(body) if body is not None else b""
    u = urllib.parse.urlsplit(url)
    try:
        reader, writer = await asyncio.open_connection(u.hostname, u.port or 80)
    except OSError as e:
        raise ConnectFailed(f"no connection to {url}: {e!r}") from e
    try:
        try:
            writer.write(request.head(payload) + payload)
            await writer.drain()
            status_line = await reader.readuntil(b"\r\n")
            head: dict[str, str] = {}
            while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
                key, _, value = line.decode("latin-1").partition(":")
                head[key.strip().lower()] = value.strip()
            status = int(status_line.split()[1])
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError,
                IndexError) as e:
            raise StreamBroken(f"no response from {url}: {e!r}") from e
        yield Response(reader, writer, status, head)
    finally:
        writer.close()


# ---- what a stream delivered


@dataclass
class Reply:
    """What a streamed /v1/chat/completions or /v1/completions request delivered. Times are time.monotonic();
    `sent` is also kept as time.time() (`wall` converts)."""

    sent: float = field(default_factory=time.time)
    t0: float = field(default_factory=time.monotonic)
    status: int = 0  # of the last response
    error: Any = None  # {"status", **error} of a refusal, an error event's `error`, or why the transport failed
    failure: str = ""  # the transport's part of that: "connect", "broken" or "timeout"
    uid: str | None = None  # from the first chunk's id: chatcmpl-<uid> / cmpl-<uid>
    ids: list[str] = field(default_factory=list)  # every event id, in order
    texts: list[str] = field(default_factory=list)  # per choice (delta content of a chat, text of a completion)
    finish: list[str | None] = field(default_factory=list)  # per choice
    usage: dict | None = None
    done: bool = False  # `data: [DONE]` arrived
    ended: float = 0.0  # when the last response ended (or failed)
    arrivals: list[float] = field(default_factory=list)  # every JSON event, error events included
    content_at: list[float] = field(default_factory=list)  # the events that carried text

    @property
    def ok(self) -> bool:
        """The stream ran to its end and carried no error."""
        return self.done and self.error is None

    @property
    def problem(self) -> str:
        """What went wrong, as one line ("" if nothing did)."""
        if self.ok:
            return ""
        if self.error is None:
            return "the stream ended without [DONE]"
        return self.error if isinstance(self.error, str) else orjson.dumps(self.error).decode()[:300]

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def tokens(self) -> int:
        """Completion tokens, from the usage chunk (0 without one)."""
        return int((self.usage or {}).get("completion_tokens") or 0)

    @property
    def ttft(self) -> float:
        """Seconds from sending to the first text (0.0 if none came)."""
        return self.content_at[0] - self.t0 if self.content_at else 0.0

    def wall(self, t: float) -> float:
        """A time.monotonic() of this reply as time.time()."""
        return self.sent + (t - self.t0)

    def feed(self, event: Event) -> None:
        now = time.monotonic()
        if event.id is not None:
            self.ids.append(event.id)
        if event.data == b"[DONE]":
            self.done = True
            return
        msg = orjson.loads(event.data)
        self.arrivals.append(now)
        if "error" in msg:
            self.error = msg["error"]
            return
        if self.uid is None and isinstance(msg.get("id"), str):
            self.uid = msg["id"].partition("-")[2] or msg["id"]
        if msg.get("usage"):
            self.usage = msg["usage"]
        carried = False
        for c in msg.get("choices") or ():
            i = c.get("index", 0)
            while len(self.texts) <= i:
                self.texts.append("")
                self.finish.append(None)
            text = (c["delta"].get("content") if "delta" in c else c.get("text")) or ""
            if text:
                self.texts[i] += text
                carried = True
            self.finish[i] = c.get("finish_reason") or self.finish[i]
        if carried:
            self.content_at.append(now)

    def refused(self, status: int, body: bytes) -> None:
        """The server answered `status` (not 200) with `body` instead of a stream."""
        try:
            err = orjson.loads(body)["error"]
            self.error = {"status": status, **err} if isinstance(err, dict) else {"status": status, "error": err}
        except (orjson.JSONDecodeError, KeyError, TypeError):
            self.error = {"status": status, "body": body.decode(errors="replace")[:300]}


async def stream(request: Request, reply: Reply | None = None) -> Reply:
    """Stream `request` into `reply` (a new one unless given: a reattach carries one on) and return it, within the
    request's timeouts. Never raises for what the server or the network did: `reply.error` (and
    `reply.failure`) say."""
    reply = reply if reply is not None else Reply()
    if reply.failure:  # carried on after a failed connection: that is no longer why it did not end well
        reply.error, reply.failure = None, ""
    loop = asyncio.get_running_loop()
    timeout, idle_timeout = request.timeout, request.idle_timeout
    first = min((t for t in (timeout, idle_timeout) if t), default=None)
    try:
        async with asyncio.timeout(first) as limit:
            end = loop.time() + timeout if timeout else None

            def progress() -> None:  # any piece of the response moves an idle limit on, up to the whole one
                if idle_timeout:
                    at = loop.time() + idle_timeout
                    limit.reschedule(min(at, end) if end else at)

            async with open_stream(request) as resp:
                reply.status = resp.status
                progress()
                resp.on_data = progress
                if resp.status != 200:
                    reply.refused(resp.status, await resp.read())
                    return reply
                async for event in resp.events():
                    reply.feed(event)
    except ConnectFailed as e:
        reply.error, reply.failure = repr(e)[:300], "connect"
    except StreamBroken as e:
        reply.error, reply.failure = repr(e)[:300], "broken"
    except TimeoutError as e:
        reply.error, reply.failure = repr(e)[:300], "timeout"
    finally:
        reply.ended = time.monotonic()
    return reply


class StreamThread(threading.Thread):
    """Streams one request in a thread of its own (and an event loop of its own) into `self.reply`, which the
    caller may read while it grows; `join()` waits for the end. Started at once."""

    def __init__(self, request: Request):
        super().__init__(daemon=True)
        self.request = request
        self.reply = Reply()
        self.start()

    def run(self) -> None:
        asyncio.run(stream(self.request, self.reply))


# ---- many requests


@dataclass(frozen=True)
class LoadPart:
    """One client process's share of a load run."""

    requests: list[Request]  # this part's, in start order
    offsets: list[float]  # each request's start, seconds after start_at
    concurrency: int
    start_at: float  # time.time() when the first request of every part may start


async def _run_part(part: LoadPart) -> list[Reply]:
    sem = asyncio.Semaphore(part.concurrency)

    async def one(i: int) -> Reply:
        await asyncio.sleep(max(0.0, part.start_at + part.offsets[i] - time.time()))
        async with sem:
            return await stream(part.requests[i])

    return await asyncio.gather(*(one(i) for i in range(len(part.requests))))


def _part_main(part: LoadPart) -> tuple[list[Reply], float]:
    raise_fd_limit()
    before = resource.getrusage(resource.RUSAGE_SELF)
    replies = asyncio.run(_run_part(part))
    after = resource.getrusage(resource.RUSAGE_SELF)
    return replies, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def run_load(requests: list[Request], concurrency: int, stagger_s: float = 0.0,
             processes: int = 1) -> tuple[list[Reply], float, float]:
    """Stream every request, at most `concurrency` at a time, request i starting no earlier than i * stagger_s;
    `processes` client processes share the requests and the concurrency (a single Python process cannot parse
    tens of thousands of events a second). Call it from a process with no running event loop. The replies in no
    particular order, the wall time from the first send to the last end, and the client processes' CPU seconds."""
    n = len(requests)
    processes = max(1, min(processes, n))
    start_at = time.time() + (0.5 if processes > 1 else 0.05)
    parts = []
    for k in range(processes):
        idx = list(range(k, n, processes))
        share = concurrency // processes + (1 if k < concurrency % processes else 0)
        parts.append(LoadPart([requests[i] for i in idx], [i * stagger_s for i in idx], max(1, share), start_at))
    t0 = time.time()
    if processes == 1:
        results = [_part_main(parts[0])]
    else:
        with ProcessPoolExecutor(processes, mp_context=get_context("fork")) as pool:
            results = list(pool.map(_part_main, parts))
    replies = [r for part, _ in results for r in part]
    first = min((r.sent for r in replies), default=t0)
    wall = max((r.wall(r.ended) for r in replies), default=t0) - first
    return replies, wall, sum(cpu for _, cpu in results)
