"""The official openai client, streaming and not, against `rsinfer up`; bodies in OpenAI's shape."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.support.stack import MODEL

pytestmark = pytest.mark.timeout(60)
HELLO = [{"role": "user", "content": "Hello there"}]


def test_models_lists_the_served_model(stack):
    models = stack.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == 4096  # what vLLM and SGLang clients read
    assert models.data[0].state == "ready"
    assert models.data[0].workers == {"tokenizer": 1, "scheduler": 1, "detokenizer": 1}


def test_retrieve_model(stack, demo_model_dir):
    client = stack.client()
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model" and model.owned_by == "rsinfer"
    assert model.max_model_len == 4096 and model.root == str(demo_model_dir) and model.parent is None
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    resp = httpx.get(f"{stack.base_url}/v1/models/org/no-such-model")  # names may hold a slash
    assert resp.status_code == 404 and set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_chat_non_stream_has_usage_and_length_finish(stack):
    r = stack.client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=9, temperature=0,
                                               extra_body={"ignore_eos": True})  # the demo model ends its answers
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 9
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 9


def test_chat_stream_matches_non_stream(stack):
    client = stack.client()
    full = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_sse_wire_format(stack):
    """Raw SSE: event ids, null finish_reason until the last chunk, [DONE] at the end."""
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 6, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    data = [line[6:] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    payloads = [json.loads(d) for d in data[:-1]]
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)
    assert all("finish_reason" in p["choices"][0] and "logprobs" in p["choices"][0] for p in payloads)
    assert [p["choices"][0]["finish_reason"] for p in payloads][-1] == "length"
    assert any(line.startswith("id: ") for line in lines)


def test_completions_stream_and_not(stack):
    client = stack.client()
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True) if c.choices)
    assert streamed == full.choices[0].text


def test_completion_from_token_ids(stack):
    r = stack.client().completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 4


def test_n_choices_each_complete(stack):
    r = stack.client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, n=3, temperature=1.0,
                                               seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 15


def test_logprobs_of_chosen_tokens(stack):
    r = stack.client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0,
                                               logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)
    # greedy: the chosen token is the most likely one
    assert all(abs(t.logprob - t.top_logprobs[0].logprob) < 1e-4 for t in content)


def test_native_generate(stack):
    r = httpx.post(f"{stack.base_url}/generate", json={"text": "Hello", "sampling_params": {
        "max_new_tokens": 5, "temperature": 0}}, timeout=30).json()
    assert len(r["output_ids"]) == 5 and r["meta_info"]["finish_reason"] == {"type": "length"}
    metrics = httpx.get(f"{stack.base_url}/metrics").text  # /generate is counted in and out like the rest
    assert f'rsinfer_inflight_requests{{model="{MODEL}"}} 0.0' in metrics


def test_the_demo_model_ends_its_answers(stack):
    """The demo model, trained at creation, ends a free answer by itself (8 choices, at least 6 within 32 tokens;
    before, random weights ran every one to max_tokens)."""
    r = stack.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=32, n=8)
    assert sum(c.finish_reason == "stop" for c in r.choices) >= 6, [c.message.content for c in r.choices]


def test_a_request_without_max_tokens_gets_the_model_s_default_budget(stack):
    """The demo checkpoint's generation_config.json max_new_tokens (256) is what chat, completions' `null` and
    the Responses API generate at most without a budget, recorded as the request's max_tokens (before: up to the
    4,096-token context; the previous_response_id example, then in the README, ran 20 s)."""
    client = stack.client()
    r = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, extra_body={"ignore_eos": True})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 256)
    c = httpx.post(f"{stack.base_url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": None, "ignore_eos": True}).json()
    assert (c["choices"][0]["finish_reason"], c["usage"]["completion_tokens"]) == ("length", 256)
    resp = client.responses.create(model=MODEL, input="Hi", temperature=0)
    uid = resp.id.removeprefix("resp_")
    assert stack.redis().hget(stack.keys.request(uid), "max_tokens") == "256"
    assert resp.usage.output_tokens <= 256


def test_health_and_ready(stack):
    """/ready: this API takes requests (Redis answers, not draining); the live workers per stage of each
    model are in the body for operators, but a model with none would not make it 503
    (tests/e2e/test_scale_to_zero.py)."""
    health = httpx.get(f"{stack.base_url}/health").json()
    assert health == {"status": "ok", "pid": health["pid"]} and isinstance(health["pid"], int)  # which process
    ready = httpx.get(f"{stack.base_url}/ready")
    assert ready.status_code == 200 and ready.json() == {"ready": True, "redis": True, "draining": False, "models": {
        MODEL: {"tokenizer": 1, "scheduler": 1, "detokenizer": 1}}}


def test_metrics_expose_pipeline_gauges(stack):
    stack.client().chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    text = httpx.get(f"{stack.base_url}/metrics").text
    assert f'rsinfer_stage_workers{{model="{MODEL}",stage="scheduler"}} 1.0' in text
    assert "rsinfer_generated_tokens_total" in text


def test_an_end_decided_by_a_stage_is_counted_under_its_reason(stack):
    """A 400 from the tokenizer is a `rejected` request in the metrics, not a client that went away."""
    def count(status: str) -> float:
        for line in httpx.get(f"{stack.base_url}/metrics").text.splitlines():
            if line.startswith("rsinfer_http_requests_total{") and f'status="{status}"' in line and \
                    'endpoint="stream"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = count("rejected"), count("client_disconnected")
    for stream in (True, False):
        resp = httpx.post(f"{stack.base_url}/v1/completions", json={"model": MODEL, "prompt": [10**6],
                                                                     "stream": stream}, timeout=30)
        assert resp.status_code == 400
    assert (count("rejected"), count("client_disconnected")) == (before[0] + 1, before[1])
