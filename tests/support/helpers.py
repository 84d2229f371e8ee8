"""Small helpers the end-to-end tests share: raw HTTP clients, polling, worker loads."""

from __future__ import annotations

import asyncio
import inspect
import json
import socket
import time
from collections.abc import Callable
from typing import Any

from shared.heartbeats import WorkerInfo


def wait_for(check: Callable[[], Any], timeout: float = 10.0, every: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met in {timeout}s (last value {value!r})")
        time.sleep(every)


async def async_wait_for(check: Callable[[], Any], timeout: float = 10.0,  # noqa: ASYNC109 (as wait_for's)
                         every: float = 0.02) -> Any:
    """`wait_for` in an event loop: `check` may be a coroutine function; the loop runs between looks. Its
    TimeoutError says what the condition last gave, which asyncio.timeout around a loop would not."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met in {timeout}s (last value {value!r})")
        await asyncio.sleep(every)


def raw_post(port: int, path: str, body: dict, rcvbuf: int | None = None) -> socket.socket:
    """Send a POST over a plain socket and return the socket unread (a client we fully control)."""
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def sse_payloads(raw: str) -> list[str]:
    return [line[6:] for line in raw.splitlines() if line.startswith("data: ")]


def workers(stack, role: str) -> list[WorkerInfo]:
    r = stack.redis()
    out = []
    for member in r.zrange(stack.keys.workers(), 0, -1):
        mrole, wid = member.split(":", 1)
        fields = r.hgetall(stack.keys.worker(mrole, wid))
        if mrole == role and fields:
            out.append(WorkerInfo(role, wid, fields["model"], float(fields["updated_at"]), json.loads(fields["load"])))
    return out


def worker_name(worker_id: str) -> str:
    """The process name a worker id was started under: ids are `<name>@<process start>` (a restarted
    process is another worker), or the bare name where ids carry no start."""
    return worker_id.split("@", 1)[0]


def live_names(stack, role: str) -> list[str]:
    """Names of the live workers of a role (as `Stack.start` named them), from their heartbeats."""
    return [worker_name(w.id) for w in workers(stack, role)]


def engines_idle(stack) -> bool:
    """Every live scheduler has no request and every KV page back (cached prefix pages count as free)."""
    loads = [w.load for w in workers(stack, "scheduler")]
    return bool(loads) and all(ld["requests"] == 0 and ld["running"] == 0 and ld["waiting"] == 0
                               and ld["free_pages"] == ld["total_pages"] for ld in loads)
