"""Streaming chat requests for the end-to-end tests, over rsinfer/sse_client.py: `Streamer` follows one in a
thread of its own (text, event ids, finish reason and chunk times readable while it streams); `body` and
`reference` make greedy requests and the texts an undisturbed run gives them."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import httpx

from rsinfer.sse_client import Request, StreamThread
from tests.support.stack import MODEL


def body(i: int, max_tokens: int = 100, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"crash test {i}"}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **extra}


def reference(stack, bodies: list[dict]) -> list[str]:
    """What each request gives when nothing goes wrong (greedy text does not depend on the batch)."""
    out: list[str] = [""] * len(bodies)

    def one(i: int) -> None:
        out[i] = httpx.post(f"{stack.base_url}/v1/chat/completions", json=bodies[i], timeout=60).json()[
            "choices"][0]["message"]["content"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


class Streamer(StreamThread):
    """Streams one request (chat, or `path` /v1/completions) and records its text, event ids and finish reason.
    `error`: the {"status", **error} of a refusal, the `error` of an error event, or why the connection failed;
    a connection quiet for 90 s (no token, no keep-alive) has failed."""

    def __init__(self, base_url: str, payload: dict, path: str = "/v1/chat/completions"):
        super().__init__(Request(base_url, {**payload, "stream": True}, path, idle_timeout=90))

    @property
    def text(self) -> str:
        return self.reply.text

    @property
    def finish(self) -> str | None:
        return next((f for f in self.reply.finish if f), None)

    @property
    def ids(self) -> list[str]:
        return self.reply.ids

    @property
    def uid(self) -> str | None:
        return self.reply.uid

    @property
    def error(self) -> Any:
        return self.reply.error

    def longest_gap(self) -> float:
        """The longest wait between two consecutive chunks (seconds)."""
        return max((b - a for a, b in itertools.pairwise(self.reply.arrivals)), default=0.0)

    def result(self, timeout: float = 60) -> str:
        self.join(timeout)
        assert not self.is_alive(), "stream did not end"
        assert self.error is None, self.error
        assert self.finish == "length"
        return self.text
