"""A KV cache smaller than the model's context: a request without max_tokens is served up to what the
cache can hold (finish_reason "length" or "stop"), never refused; only a prompt that cannot fit is."""

from __future__ import annotations

import openai
import pytest

from tests.support.stack import MODEL, running_pipeline

pytestmark = pytest.mark.timeout(120)
KV_TOKENS = 256  # the demo model's context is 4096
HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def small_kv(redis_server, demo_model_dir, tmp_path_factory):
    # no default output budget (the demo checkpoint's is 256): a request without max_tokens runs to the KV bound
    with running_pipeline(redis_server, demo_model_dir, tmp_path_factory, "smallkv",
                          RSINFER_MAX_KV_TOKENS=str(KV_TOKENS), RSINFER_DEFAULT_MAX_TOKENS="0") as s:
        yield s


def test_chat_without_max_tokens_runs_to_what_the_kv_cache_holds(small_kv):
    client = small_kv.client()
    r = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == KV_TOKENS
    uid = r.id.removeprefix("chatcmpl-")
    assert small_kv.redis().hget(small_kv.keys.request(uid), "max_tokens") == str(r.usage.completion_tokens)
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["length"], ["stop"])
    assert 0 < chunks[-1].usage.completion_tokens <= KV_TOKENS - chunks[-1].usage.prompt_tokens


def test_prompt_that_cannot_fit_the_kv_cache_is_refused_saying_so(small_kv):
    with pytest.raises(openai.BadRequestError) as e:
        small_kv.client().completions.create(model=MODEL, prompt=list(range(3, 3 + KV_TOKENS)), max_tokens=None)
    err = e.value.body
    assert "does not fit the KV cache" in err["message"] and err["code"] == "context_length_exceeded"
