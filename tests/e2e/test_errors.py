"""Bad input gets a clear 4xx in OpenAI's error shape, never a 500, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from tests.support.helpers import wait_for
from tests.support.stack import MODEL

pytestmark = pytest.mark.timeout(60)
HELLO = [{"role": "user", "content": "hi"}]


def _post(stack, path: str, **kw) -> httpx.Response:
    return httpx.post(f"{stack.base_url}{path}", timeout=30, **kw)


def _assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param
    return err


@pytest.mark.parametrize(("body", "status", "param"), [
    ('{"model": "rsinfer-demo", "messages": [', 400, None),
    ('[1, 2]', 400, None),
    ('{"model": "rsinfer-demo"}', 400, "messages"),
    ('{"model": "rsinfer-demo", "messages": []}', 400, "messages"),
    ('{"model": "rsinfer-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}', 400,
     "max_tokens"),
    ('{"model": "rsinfer-demo", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', 400,
     "temperature"),
    ('{"model": "rsinfer-demo", "messages": [{"role": "wizard", "content": "hi"}]}', 400, "messages"),
    ('{"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}', 404, "model"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', 400, "model"),
])
def test_bad_chat_requests(stack, body, status, param):
    _assert_error(_post(stack, "/v1/chat/completions", content=body), status, param)


def test_prompt_longer_than_context_is_refused(stack):
    long = "word " * 5000  # the demo model's context is 4096 tokens
    err = _assert_error(_post(stack, "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": long}]}), 400)
    assert "context length" in err["message"]
    err = _assert_error(_post(stack, "/v1/completions", json={
        "model": MODEL, "prompt": "hello", "max_tokens": 5000}), 400)
    assert err["code"] == "context_length_exceeded"


def _status(stack, path: str, body: dict) -> tuple[int, str]:
    """An omitted (null) max_tokens runs up to the context (4,096 tokens, seconds to minutes on a loaded machine):
    that one is streamed and only its status read."""
    if body.get("max_tokens", 0) is not None:
        resp = _post(stack, path, json=body)
        return resp.status_code, resp.text
    with httpx.stream("POST", f"{stack.base_url}{path}", json={**body, "stream": True}, timeout=30) as resp:
        return resp.status_code, ""


def test_odd_values_never_give_500(stack):
    odd = [None, "", [], {}, 0, -1, 2**70, "x" * 3, [None], {"a": None}]
    for field in ("model", "messages", "max_tokens", "temperature", "stop", "n", "stream", "top_p", "seed"):
        for value in odd:
            status, text = _status(stack, "/v1/chat/completions",
                                   {"model": MODEL, "messages": HELLO, "max_tokens": 2, field: value})
            assert status < 500, (field, value, text)
        huge = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], "{field}": 1e999}}'
        assert _post(stack, "/v1/chat/completions", content=huge).status_code < 500
    for field in ("prompt", "max_tokens", "logprobs", "echo"):
        for value in odd:
            status, text = _status(stack, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                              field: value})
            assert status < 500, (field, value, text)


def test_unknown_route_and_method_use_the_error_shape(stack):
    _assert_error(httpx.get(f"{stack.base_url}/v1/nothing-here"), 404)
    _assert_error(httpx.get(f"{stack.base_url}/v1/chat/completions"), 405)


def test_server_keeps_serving_after_bad_input(stack):
    for body in ("{", "null", '{"model": 5}'):
        assert _post(stack, "/v1/chat/completions", content=body).status_code == 400
    # ignore_eos: sampled, the demo model may end its answer sooner (once in a full run: 2 tokens, `stop`)
    r = stack.client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3,
                                               extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_malformed_stream_entry_goes_to_dead_letter(stack):
    r = stack.redis()
    key = stack.keys.tokenize(MODEL)
    eid = r.xadd(key, {"data": "{not json"})
    r.xadd(key, {"garbage": "no data field"})
    wait_for(lambda: sum(1 for _, f in r.xrange(stack.keys.dead()) if f.get("stream") == key) >= 2, timeout=10)
    entries = [f for _, f in r.xrange(stack.keys.dead()) if f.get("stream") == key]
    assert any(f["entry_id"] == eid and "DecodeError" in f["error"] for f in entries)
    assert len(entries) >= 2
    assert stack.client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2).usage


@pytest.mark.parametrize(("extra", "param", "says"), [
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "llguidance"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs", "structured outputs"),
    ({"chat_template": "{{ messages }}"}, "chat_template", "not supported"),
    ({"frobnicate": 1}, "frobnicate", "Unrecognized request argument supplied: frobnicate"),
    ({"stream_options": {"include_usage": True, "zzz": 1}}, "stream_options", "stream_options.zzz"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.tool_calls",
     "only assistant"),
    ({"messages": [{"role": "user", "content": "hi", "colour": "red"}]}, "messages", "messages.0.colour"),
    ({"store": True}, "store", "not supported"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "must be one of"),  # OpenAI's values are taken
    ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message",
     "add_generation_prompt true"),
    ({"continue_final_message": True}, "continue_final_message", "assistant"),
])
def test_fields_we_cannot_honour_are_refused_by_name(stack, extra, param, says):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 2, **extra}
    err = _assert_error(_post(stack, "/v1/chat/completions", json=body), 400, param)
    assert says in err["message"]


def test_completions_and_generate_refuse_unknown_fields_too(stack):
    _assert_error(_post(stack, "/v1/completions", json={"model": MODEL, "prompt": "hi", "lora_request": {}}), 400,
                  "lora_request")
    # SGLang's lora_path names an adapter: none is registered here (tests/e2e/test_lora.py serves some)
    _assert_error(_post(stack, "/v1/completions", json={"model": MODEL, "prompt": "hi", "lora_path": "a"}), 404,
                  "lora_path")
    resp = _post(stack, "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2, "lora_path": "a"}})
    assert "lora_path" in _assert_error(resp, 400, "sampling_params")["message"]


def test_fields_that_ask_for_nothing_are_accepted(stack):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 3, "temperature": 0, "store": False, "user": "u-1",
            "service_tier": "auto", "modalities": ["text"], "tool_choice": "none", "parallel_tool_calls": True,
            "metadata": {"team": "a"}, "prompt_cache_key": "k", "safety_identifier": "s"}
    resp = _post(stack, "/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    uid = resp.json()["id"].removeprefix("chatcmpl-")
    record = httpx.get(f"{stack.base_url}/v1/requests/{uid}").json()
    assert record["user"] == "u-1" and record["safety_identifier"] == "s" and record["metadata"] == '{"team":"a"}'


def test_top_p_zero_is_greedy(stack):
    base = {"model": MODEL, "messages": HELLO, "max_tokens": 12, "seed": 5}
    greedy = _post(stack, "/v1/chat/completions", json={**base, "temperature": 0}).json()
    resp = _post(stack, "/v1/chat/completions", json={**base, "temperature": 1.5, "top_p": 0})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]


def test_chat_template_options_are_honoured(stack, demo_model_dir):
    """continue_final_message and add_generation_prompt change the prompt exactly as the template says: the
    chat answer equals a plain completion of the prompt the template renders."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    messages = [{"role": "user", "content": "Write a word"}, {"role": "assistant", "content": "The word is"}]
    # continue_final_message alone infers add_generation_prompt false, as SGLang does
    for options in ({"add_generation_prompt": False, "continue_final_message": True}, {"continue_final_message": True},
                    {"add_generation_prompt": False}, {"add_generation_prompt": True}):
        rendered = tok.apply_chat_template(messages, tokenize=False, **options)
        chat = _post(stack, "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8,
                                                          "temperature": 0, **options}).json()
        plain = _post(stack, "/v1/completions", json={"model": MODEL, "prompt": tok(rendered, add_special_tokens=False)[
            "input_ids"], "max_tokens": 8, "temperature": 0}).json()
        assert chat["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"], options
        assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"], options
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # the demo does not think
