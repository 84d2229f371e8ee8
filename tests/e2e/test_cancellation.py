"""Cancellation, stop strings, deadlines and stage errors, against `rsinfer up`."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.support.helpers import engines_idle, raw_post, sse_payloads, wait_for
from tests.support.stack import MODEL

pytestmark = pytest.mark.timeout(60)
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 3500,
        "ignore_eos": True, "temperature": 0}


def _uid_from_stream(sock) -> str:
    buf = b""
    while b"chatcmpl-" not in buf or b'"object"' not in buf:
        buf += sock.recv(4096)
    return buf.split(b"chatcmpl-")[1][:32].decode()


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_nothing_runs_on(stack, stream):
    """The API sets the abort flag when the client goes; the scheduler, which reads it before each step it
    publishes, stops within a few steps: the reply stream hardly grows after the flag (what still comes are the
    steps already on their way through the detokenizer). How fast it all happens is a latency:
    bench/abort_latency.py measures it (flag p50 2 ms, 3 entries after it on average, 4 at most)."""
    r = stack.redis()
    sock = raw_post(stack.port, "/v1/chat/completions", {**LONG, "stream": stream})
    if stream:
        uid = _uid_from_stream(sock)
    else:  # no bytes come back before the end: find the request by its record
        def running_uid():
            for key in r.scan_iter(match=stack.keys.request_pattern()):
                rec = r.hgetall(key)
                if rec.get("status") == "running" and rec.get("kind") == "chat" and not r.exists(
                        stack.keys.abort(stack.keys.uid_of_request_key(key))):
                    return stack.keys.uid_of_request_key(key)
            return None
        uid = wait_for(running_uid)
    sock.close()
    wait_for(lambda: r.exists(stack.keys.abort(uid)), timeout=10, every=0.002)
    at_flag = r.xlen(stack.keys.reply(uid))
    assert r.get(stack.keys.abort(uid)) == "client_disconnected"
    wait_for(lambda: r.hget(stack.keys.request(uid), "status") == "aborted", timeout=10)
    wait_for(lambda: engines_idle(stack), timeout=10)  # the scheduler dropped it and freed its pages
    assert r.xlen(stack.keys.reply(uid)) - at_flag <= 16, "steps went on being published after the abort flag"


def test_stop_string_truncates_and_stops_the_engine(stack):
    client = stack.client()
    base = dict(model=MODEL, messages=[{"role": "user", "content": "stop test"}], temperature=0,
                max_tokens=80, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**base).choices[0].message.content
    start = next(i for i in range(15, len(full) - 3) if "\ufffd" not in full[i:i + 3] and full[i:i + 3].strip())
    stop = full[start:start + 3]
    expected = full[:full.find(stop)]
    r = client.chat.completions.create(**base, stop=[stop])
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 80
    uid = r.id.removeprefix("chatcmpl-")
    assert stack.redis().get(stack.keys.abort(uid)) == "stop"  # the scheduler was told to stop
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        **base, stop=[stop], stream=True) if c.choices)
    assert streamed == expected


def test_deadline_stream_gets_error_then_done(stack):
    t0 = time.monotonic()
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json={**LONG, "stream": True, "timeout": 1},
                      timeout=30) as resp:
        body = "".join(resp.iter_text())
    assert 0.9 < time.monotonic() - t0 < 30  # not before its deadline; the upper bound only rules out a hang
    data = sse_payloads(body)
    assert data[-1] == "[DONE]"
    error = json.loads(data[-2])["error"]
    assert error["code"] == "request_timeout" and error["type"] == "timeout"
    uid = json.loads(data[0])["id"].removeprefix("chatcmpl-")
    # set as the response ends, which may be just after the client read [DONE]
    assert wait_for(lambda: stack.redis().get(stack.keys.abort(uid)), timeout=5) == "timeout"
    wait_for(lambda: engines_idle(stack), timeout=5)


def test_deadline_non_stream_is_504(stack):
    resp = httpx.post(f"{stack.base_url}/v1/chat/completions", json={**LONG, "timeout": 1}, timeout=30)
    assert resp.status_code == 504
    assert resp.json()["error"]["code"] == "request_timeout"
    wait_for(lambda: engines_idle(stack), timeout=5)


def _count(stack, metric: str, status: str) -> float:
    """The API's counter `metric` summed over every label set with this status (an end reason: ok, timeout...)."""
    lines = httpx.get(f"{stack.base_url}/metrics", timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith(metric + "{") and f'status="{status}"' in line)


def test_the_openai_client_does_not_retry_a_deadline(stack):
    """A 504 past the request's own `timeout` says `x-should-retry: false`: the SDK (2 retries by default) sends
    it once, rather than run the generation three times."""
    before = _count(stack, "rsinfer_http_requests_total", "timeout")
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="x")  # the SDK's default retries
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=MODEL, messages=LONG["messages"], max_tokens=LONG["max_tokens"],
                                       extra_body={"timeout": 0.5, "ignore_eos": True})
    assert _count(stack, "rsinfer_http_requests_total", "timeout") == before + 1  # one request, not three
    assert caught.value.status_code == 504 and caught.value.response.headers["x-should-retry"] == "false"
    wait_for(lambda: engines_idle(stack), timeout=5)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 5000}]}, "messages"),
    ("/v1/completions", {"prompt": ""}, "prompt"),  # empty after tokenization
    ("/v1/completions", {"prompt": [10**6]}, "prompt"),  # a token id outside the vocabulary
])
def test_errors_known_before_generation_get_their_status_when_streamed(stack, path, body, param):
    """The tokenizer refuses these before any token exists: a streaming client gets the 400 itself, as a
    non-streaming one does, not a 200 followed by an error event."""
    for stream in (True, False):
        resp = httpx.post(f"{stack.base_url}{path}", json={"model": MODEL, "stream": stream, **body}, timeout=30)
        assert resp.status_code == 400, (stream, resp.text)
        assert resp.headers["content-type"].startswith("application/json")
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param
    with pytest.raises(openai.BadRequestError):
        stack.client().completions.create(model=MODEL, prompt=[10**6], stream=True)


def test_stage_error_after_the_stream_started_is_an_error_event(stack):
    """An error that comes after tokens were sent can only be an event: the status line is long gone."""
    body = {**LONG, "stream": True, "timeout": 1}
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        data = sse_payloads("".join(resp.iter_text()))
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["code"] == "request_timeout"
