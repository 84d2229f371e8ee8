"""A prompt that cannot fit the context is refused before it costs anything, and a huge one holds back nobody:
a 4 MiB prompt once took 23.6 s to be refused by the tokenizer (the demo model's), and a 1-token request sent
0.5 s after it waited as long. The API now refuses it from its bytes before it is queued (the tokenizer keeps
the same check for jobs that reach it otherwise: tests/unit/tokenizer)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.stack import MODEL

pytestmark = pytest.mark.timeout(120)


def test_a_huge_prompt_is_refused_at_once_and_does_not_delay_the_next_request(stack):
    out: dict = {}
    payload = json.dumps({"model": MODEL, "prompt": "lorem ipsum " * (4 * 2**20 // 12), "max_tokens": 1}).encode()
    sending = threading.Event()

    def body() -> Iterator[bytes]:
        yield payload[:2**16]
        sending.set()
        yield payload[2**16:]

    def huge() -> None:
        began = time.monotonic()
        out["huge"] = httpx.post(f"{stack.base_url}/v1/completions", timeout=90, content=body(), headers={
            "content-type": "application/json", "content-length": str(len(payload))})
        out["huge_s"] = time.monotonic() - began

    t = threading.Thread(target=huge)
    t.start()
    assert sending.wait(30), "the huge request was never sent"
    began = time.monotonic()
    small = httpx.post(f"{stack.base_url}/v1/completions", timeout=90, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 1})
    small_s = time.monotonic() - began
    t.join(90)
    assert small.status_code == 200 and small_s < 3.0, small_s
    resp = out["huge"]
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == "context_length_exceeded" and "bytes" in err["message"], err
    assert out["huge_s"] < 5.0, out["huge_s"]  # most of it is the API reading and parsing 4 MiB
    assert err["param"] == "prompt"
    # refused by the API (services/api/answer/limits.py fits_context) before anything of it was queued: no record
    r = stack.redis()
    assert not [k for k in r.scan_iter(match=stack.keys.request_pattern())
                if "bytes" in (r.hget(k, "error") or "") and "cannot fit" in (r.hget(k, "error") or "")]
