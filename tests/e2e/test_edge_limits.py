"""Issue 18 at the HTTP edge: one request or connection must not exhaust an API process or the broker. Every
input past its limit (shared/settings.py ApiSettings) gets a 4xx in OpenAI's shape naming the field and the
limit, before anything is queued; connections that never finish their request are closed. Real processes
(an API process of its own, on the session stack's workers), real sockets, a real redis-server."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from tests.support.helpers import engines_idle, raw_post, wait_for
from tests.support.stack import MODEL, Stack, new_stack

pytestmark = pytest.mark.timeout(120)
HELLO = [{"role": "user", "content": "hi"}]
EDGE_ENV = {"RSINFER_HEADER_TIMEOUT_S": "2", "RSINFER_BODY_TIMEOUT_S": "2", "RSINFER_KEEP_ALIVE_S": "2",
            "RSINFER_MAX_CONNECTIONS": "256", "RSINFER_MAX_STOP_TOTAL_BYTES": "1024",
            "RSINFER_MAX_REQUEST_TOKENS": "16384", "RSINFER_MAX_REQUEST_LOGPROBS": "65536",
            "RSINFER_MAX_RESPONSE_BYTES": "65536"}


@pytest.fixture(scope="module")
def edge(stack, tmp_path_factory) -> Iterator[Stack]:
    """An API process of its own with a few limits lowered (EDGE_ENV), serving the session stack's workers."""
    s = Stack(stack.redis_url, stack.model_dir, stack.namespace, tmp_path_factory.mktemp("logs-edge"))
    try:
        s.start("api-edge", "api", **EDGE_ENV)
        s.wait_ready()
        yield s
    finally:
        s.stop()


def post(s: Stack, path: str, body: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(f"{s.base_url}{path}", json=body, timeout=60, **kw)


def chat(s: Stack, **fields) -> httpx.Response:
    return post(s, "/v1/chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": 2, **fields})


def refused(resp: httpx.Response, status: int, param: str | None, says: str = "") -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    assert says in err["message"], err
    return err


def queued_so_far(s: Stack) -> int:
    """Tokenize jobs ever added to the model's stream: a refused request must add none."""
    return int(s.redis().xinfo_stream(s.keys.tokenize(MODEL))["entries-added"])


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while data := sock.recv(65536):
        out += data
    return out


def rss(s: Stack, name: str) -> int:
    return psutil.Process(s.procs[name].pid).memory_info().rss


# -- item 1 (the edge's part): stop strings ----------------------------------------------------------------
def test_stop_strings_past_their_limits_are_refused_by_name(edge):
    before = queued_so_far(edge)
    refused(chat(edge, stop="x" * 257), 400, "stop", "256 (--max-stop-bytes)")
    refused(chat(edge, stop=["ok", "é" * 129]), 400, "stop", "258 bytes")  # 129 characters, 258 bytes
    refused(chat(edge, stop=["x" * 256] * 5), 400, "stop", "1024 (--max-stop-total-bytes)")
    refused(post(edge, "/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["y" * 65536] * 16}), 400,
            "stop")
    refused(post(edge, "/generate", {"text": "hi", "sampling_params": {"stop": ["z" * 300]}}), 400,
            "sampling_params.stop")
    assert queued_so_far(edge) == before
    assert chat(edge, stop=["x" * 256] * 4).status_code == 200  # at both limits


# -- item 2: fields kept in the record, and every other free-text field ------------------------------------
@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"user": "u" * 257}, "user", "at most 256"),
    ({"safety_identifier": "s" * 257}, "safety_identifier", "at most 256"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "17 pairs; at most 16"),
    ({"metadata": {"k" * 65: "v"}}, "metadata", "at most 64"),
    ({"metadata": {"k": "v" * 513}}, "metadata", "at most 512"),
])
def test_record_fields_follow_openai_limits(edge, fields, param, says):
    refused(chat(edge, **fields), 400, param, says)


def test_record_fields_at_their_limits_are_kept(edge):
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    resp = chat(edge, user="u" * 256, safety_identifier="s" * 256, metadata=metadata)
    assert resp.status_code == 200, resp.text
    uid = resp.json()["id"].removeprefix("chatcmpl-")
    record = httpx.get(f"{edge.base_url}/v1/requests/{uid}").json()
    assert record["user"] == "u" * 256 and json.loads(record["metadata"]) == metadata


def test_an_8_mib_user_field_leaves_nothing_in_redis(edge):
    r = edge.redis()
    keys = set(r.scan_iter(match=edge.keys.request_pattern(), count=1000))
    before, memory = queued_so_far(edge), r.info("memory")["used_memory"]
    refused(chat(edge, user="u" * (8 << 20)), 400, "user", "at most 256")
    assert queued_so_far(edge) == before
    assert set(r.scan_iter(match=edge.keys.request_pattern(), count=1000)) <= keys
    assert r.info("memory")["used_memory"] - memory < 1 << 20


SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 100}
                                           for i in range(3000)}}  # ~400 KiB as compact JSON
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"regex": "a" * (300 << 10)}, "regex", "(--max-constraint-bytes)"),
    ({"guided_regex": "a" * (300 << 10)}, "guided_regex", "(--max-constraint-bytes)"),
    ({"ebnf": 'root ::= "' + "a" * (300 << 10) + '"'}, "ebnf", "(--max-constraint-bytes)"),
    ({"guided_grammar": 'root ::= "' + "a" * (300 << 10) + '"'}, "guided_grammar", "(--max-constraint-bytes)"),
    ({"json": SCHEMA}, "json", "(--max-constraint-bytes)"),
    ({"guided_json": json.dumps(SCHEMA)}, "guided_json", "(--max-constraint-bytes)"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     "response_format", "(--max-constraint-bytes)"),
    ({"guided_choice": ["c" * 1000] * 300}, "guided_choice", "(--max-constraint-bytes)"),
    ({"tools": [TOOL] * 129}, "tools", "129 tools; at most 128"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "d" * (1 << 20)}}]}, "tools",
     "(--max-tools-bytes)"),
    ({"chat_template_kwargs": {"doc": "d" * (65 << 10)}}, "chat_template_kwargs", "(--max-template-kwargs-bytes)"),
    ({"stop_token_ids": list(range(257))}, "stop_token_ids", "at most 256"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "at most 1024"),
])
def test_free_text_fields_past_their_caps_are_refused_before_anything_is_queued(edge, fields, param, says):
    before = queued_so_far(edge)
    refused(chat(edge, **fields), 400, param, says)
    assert queued_so_far(edge) == before


# -- item 4: the body limit counts bytes as they arrive --------------------------------------------------
def test_a_chunked_body_past_the_limit_is_refused_as_it_arrives(edge):
    before = rss(edge, "api-edge")
    sent = 0

    def body() -> Iterator[bytes]:  # no Content-Length: httpx sends it chunked
        nonlocal sent
        yield b'{"model": "rsinfer-demo", "messages": [{"role": "user", "content": "'
        for _ in range(640):  # 40 MiB
            sent += 65536
            yield b"a" * 65536
        yield b'"}]}'

    resp = post(edge, "/v1/chat/completions", content=body())
    refused(resp, 413, None, "over 16777216 bytes (--max-body-bytes)")
    assert resp.headers["connection"] == "close"
    grown = rss(edge, "api-edge") - before
    print(f"chunked 40 MiB body: {sent >> 20} MiB sent, API RSS {before >> 20} -> {(before + grown) >> 20} MiB")
    # refused at the limit, not read to its end (what loopback's socket buffers took before the close comes on top of
    # the 16 MiB, more on a busy machine)
    assert sent < 36 << 20
    assert grown < 24 << 20
    assert chat(edge).status_code == 200


def test_a_declared_length_past_the_limit_is_refused_unread(edge):
    with socket.create_connection(("127.0.0.1", edge.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 41943040\r\n\r\n{")
        answer = read_to_close(sock).decode()
    assert answer.startswith("HTTP/1.1 413") and "(--max-body-bytes)" in answer, answer


def test_a_body_that_stops_coming_gets_408(edge):
    with socket.create_connection(("127.0.0.1", edge.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\"")
        t0 = time.monotonic()
        answer = read_to_close(sock).decode()
        took = time.monotonic() - t0
    assert answer.startswith("HTTP/1.1 408") and "--body-timeout-s" in answer, answer
    assert 1.5 < took < 6


# -- item 5: fan-out ---------------------------------------------------------------------------------------
def test_output_fan_out_past_the_budget_is_refused(edge):
    before = queued_so_far(edge)
    # The request: 16 x 1500 tokens x 20 top logprobs (a 33 MiB body, API RSS 87 -> 692 MB).
    refused(chat(edge, n=16, max_tokens=1500, logprobs=True, top_logprobs=20), 400, "max_tokens",
            "24000 tokens")
    refused(chat(edge, n=4, max_tokens=1500, logprobs=True, top_logprobs=20), 400, "top_logprobs",
            "(--max-request-logprobs)")
    refused(chat(edge, n=5, max_completion_tokens=4000), 400, "max_completion_tokens", "(--max-request-tokens)")
    prompts = ["p"] * 64
    refused(post(edge, "/v1/completions", {"model": MODEL, "prompt": prompts, "max_tokens": 1, "best_of": 3}), 400,
            "best_of", "192 sequences")
    refused(post(edge, "/v1/completions", {"model": MODEL, "prompt": ["p" * 200] * 64, "max_tokens": 1, "echo": True,
                                           "logprobs": 5, "n": 2}), 400, "logprobs", "echoed prompt tokens")
    assert queued_so_far(edge) == before
    resp = post(edge, "/v1/completions", {"model": MODEL, "prompt": prompts, "max_tokens": 1, "n": 2})
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 128  # at the sequence limit
    # An omitted max_tokens counts as the model's default budget (the demo checkpoint's 256 tokens), which is what
    # its tokenizer gives each choice (before: the whole context, 5 x 4096 = 20480 tokens, refused)
    resp = chat(edge, n=5, max_tokens=None)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] <= 5 * 256, resp.text


def test_at_the_token_budget_a_request_is_taken(edge):
    """16 x 1024 = the budget (16384): taken (the stream is left at its first chunk, which aborts it)."""
    with httpx.stream("POST", f"{edge.base_url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": HELLO, "n": 16, "max_tokens": 1024, "stream": True}) as resp:
        assert resp.status_code == 200
        next(resp.iter_bytes())
    wait_for(lambda: engines_idle(edge), timeout=30, every=0.2)


def test_a_non_stream_answer_past_the_response_cap_is_stopped(edge):
    big = {"n": 4, "max_tokens": 128, "logprobs": True, "top_logprobs": 5, "ignore_eos": True}
    t0 = time.monotonic()
    err = refused(chat(edge, **big), 400, "max_tokens", "65536 bytes (--max-response-bytes)")
    assert err["code"] == "response_too_large"
    wait_for(lambda: engines_idle(edge), timeout=30, every=0.2)  # the request was aborted, not run to its end
    print(f"refused after {time.monotonic() - t0:.2f}s")
    with httpx.stream("POST", f"{edge.base_url}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": HELLO, "stream": True, **big}) as resp:
        assert resp.status_code == 200
        size = sum(len(b) for b in resp.iter_bytes())
    assert size > 65536  # a stream is not held in the API: no cap


@pytest.fixture
def lone_api(redis_server, demo_model_dir, tmp_path_factory) -> Iterator[Stack]:
    """An API process alone with --max-queued 4, told of MODEL; no worker of it (a namespace of its own), so
    whatever it takes stays queued."""
    s = new_stack(redis_server, demo_model_dir, tmp_path_factory, "queue")
    try:
        s.start("api1", "api", RSINFER_MODELS=MODEL, RSINFER_MAX_QUEUED="4", RSINFER_SSE_PING_S="1")
        s.wait_ready(model=None)
        yield s
    finally:
        s.stop()


def test_every_job_of_a_request_counts_against_max_queued(lone_api):
    s = lone_api
    completion = {"model": MODEL, "max_tokens": 1, "timeout": 2}
    refused(post(s, "/v1/completions", {**completion, "prompt": ["a"] * 5}), 400, "prompt", "(--max-queued)")
    waiting = [raw_post(s.port, "/v1/completions", {**completion, "prompt": "a", "timeout": 60})
               for _ in range(3)]
    try:
        wait_for(lambda: s.redis().xlen(s.keys.tokenize(MODEL)) == 3)  # counted at admission (shared/queued.py)
        resp = post(s, "/v1/completions", {**completion, "prompt": ["a", "b"]})
        err = refused(resp, 429, None, "3 requests queued, 3 of them yours, and this one adds 2")
        assert resp.headers["Retry-After"] == "1" and err["code"] == "overloaded"
        one = post(s, "/v1/completions", {**completion, "prompt": ["a"]})
        assert one.status_code == 504, one.text  # taken (3 + 1): it waits for workers until its deadline
    finally:
        for sock in waiting:
            sock.close()


# -- item 6: the server's own limits, on real sockets ------------------------------------------------------
def test_half_sent_requests_are_closed_at_the_header_timeout(edge):
    """300 connections that never finish their head (and with the limit of 256 connections, requests get a 503
    meanwhile) are all closed within the header timeout (2 s here); then requests are served again."""
    socks = []
    opened = time.monotonic()
    try:
        for i in range(300):
            sock = socket.create_connection(("127.0.0.1", edge.port), timeout=10)
            if i % 2:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-")
            socks.append(sock)
        t0 = time.monotonic()
        assert t0 - opened < 1.5, "opening 300 connections took longer than the header timeout allows"
        busy = httpx.get(f"{edge.base_url}/v1/models", timeout=10)
        refused(busy, 503, None, "(--max-connections)")
        assert busy.headers["Retry-After"] == "1"
        answers = [read_to_close(sock) for sock in socks]
        took = time.monotonic() - t0
    finally:
        for sock in socks:
            sock.close()
    assert all(a == b"" for a in answers[::2])  # said nothing: closed
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers[1::2]), {a[:40] for a in answers[1::2]}
    assert took < 6
    assert chat(edge).status_code == 200


def test_a_32_mib_header_is_refused(edge):
    sent = 0
    answer = b""
    with socket.create_connection(("127.0.0.1", edge.port), timeout=10) as sock:
        try:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: ")
            for _ in range(512):  # 32 MiB
                sock.sendall(b"a" * 65536)
                sent += 65536
            sock.sendall(b"\r\n\r\n")
        except OSError:  # the server closed the connection: what it answered is still readable
            pass
        with contextlib.suppress(OSError):  # a reset may come before the answer is read
            answer = sock.recv(65536)
    assert sent < 16 << 20, "the head was read far past its limit"
    assert answer.startswith(b"HTTP/1.1 431") or not answer, answer[:200]
    assert chat(edge).status_code == 200


def test_an_idle_kept_alive_connection_is_closed(edge):
    with socket.create_connection(("127.0.0.1", edge.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while not (b'"status":"ok"' in answer and answer.endswith(b"}")):
            answer += sock.recv(65536)
        t0 = time.monotonic()
        assert sock.recv(65536) == b""
        assert 1.5 < time.monotonic() - t0 < 5  # --keep-alive-s 2


def test_a_pipelined_head_waits_while_a_stream_is_answered(edge):
    """The header timeout (2 s) does not cut a stream whose client sent part of its next request meanwhile:
    read for 3 s past it, then leave (which aborts the stream)."""
    body = json.dumps({"model": MODEL, "messages": HELLO, "max_tokens": 4000, "stream": True,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", edge.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = sock.recv(65536)
        t0 = time.monotonic()
        sock.sendall(b"GET /health HT")
        while time.monotonic() - t0 < 3.0 and b"data: [DONE]" not in got:
            data = sock.recv(65536)
            assert data, got[-300:]  # the server did not close it
            got += data
    assert got.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408" not in got
    assert b"data: [DONE]" not in got, "the stream ended before the header timeout was crossed"
    wait_for(lambda: engines_idle(edge), timeout=30, every=0.2)


# -- item 7: deep nesting is the client's error; a 500 is one log line -----------------------------------
def deep(levels: int) -> str:
    """JSON text of lists nested `levels` deep (json.dumps itself gives up near 1000)."""
    return "[" * levels + "]" * levels


def chat_text(nested: str, **fields) -> str:
    """A chat request's JSON text with `fields`, where the string "NESTED" stands for the JSON text `nested`."""
    body = json.dumps({"model": MODEL, "messages": HELLO, "max_tokens": 2, **fields})
    return body.replace('"NESTED"', nested)


NESTING = {"chat_template_kwargs": {"a": "NESTED"}, "guided_json": {"a": "NESTED"},
           "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"a": "NESTED"}}},
           "tools": [{"type": "function", "function": {"name": "f", "parameters": {"a": "NESTED"}}}]}


@pytest.mark.parametrize("field", list(NESTING))
def test_deeply_nested_json_is_a_400(edge, field):
    # 1000 levels: within orjson's own limit (1024), past what encoders and templates after it take
    resp = post(edge, "/v1/chat/completions", content=chat_text(deep(1000), **{field: NESTING[field]}))
    err = refused(resp, 400, field, "more than 64 deep (--max-json-depth)")
    assert err["code"] == "nesting_too_deep"
    too_deep = chat_text(deep(3000), metadata="NESTED")  # past orjson's own limit
    refused(post(edge, "/v1/chat/completions", content=too_deep), 400, None, "not valid JSON")


def test_nesting_within_the_limit_is_taken(edge):
    resp = post(edge, "/v1/chat/completions", content=chat_text(deep(62), chat_template_kwargs={"a": "NESTED"}))
    assert resp.status_code == 200, resp.text  # 64 levels, the body's own included


def test_no_traceback_in_the_api_log(edge):
    """Everything above was the client's error: the API logged no traceback and no 500."""
    log = (edge.log_dir / "api-edge.log").read_text()
    assert "Traceback" not in log and not re.search(r"unexpected error", log), log[-3000:]


def test_many_connections_do_not_exhaust_the_process(edge):
    """A burst of clients that each open and drop a connection mid-head leaves no connection behind."""
    def burst():
        for _ in range(50):
            with socket.create_connection(("127.0.0.1", edge.port), timeout=10) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHo")
    threads = [threading.Thread(target=burst) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    proc = psutil.Process(edge.procs["api-edge"].pid)
    wait_for(lambda: sum(1 for c in proc.net_connections() if c.status == "ESTABLISHED") < 10, timeout=10)
