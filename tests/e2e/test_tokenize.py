"""POST /tokenize and /detokenize through real processes: answered by the tokenizer stage (the API loads no
tokenizer), with the demo model's chat template; the counts are the usage.prompt_tokens of the same generation
request; limits and model checks refuse with a 400/404 naming the field; and it answers with no scheduler at all
(an API and a tokenizer only), while a query no tokenizer takes in time ends with a 504 and its abort flag."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.helpers import wait_for, workers
from tests.support.stack import LIFECYCLE_ENV, MODEL, Stack, new_stack

pytestmark = pytest.mark.timeout(180)
TEXT = "Hello wörld 🌍 你好，世界"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": TEXT}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def post(s: Stack, path: str, body: dict, timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{s.base_url}{path}", json=body, timeout=timeout)


def tokens(s: Stack, **body) -> dict:
    r = post(s, "/tokenize", {"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.mark.parametrize("chat", [
    {"messages": CHAT},
    {"messages": CHAT, "tools": TOOLS},
    {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": True}},
    {"messages": [*CHAT, {"role": "assistant", "content": "Sure:"}], "continue_final_message": True},
])
def test_chat_counts_are_the_chat_requests_prompt_tokens(stack, chat):
    got = tokens(stack, **chat)
    assert got["count"] == len(got["tokens"]) > 0 and got["max_model_len"] > 0
    extra = {k: v for k, v in chat.items() if k != "messages"}
    done = stack.client().chat.completions.create(model=MODEL, messages=chat["messages"], max_tokens=1,
                                                  extra_body=extra)
    assert done.usage.prompt_tokens == got["count"]


def test_prompt_round_trip_and_completion_usage(stack):
    got = tokens(stack, prompt=TEXT, return_token_strs=True)
    assert len(got["token_strs"]) == got["count"]
    done = stack.client().completions.create(model=MODEL, prompt=TEXT, max_tokens=1)
    assert done.usage.prompt_tokens == got["count"]
    back = post(stack, "/detokenize", {"model": MODEL, "tokens": got["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": TEXT}


def test_chat_template_round_trip(stack):
    chat = tokens(stack, messages=CHAT, add_generation_prompt=False)
    text = post(stack, "/detokenize", {"tokens": chat["tokens"]}).json()["prompt"]  # one model: it may be left out
    assert text == f"<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n{TEXT}<|im_end|>\n"
    assert tokens(stack, prompt=text, add_special_tokens=False)["tokens"] == chat["tokens"]
    with_prompt = tokens(stack, messages=CHAT)
    assert with_prompt["tokens"][:chat["count"]] == chat["tokens"] and with_prompt["count"] > chat["count"]


def test_refusals_name_the_field(stack):
    cases = [({"prompt": "a", "messages": CHAT}, "messages"), ({}, "prompt"),
             ({"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
             ({"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
             ({"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True},
              "continue_final_message"),
             ({"prompt": "a", "echo": True}, "echo")]
    for body, param in cases:
        assert error(post(stack, "/tokenize", {"model": MODEL, **body}), 400)["param"] == param, body
    bad = error(post(stack, "/detokenize", {"model": MODEL, "tokens": [1, 10**9]}), 400)
    assert bad["param"] == "tokens" and "tokens[1]" in bad["message"]
    assert error(post(stack, "/tokenize", {"model": "no-such-model", "prompt": "a"}), 404)["param"] == "model"
    assert error(post(stack, "/detokenize", {"model": MODEL, "tokens": "abc"}), 400)["param"] == "tokens"


def test_counted_in_metrics_and_recorded(stack):
    tokens(stack, prompt="count me")
    lines = httpx.get(f"{stack.base_url}/metrics", timeout=5).text.splitlines()
    assert any(line.startswith(f'rsinfer_http_requests_total{{endpoint="tokenize",model="{MODEL}",status="ok"}}')
               for line in lines), [x for x in lines if "http_requests" in x]


@pytest.fixture(scope="module")
def no_scheduler(redis_server, demo_model_dir, tmp_path_factory) -> Iterator[Stack]:
    """An API alone at first (a short deadline, small limits), then a tokenizer: no scheduler or detokenizer."""
    s = new_stack(redis_server, demo_model_dir, tmp_path_factory, "tok")
    try:
        s.start("api1", "api", RSINFER_MODELS=MODEL, RSINFER_REQUEST_TIMEOUT_S="10",
                RSINFER_MAX_TOKENIZE_CHARS="64", RSINFER_MAX_TOKENIZE_MESSAGES="2",
                RSINFER_MAX_DETOKENIZE_TOKENS="8", **LIFECYCLE_ENV)
        s.wait_ready(model=None)
        yield s
    finally:
        s.stop()


def test_answered_with_no_scheduler(no_scheduler):
    s = no_scheduler
    t0 = time.monotonic()
    late = error(post(s, "/tokenize", {"model": MODEL, "prompt": "nobody tokenizes this"}), 504)  # no tokenizer
    # its deadline, not a hang (a deadline long enough for a busy machine's tokenizer to answer the others)
    assert late["code"] == "request_timeout" and time.monotonic() - t0 < 40
    r = s.redis()
    (uid,) = [k.split("{")[1].rstrip("}") for k in r.scan_iter(match=f"{s.namespace}:req:*")]
    assert r.get(s.keys.abort(uid)) == "timeout" and r.ttl(s.keys.abort(uid)) > 0
    # what KEDA's tokenizer trigger scales on (lagCount of the tokenize stream's group): the query counts
    assert {g["name"]: g["lag"] for g in r.xinfo_groups(s.keys.tokenize(MODEL))}["tokenizer"] == 1

    s.start("tokenizer1", "tokenizer", **LIFECYCLE_ENV)
    wait_for(lambda: workers(s, "tokenizer"), timeout=90, every=0.2)
    got = tokens(s, messages=CHAT[1:])
    assert got["count"] > 0
    assert post(s, "/detokenize", {"model": MODEL, "tokens": got["tokens"][:8]}).status_code == 200
    assert workers(s, "scheduler") == [] and r.xlen(s.keys.schedule(MODEL)) == 0  # nothing went further
    record = r.hgetall(s.keys.request(wait_for(lambda: next(
        (k.split("{")[1].rstrip("}") for k in r.scan_iter(match=f"{s.namespace}:req:*")
         if r.hget(k, "kind") == "tokenize" and r.hget(k, "status") == "finished"), None))))
    assert record["prompt_tokens"] == str(got["count"]) and record["model"] == MODEL
    for key in r.scan_iter(match=f"{s.namespace}:*"):
        if key.startswith((f"{s.namespace}:req:", f"{s.namespace}:reply:", f"{s.namespace}:abort:")):
            assert r.ttl(key) > 0, key  # every key a query leaves expires
    assert wait_for(lambda: r.hget(s.keys.request(uid), "status") == "aborted", timeout=10)  # skipped
    assert {g["name"]: g["lag"] for g in r.xinfo_groups(s.keys.tokenize(MODEL))}["tokenizer"] == 0


def test_limits_of_a_query(no_scheduler):
    s = no_scheduler
    assert error(post(s, "/tokenize", {"model": MODEL, "prompt": "x" * 65}), 400)["param"] == "prompt"
    long_chat = [{"role": "user", "content": "x" * 65}]
    assert error(post(s, "/tokenize", {"model": MODEL, "messages": long_chat}), 400)["param"] == "messages"
    three = [{"role": "user", "content": "a"}] * 3
    assert error(post(s, "/tokenize", {"model": MODEL, "messages": three}), 400)["param"] == "messages"
    nine = error(post(s, "/detokenize", {"model": MODEL, "tokens": [1] * 9}), 400)
    assert nine["param"] == "tokens" and "--max-detokenize-tokens" in nine["message"]


def test_inspect_shows_queries(no_scheduler):
    s = no_scheduler
    tokens(s, prompt="inspect me")
    env = {**os.environ, "RSINFER_REDIS_URL": s.redis_url, "RSINFER_NAMESPACE": s.namespace}
    out = subprocess.run([sys.executable, "-m", "rsinfer.cli", "inspect", "--all"], env=env, capture_output=True,
                         text=True, timeout=60)  # --all: finished ones too (the overview lists those in flight)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()]
    assert any(row[1:3] == ["finished", "tokenize"] for row in rows if len(row) > 3), out.stdout
