"""Streams that outlive a network blip: keep-alive pings the official SDK reads, reattaching with
Last-Event-ID within the resume window, and background requests that run with nobody attached.

An extra API process joins the session stack's namespace with a short ping interval and a resume window;
the session's own API (window 0) is the "other API process" a client reattaches through.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import Iterator

import httpx
import pytest

from rsinfer.launcher import api_ready
from rsinfer.redis_server import free_port
from shared.streams import id_after
from tests.support.helpers import engines_idle, sse_payloads, wait_for
from tests.support.stack import MODEL, Stack

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]  # `make test-fast` leaves it out
# A ping interval far shorter than any stream here, so a short stream holds many pings; a window long enough
# for a loaded machine to reattach within it.
PING_S, WINDOW_S = 0.05, 3.0


@pytest.fixture(scope="module")
def blip_api(stack) -> Iterator[Stack]:
    s = Stack(stack.redis_url, stack.model_dir, stack.namespace, stack.log_dir)
    s.port = free_port()
    try:
        s.start("api-blip", "api", RSINFER_SSE_PING_S=str(PING_S), RSINFER_RESUME_WINDOW_S=str(WINDOW_S))
        wait_for(lambda: api_ready(s.base_url), timeout=60)
        yield s
    finally:
        s.stop()


class Tee(httpx.HTTPTransport):
    """Keeps every byte of the responses it carries, as the client reads them (before any SSE parsing)."""

    def __init__(self) -> None:
        super().__init__()
        self.read = bytearray()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        response.stream = _Teed(response.stream, self.read)
        return response


class _Teed(httpx.SyncByteStream):
    def __init__(self, inner: httpx.SyncByteStream, sink: bytearray):
        self.inner, self.sink = inner, sink

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.inner:
            self.sink += chunk
            yield chunk

    def close(self) -> None:
        self.inner.close()


def chat(i: int, max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"resume {i}"}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **extra}


def greedy_text(stack, payload: dict) -> str:
    resp = httpx.post(f"{stack.base_url}/v1/chat/completions", json=payload, timeout=60)
    return resp.json()["choices"][0]["message"]["content"]


def stream_events(base_url: str, payload: dict, timeout: float = 60) -> Iterator[tuple[str, str, str]]:
    """Stream `payload`: (uid, event id, content) per content event; leaving early drops the connection."""
    last = ""
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json={**payload, "stream": True},
                      timeout=timeout) as resp:
        for line in resp.iter_lines():
            if line.startswith("id: "):
                last = line[4:]
            elif line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text = "".join(c["delta"].get("content") or "" for c in chunk["choices"])
                yield chunk["id"].removeprefix("chatcmpl-"), last, text


def read_some(base_url: str, payload: dict, events: int) -> tuple[str, str, str]:
    """Stream `payload`, read `events` content events, then drop the connection: (uid, text, last event id)."""
    with contextlib.closing(stream_events(base_url, payload, timeout=30)) as stream:  # closed: connection dropped
        got = list(itertools.islice(stream, events))
    return got[-1][0], "".join(text for _, _, text in got), got[-1][1]


def reattach(base_url: str, uid: str, last: str | None = None) -> str:
    headers = {"Last-Event-ID": last} if last else {}
    with httpx.stream("GET", f"{base_url}/v1/requests/{uid}/stream", headers=headers, timeout=60) as resp:
        assert resp.status_code == 200
        data = sse_payloads("".join(resp.iter_text()))
    assert data[-1] == "[DONE]"
    return "".join(c["delta"].get("content") or "" for d in data[:-1] for c in json.loads(d)["choices"])


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_official_sdk_reads_streams_longer_than_the_ping_interval(stack, blip_api, endpoint):
    """The SDK gets the whole text from a stream whose bytes, as it read them, hold pings among its events (after
    events that carry ids)."""
    tee = Tee()
    client = blip_api.client(http_client=httpx.Client(transport=tee))
    if endpoint == "chat":
        create, fields = client.chat.completions.create, {"messages": [{"role": "user", "content": "ping test"}]}
        full_text, delta_text = (lambda r: r.choices[0].message.content), (lambda c: c.choices[0].delta.content)
    else:
        create, fields = client.completions.create, {"prompt": "ping test"}
        full_text, delta_text = (lambda r: r.choices[0].text), (lambda c: c.choices[0].text)
    fields.update(model=MODEL, max_tokens=300, temperature=0)
    expected = full_text(create(**fields, extra_body={"ignore_eos": True}))
    tee.read.clear()
    chunks = list(create(**fields, extra_body={"ignore_eos": True}, stream=True))
    assert "".join(delta_text(c) or "" for c in chunks if c.choices) == expected
    lines = tee.read.decode().splitlines()
    pings = [k for k, line in enumerate(lines) if line == ": ping"]
    assert pings and any(line.startswith("id: ") for line in lines[:pings[0]]), lines[:12]
    assert any(line.startswith("data: {") for line in lines[pings[0]:]), "no event after a ping"


def test_reattach_within_the_window_gets_exactly_the_rest(stack, blip_api):
    payload = chat(1, 400)
    expected = greedy_text(stack, payload)
    uid, head, last = read_some(blip_api.base_url, payload, events=5)
    assert head and last
    r = stack.redis()
    # a network blip: the API saw its client go (and waits the window for a reattach) before we come back
    wait_for(lambda: r.hget(stack.keys.request(uid), "attached") == "0", timeout=WINDOW_S)
    tail = reattach(stack.base_url, uid, last)  # through the other API process
    assert head + tail == expected
    assert r.hget(stack.keys.request(uid), "status") == "finished"
    assert r.get(stack.keys.abort(uid)) is None


def test_without_a_reattach_the_request_is_aborted_right_after_the_window(stack, blip_api):
    with contextlib.closing(stream_events(blip_api.base_url, chat(2, 3500), timeout=30)) as stream:
        uid = list(itertools.islice(stream, 3))[-1][0]
        left = time.monotonic()  # before the connection drops: the window cannot have begun
    r = stack.redis()
    # Not before the window ends; then at once, well before the 3500 tokens could have ended it otherwise.
    wait_for(lambda: r.get(stack.keys.abort(uid)), timeout=WINDOW_S + 5, every=0.05)
    assert time.monotonic() - left >= WINDOW_S
    assert r.get(stack.keys.abort(uid)) == "client_disconnected"
    wait_for(lambda: r.hget(stack.keys.request(uid), "status") == "aborted", timeout=5)
    wait_for(lambda: engines_idle(stack), timeout=10)


@pytest.mark.parametrize("api", ["blip", "session"])
def test_background_request_runs_to_the_end_unattended_then_reads_in_full(stack, blip_api, api):
    payload = chat(3, 300, background=True)
    expected = greedy_text(stack, payload)
    base = blip_api.base_url if api == "blip" else stack.base_url  # with and without a resume window
    uid, _, _ = read_some(base, payload, events=2)
    r = stack.redis()
    wait_for(lambda: r.hget(stack.keys.request(uid), "status") in ("finished", "aborted"), timeout=30)
    assert r.hget(stack.keys.request(uid), "status") == "finished"
    assert r.get(stack.keys.abort(uid)) is None
    assert reattach(stack.base_url, uid) == expected



def test_reattach_to_a_stream_whose_head_was_trimmed(stack):
    """Past --reply-maxlen entries a reply stream's head is gone: a reattach after an id it still has gets
    exactly the rest (the first range it reads says where the choice stands); one from before its head gets a
    410 before any byte of stream (the text in between is gone), and so does one with no Last-Event-ID."""
    got = list(stream_events(stack.base_url, chat(4, 300)))
    uid, events = got[0][0], [(eid, text) for _, eid, text in got]
    r = stack.redis()
    key = stack.keys.reply(uid)
    length = r.xlen(key)  # fewer entries than tokens where --stream-flush-ms merges the demo model's fast steps
    assert length > 30
    r.xtrim(key, maxlen=length // 2, approximate=False)  # as MAXLEN ~ does to a longer stream
    first_kept = r.xrange(key, count=1)[0][0]
    ids = [eid for eid, _ in events]
    at = next(k for k, eid in enumerate(ids) if id_after(eid, first_kept)) + 5
    assert reattach(stack.base_url, uid, ids[at]) == "".join(text for _, text in events[at + 1:])

    before = ids[next(k for k, eid in enumerate(ids) if not id_after(first_kept, eid)) - 5]
    for headers in ({"Last-Event-ID": before}, {}):
        resp = httpx.get(f"{stack.base_url}/v1/requests/{uid}/stream", headers=headers, timeout=30)
        assert resp.status_code == 410, resp.text
        assert resp.json()["error"]["code"] == "reply_trimmed"
