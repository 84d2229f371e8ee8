"""The completions and chat surface SGLang's TestOpenAIServer exercises (our own tests of the same
semantics): echo x logprobs x list prompts x n x token-id prompts, streamed and not; chat with logprobs
and n; then best_of, logit_bias, cached prompt tokens, priority, continuous usage and suffix."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from tests.support.stack import MODEL

pytestmark = pytest.mark.timeout(120)
TEXTS = ["The capital of France is", "Once upon a time"]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def tok(demo_model_dir):
    return AutoTokenizer.from_pretrained(demo_model_dir)


def post(stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{stack.base_url}{path}", json=body, timeout=60)


def streamed_choices(resp: httpx.Response) -> dict[int, dict]:
    """Per choice index: its text and logprobs, joined over the chunks, and its finish reason."""
    out: dict[int, dict] = {}
    for line in resp.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for c in json.loads(line[6:])["choices"]:
            acc = out.setdefault(c["index"], {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [],
                                              "finish_reason": None})
            acc["text"] += c["text"]
            if c["logprobs"]:
                for key in ("tokens", "token_logprobs", "top_logprobs"):
                    acc[key] += c["logprobs"][key]
            acc["finish_reason"] = c["finish_reason"] or acc["finish_reason"]
    return out


@pytest.mark.parametrize("echo", [False, True])
@pytest.mark.parametrize("logprobs", [None, 3])
@pytest.mark.parametrize("kind", ["text", "ids", "texts", "id_lists"])
@pytest.mark.parametrize("n", [1, 2])
def test_completion_echo_logprobs_prompts_n(stack, tok, echo, logprobs, kind, n):
    ids = [tok(t)["input_ids"] for t in TEXTS]
    prompt = {"text": TEXTS[0], "ids": ids[0], "texts": TEXTS, "id_lists": ids}[kind]
    texts = TEXTS[:1] if kind in ("text", "ids") else TEXTS
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "n": n, "echo": echo,
            "logprobs": logprobs, "ignore_eos": True}
    full = post(stack, "/v1/completions", body)
    assert full.status_code == 200, full.text
    r = full.json()
    assert [c["index"] for c in r["choices"]] == list(range(len(texts) * n))
    prompt_tokens = sum(len(tok(t)["input_ids"]) for t in texts)
    assert r["usage"]["prompt_tokens"] == prompt_tokens
    assert r["usage"]["completion_tokens"] == len(texts) * n * MAX_TOKENS
    streamed = streamed_choices(post(stack, "/v1/completions", {**body, "stream": True}))
    for c in r["choices"]:
        source = texts[c["index"] // n]
        assert c["text"].startswith(source) == echo
        assert streamed[c["index"]]["text"] == c["text"]  # greedy: a stream says exactly the same
        assert streamed[c["index"]]["finish_reason"] == c["finish_reason"] == "length"
        if logprobs is None:
            assert c["logprobs"] is None
            continue
        lp = c["logprobs"]
        expected = MAX_TOKENS + (len(tok(source)["input_ids"]) if echo else 0)
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == expected
        assert "".join(lp["tokens"]) == c["text"]
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        if echo:  # the prompt's first token has no logprob
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        scored = [(v, top) for v, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True) if v is not None]
        assert all(v <= 0 and 1 <= len(top) <= 3 for v, top in scored)
        assert streamed[c["index"]]["tokens"] == lp["tokens"]  # a token held back for UTF-8 keeps its logprob
        assert streamed[c["index"]]["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_with_logprobs_and_n(stack, stream):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "n": 2,
            "logprobs": True, "top_logprobs": 2, "seed": 9, "ignore_eos": True, "stream": stream}
    resp = post(stack, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    if stream:
        content: dict[int, list] = {}
        for line in resp.text.splitlines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    content.setdefault(c["index"], []).extend((c["logprobs"] or {}).get("content") or [])
    else:
        content = {c["index"]: c["logprobs"]["content"] for c in resp.json()["choices"]}
    assert sorted(content) == [0, 1]
    assert all(len(v) == 5 and all(len(t["top_logprobs"]) == 2 for t in v) for v in content.values())


def test_best_of_returns_the_choice_with_the_highest_cumulative_logprob(stack):
    base = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0, "seed": 5,
            "ignore_eos": True}
    every = post(stack, "/v1/completions", {**base, "n": 3, "logprobs": 0}).json()["choices"]
    best = post(stack, "/v1/completions", {**base, "n": 1, "best_of": 3}).json()
    ranked = sorted(every, key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    assert [c["text"] for c in best["choices"]] == [ranked[0]["text"]]
    assert best["choices"][0]["logprobs"] is None  # not asked for
    assert best["usage"]["completion_tokens"] == 18  # every candidate ran


def test_logit_bias_steers_every_token(stack, tok):
    target = tok("the", add_special_tokens=False)["input_ids"][0]
    r = post(stack, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 5, "temperature": 1.0,
                                        "logit_bias": {str(target): 100}, "logprobs": 0}).json()
    assert r["choices"][0]["logprobs"]["tokens"] == [tok.decode([target])] * 5
    bad = post(stack, "/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"the": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def test_cached_prompt_tokens_are_reported(stack):
    prompt = "A long shared prefix that the prefix cache keeps in full pages of sixteen tokens each " * 3
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    post(stack, "/v1/completions", body)
    usage = post(stack, "/v1/completions", body).json()["usage"]
    assert 16 <= usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
    chunks = [json.loads(x[6:]) for x in post(stack, "/v1/completions", {
        **body, "max_tokens": 4, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).text.splitlines()
        if x.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 4 and all(c["usage"]["prompt_tokens"] for c in chunks)


def test_priority_is_accepted_and_suffix_needs_a_fim_template(stack):
    ok = post(stack, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, "priority": -5})
    assert ok.status_code == 200, ok.text
    resp = post(stack, "/v1/completions", {"model": MODEL, "prompt": "def f(", "suffix": "\n    return x"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "suffix"
    assert "fill-in-the-middle" in resp.json()["error"]["message"]


def test_a_null_prompt_is_openais_default(stack, tok):
    """OpenAI's prompt is nullable and defaults to `<|endoftext|>`: null or omitted, the prompt is that one token
    (the demo vocabulary has it), echoed as its text."""
    (endoftext,) = tok.encode("<|endoftext|>", add_special_tokens=False)
    for body in ({"prompt": None}, {}):
        resp = post(stack, "/v1/completions", {"model": MODEL, "max_tokens": 2, **body})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["prompt_tokens"] == 1
    explicit = post(stack, "/v1/completions", {"model": MODEL, "max_tokens": 4, "temperature": 0,
                                               "prompt": [endoftext]}).json()
    default = post(stack, "/v1/completions", {"model": MODEL, "max_tokens": 4, "temperature": 0,
                                              "prompt": None}).json()
    assert default["choices"][0]["text"] == explicit["choices"][0]["text"]
