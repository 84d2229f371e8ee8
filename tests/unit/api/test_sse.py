"""The bytes of a stream (services/api/answer/sse.py): one write to the client per batch of replies, and the
stream's closing events in the write that ends the body (issue 34: the write is most of the API's cost per
chunk at GPU step rates)."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from services.api.answer.formats import CompletionFormat, Head
from services.api.answer.sse import SSEResponse, answer_events
from shared.messages import ReplyEvent

pytestmark = pytest.mark.timeout(30)


class Counts:
    prompt_tokens, completion_tokens, cached_tokens = 3, 4, 0


def events(start: int, finish: str | None = None) -> list[tuple[str, ReplyEvent]]:
    """One reply entry's events for both choices of an n=2 request: two chunks in one batch."""
    return [(f"{start + 1}-0", ReplyEvent(start=start, end=start + 2, text=f"t{start}", prompt_tokens=3, index=i,
                                          finish_reason=finish)) for i in (0, 1)]


async def stream(batches: list[list[tuple[str, ReplyEvent]]]) -> list[dict]:
    """What the server is sent for a stream of these batches of an n=2 completion with usage."""
    fmt = CompletionFormat(Head("cmpl-1", "m", 1, 2, include_usage=True))

    async def rest():
        for batch in batches[1:]:
            yield batch

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def on_close(_reason):
        pass

    chunks = answer_events(fmt.batch_chunks(batches[0], Counts()), rest(), fmt, Counts())
    await SSEResponse(chunks, on_close, 5.0, 5.0, asyncio.Event())({"type": "http"}, receive, send)
    return sent


async def test_each_batch_of_replies_is_one_write_and_the_end_is_one():
    sent = await stream([events(0), events(2), events(4, "length")])
    start, *bodies = sent
    assert start["type"] == "http.response.start"
    assert [m["more_body"] for m in bodies] == [True, True, True, False]  # 3 batches, then the end
    for body in bodies[:3]:
        frames = body["body"].split(b"\n\n")[:-1]
        assert [orjson.loads(f.split(b"data: ")[1])["choices"][0]["index"] for f in frames] == [0, 1]
    end = bodies[3]["body"].split(b"\n\n")[:-1]
    assert orjson.loads(end[0].removeprefix(b"data: "))["usage"]["total_tokens"] == 7
    assert end[1] == b"data: [DONE]"
