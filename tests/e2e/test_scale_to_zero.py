"""Scale from zero: an API with no tokenizer, scheduler or detokenizer for a model it was told of
(`--models`, as the chart sets it) is ready, lists the model, and takes its requests: they wait in the
model's stream, within their deadlines, for workers to appear. The admission limit (429) and the deadline
(504 before the stream started, an error event after) still apply. Real processes, a real redis-server and
the official openai client."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from rsinfer.launcher import serving
from tests.support.helpers import wait_for
from tests.support.stack import LIFECYCLE_ENV, MODEL, Stack, new_stack

pytestmark = pytest.mark.timeout(180)
PING_S = 1.0  # keep-alive period: the response starts (200 and pings) once no entry came for this long
START_DELAY_S = 5.0
STAGES = ("tokenizer", "scheduler", "detokenizer")
HELLO = [{"role": "user", "content": "hello from zero"}]


@pytest.fixture
def lone_api(request, redis_server, demo_model_dir, tmp_path_factory) -> Iterator[Stack]:
    """An API process alone, told of MODEL; no stage worker of it anywhere (a namespace of its own).
    Indirect parameter: its --max-queued."""
    s = new_stack(redis_server, demo_model_dir, tmp_path_factory, "zero")
    try:
        s.start("api1", "api", RSINFER_MODELS=MODEL, RSINFER_SSE_PING_S=str(PING_S),
                RSINFER_MAX_QUEUED=str(getattr(request, "param", 1024)), **LIFECYCLE_ENV)
        s.wait_ready(model=None)
        yield s
    finally:
        s.stop()


def lag(s: Stack, stage: str) -> float:
    for line in httpx.get(f"{s.base_url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f'rsinfer_stage_lag{{model="{MODEL}",stage="{stage}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return -1.0


def test_ready_and_listed_with_no_worker(lone_api):
    s = lone_api
    ready = httpx.get(f"{s.base_url}/ready", timeout=5)
    assert ready.status_code == 200, ready.text
    assert ready.json()["models"] == {MODEL: dict.fromkeys(STAGES, 0)}  # the operators' per-model view
    client = s.client()
    (card,) = client.models.list().data
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "rsinfer")
    assert card.state == "scaled_to_zero" and card.workers == dict.fromkeys(STAGES, 0)
    assert client.models.retrieve(MODEL).state == "scaled_to_zero"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    with pytest.raises(openai.NotFoundError):  # neither declared nor live: still a 404
        client.chat.completions.create(model="no-such-model", messages=HELLO, max_tokens=2)


def test_deadline_passes_before_any_worker_starts(lone_api):
    """No worker ever comes: 504 when the deadline passes before the stream started (the first keep-alive),
    an error event in the stream after it; never a hang. The request is aborted with reason `timeout`."""
    client = lone_api.client(timeout=30)
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, stream=True,
                                       extra_body={"timeout": 0.5})
    assert err.value.status_code == 504 and err.value.body["code"] == "request_timeout"
    assert time.monotonic() - t0 < 0.5 + PING_S

    t0 = time.monotonic()
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, stream=True,
                                            extra_body={"timeout": 2.5})
    assert stream.response.status_code == 200  # started: no entry within the keep-alive period
    with pytest.raises(openai.APIError) as err:
        list(stream)
    assert err.value.body["code"] == "request_timeout"
    # the deadline is the server's (its timers may fire a few ms early); the bound above only rules out a hang
    assert 2.3 <= time.monotonic() - t0 < 15

    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, extra_body={"timeout": 1})
    assert err.value.status_code == 504 and err.value.body["code"] == "request_timeout"
    r = lone_api.redis()
    aborts = [r.get(k) for k in r.scan_iter(match=lone_api.keys.abort("*"))]
    assert aborts == ["timeout"] * 3, "each one aborted where it waits, so a worker that starts skips it"


@pytest.mark.parametrize("lone_api", [2], indirect=True)
def test_backlog_limit_applies_with_no_worker(lone_api):
    """--max-queued 2: two requests wait for workers, the third is refused with 429 and Retry-After."""
    s = lone_api
    waiting = [threading.Thread(target=httpx.post, args=(f"{s.base_url}/v1/chat/completions",), kwargs={
        "json": {"model": MODEL, "messages": HELLO, "max_tokens": 2, "timeout": 6}, "timeout": 10})
        for _ in range(2)]
    for t in waiting:
        t.start()
    try:
        wait_for(lambda: lag(s, "tokenizer") == 2, timeout=10, every=0.2)  # lag of a group nobody reads yet
        resp = httpx.post(f"{s.base_url}/v1/chat/completions", json={"model": MODEL, "messages": HELLO,
                                                                     "max_tokens": 2}, timeout=10)
        assert resp.status_code == 429, resp.text
        assert resp.headers["Retry-After"] == "1" and resp.json()["error"]["code"] == "overloaded"
    finally:
        for t in waiting:
            t.join(15)
    groups = {g["name"]: g for g in s.redis().xinfo_groups(s.keys.tokenize(MODEL))}
    assert groups["tokenizer"]["consumers"] == 0, "the API made the group (at 0), as a first worker would"


@pytest.mark.parametrize("fair", [False, True], ids=["fifo", "fair"])
def test_request_waits_for_workers_started_later(lone_api, fair):
    """A streaming request for a model at zero waits in the model's stream; its three stages start once it is
    queued there: it completes with the text of an undisturbed run, its first token after they came up.
    fair: the tokenizer with --fair-queueing, so the job is held and released to the schedule stream."""
    s = lone_api
    env = {**LIFECYCLE_ENV, **({"RSINFER_FAIR_QUEUEING": "true"} if fair else {})}
    params = {"model": MODEL, "messages": HELLO, "max_tokens": 16, "temperature": 0,
              "extra_body": {"ignore_eos": True}}  # its 16 tokens: the demo model would end its answer sooner
    got: dict = {"text": "", "finish": None, "first_at": None, "error": None}

    def stream() -> None:
        try:
            for chunk in s.client(timeout=120).chat.completions.create(stream=True, **params):
                for c in chunk.choices:
                    if c.delta.content and got["first_at"] is None:
                        got["first_at"] = time.monotonic()
                    got["text"] += c.delta.content or ""
                    got["finish"] = c.finish_reason or got["finish"]
        except Exception as e:  # reported by the assertions below
            got["error"] = e

    client = threading.Thread(target=stream)
    client.start()
    wait_for(lambda: lag(s, "tokenizer") == 1, timeout=30, every=0.1)  # taken, and waiting for a tokenizer
    assert client.is_alive() and got["first_at"] is None, got
    started_at = time.monotonic()
    for role in STAGES:
        s.start(f"{role}1", role, **env)
    client.join(120)
    assert not client.is_alive() and got["error"] is None, got
    assert got["finish"] == "length" and got["text"]
    assert got["first_at"] > started_at  # nothing came before a worker did

    wait_for(lambda: serving(s.base_url, MODEL), timeout=10)
    undisturbed = s.client().chat.completions.create(**params)
    assert got["text"] == undisturbed.choices[0].message.content
    assert s.client().models.retrieve(MODEL).state == "ready"
