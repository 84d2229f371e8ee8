"""rsinfer/sse_client.py against a real socket server that answers with canned bytes: what a Reply records of
an SSE stream, a refusal, a connection that breaks, refuses or goes quiet, and a reattach that carries a reply on."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import pytest

from rsinfer.redis_server import free_port
from rsinfer.sse_client import Reply, Request, run_load, stream

pytestmark = pytest.mark.timeout(30)


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chat_chunk(uid: str, deltas: dict[int, str], finish: str | None = None) -> bytes:
    choices = [{"index": i, "delta": {"content": text}, "finish_reason": finish} for i, text in deltas.items()]
    return json.dumps({"id": f"chatcmpl-{uid}", "choices": choices}).encode()


async def serve(answer: Callable[[bytes, asyncio.StreamWriter], object]) -> tuple[str, asyncio.AbstractServer]:
    """A server on a free port that reads one request head and lets `answer(head, writer)` reply."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length")), 0)
        await reader.readexactly(length)
        result = answer(head, writer)
        if asyncio.iscoroutine(result):
            await result
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)  # the OS's free port, no window to lose it
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", server


@pytest.fixture
async def canned() -> AsyncIterator[Callable]:
    servers = []

    async def start(answer) -> str:
        url, server = await serve(answer)
        servers.append(server)
        return url

    yield start
    for server in servers:
        server.close()


async def test_a_stream_split_anywhere_gives_text_per_choice_ids_usage_and_done(canned):
    text = "a\u2028b\u0085c"  # str.splitlines breaks, unescaped by JSON: one line all the same
    events = (b": ping\n" + b"id: 1-0\ndata: " + chat_chunk("u1", {0: text, 1: "x"}) + b"\n\n"
              + b"id: 2-0\ndata: " + chat_chunk("u1", {0: "!"}, "length") + b"\n\n"
              + b"data: " + json.dumps({"id": "chatcmpl-u1", "choices": [{"index": 1, "delta": {},
                                        "finish_reason": "stop"}], "usage": {"completion_tokens": 4}}).encode()
              + b"\n\n: ping\n" + b"data: [DONE]\n\n")
    body = events.decode().encode("utf-8")
    pieces = [body[i:i + 7] for i in range(0, len(body), 7)]  # events cut across chunks (and characters)

    def answer(head, writer):
        assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
        writer.write(SSE_HEAD + chunked(*pieces))

    reply = await stream(Request(await canned(answer), {"stream": True}, "/v1/chat/completions", timeout=10))
    assert reply.ok and reply.problem == ""
    assert reply.texts == [text + "!", "x"] and reply.finish == ["length", "stop"]
    assert reply.uid == "u1" and reply.ids == ["1-0", "2-0"] and reply.tokens == 4
    assert len(reply.arrivals) == 3 and len(reply.content_at) == 2 and reply.ttft > 0
    assert reply.t0 <= reply.arrivals[0] <= reply.ended


async def test_a_refusal_keeps_its_status_and_error(canned):
    err = json.dumps({"error": {"message": "slow down", "code": "too_many_requests"}}).encode()

    def answer(head, writer):
        writer.write(b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(err), err))

    reply = await stream(Request(await canned(answer), {"stream": True}, timeout=10))
    assert reply.status == 429 and not reply.ok and reply.failure == ""
    assert reply.error == {"status": 429, "message": "slow down", "code": "too_many_requests"}


async def test_an_error_event_is_the_replys_error(canned):
    def answer(head, writer):
        writer.write(SSE_HEAD + chunked(b"data: " + chat_chunk("u2", {0: "ab"}) + b"\n\n",
                                        b'data: {"error": {"code": "broker_unavailable"}}\n\n', b"data: [DONE]\n\n"))

    reply = await stream(Request(await canned(answer), {}, timeout=10))
    assert reply.done and not reply.ok and reply.error == {"code": "broker_unavailable"} and reply.text == "ab"


async def test_a_connection_that_breaks_refuses_or_goes_quiet_is_a_failure(canned):
    def broken(head, writer):  # half a stream, then the server is gone (no last chunk)
        writer.write(SSE_HEAD + b"%x\r\n%s\r\n" % (10, b"data: {\"id"))

    async def quiet(head, writer):
        writer.write(SSE_HEAD + b"%x\r\n: ping\n\r\n" % 7)
        await asyncio.sleep(5)  # a server gone quiet, the behaviour under test (the handler ends by itself)

    reply = await stream(Request(await canned(broken), {}, timeout=10))
    assert reply.failure == "broken" and not reply.done and "StreamBroken" in reply.error
    refused = await stream(Request(f"http://127.0.0.1:{free_port()}", {}, timeout=10))
    assert refused.failure == "connect" and "ConnectFailed" in refused.error
    idle = await stream(Request(await canned(quiet), {}, idle_timeout=0.5))
    assert idle.failure == "timeout" and idle.ended - idle.t0 < 3


async def test_keep_alives_keep_a_stream_waiting_for_its_first_token_open(canned):
    """An idle limit counts time without any byte: a request queued behind others gets pings, not tokens."""
    async def pings_then_text(head, writer):
        writer.write(SSE_HEAD)
        for _ in range(6):
            writer.write(b"%x\r\n: ping\n\r\n" % 7)
            await asyncio.sleep(0.25)  # a server's pace, the behaviour under test: 4x inside the idle limit
        writer.write(chunked(b"data: " + chat_chunk("u4", {0: "late"}, "length") + b"\n\n", b"data: [DONE]\n\n"))

    reply = await stream(Request(await canned(pings_then_text), {}, idle_timeout=1.0))
    assert reply.ok and reply.text == "late" and reply.ended - reply.t0 > 1.0  # open past the idle limit


async def test_a_reattach_carries_the_reply_on(canned):
    first = SSE_HEAD + b"%x\r\n%s\r\n" % (len(b"id: 5-0\ndata: " + chat_chunk("u3", {0: "ab"}) + b"\n\n"),
                                           b"id: 5-0\ndata: " + chat_chunk("u3", {0: "ab"}) + b"\n\n")
    heads = []

    def answer(head, writer):
        heads.append(head)
        if len(heads) == 1:
            writer.write(first)  # and the connection drops
        else:
            writer.write(SSE_HEAD + chunked(b"id: 6-0\ndata: " + chat_chunk("u3", {0: "cd"}, "length") + b"\n\n",
                                            b"data: [DONE]\n\n"))

    url = await canned(answer)
    reply = await stream(Request(url, {}, "/v1/chat/completions", timeout=10))
    assert reply.failure == "broken" and reply.ids[-1] == "5-0"
    again = await stream(Request(url, None, f"/v1/requests/{reply.uid}/stream", "GET",
                                 {"Last-Event-ID": reply.ids[-1]}, timeout=10), reply)
    assert again is reply and reply.ok and reply.text == "abcd" and reply.finish == ["length"]
    assert heads[1].startswith(b"GET /v1/requests/u3/stream HTTP/1.1\r\n") and b"Last-Event-ID: 5-0" in heads[1]


def test_run_load_sends_every_body_at_most_concurrency_at_a_time():
    """From a thread with no event loop, as the benches call it; the server runs in its own thread."""
    import threading

    open_now, most, ready, port = [0], [0], threading.Event(), [0]

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        open_now[0] += 1
        most[0] = max(most[0], open_now[0])
        await asyncio.sleep(0.05)  # a slow answer, so that requests overlap: what the cap is tested on
        usage = json.dumps({"id": "cmpl-x", "choices": [{"index": 0, "text": "t", "finish_reason": "length"}],
                            "usage": {"completion_tokens": 1}}).encode()
        writer.write(SSE_HEAD + chunked(b"data: " + usage + b"\n\n", b"data: [DONE]\n\n"))
        open_now[0] -= 1
        writer.close()

    def server() -> None:
        async def main():
            async with await asyncio.start_server(handle, "127.0.0.1", 0) as srv:
                port[0] = srv.sockets[0].getsockname()[1]
                ready.set()
                await asyncio.sleep(20)  # the server's life; the thread is a daemon
        asyncio.run(main())

    threading.Thread(target=server, daemon=True).start()
    assert ready.wait(10)
    replies, wall, cpu = run_load([Request(f"http://127.0.0.1:{port[0]}", b"{}", timeout=10)] * 12, concurrency=3)
    assert len(replies) == 12 and all(isinstance(r, Reply) and r.ok and r.tokens == 1 for r in replies)
    assert most[0] <= 3 and wall >= 0.05 * 12 / 3 * 0.9 and cpu >= 0
