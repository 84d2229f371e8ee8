"""services/api/answer/limits.py and the edge's body reader: what one request may ask for, each limit a setting."""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson
import pytest

from services.api.answer.limits import Limits, depth_over, jobs_fit_context
from services.api.answer.request.early_end import StageFailed, ended_early
from services.api.answer.schemas.submission import Budget
from services.api.edge.app import BodyReader, create_app
from services.api.errors import ApiError
from shared.messages import ChatMessage, Guided, ReplyError, SamplingParams, TokenizeJob
from shared.settings import ApiSettings

pytestmark = pytest.mark.timeout(30)
DEAD_REDIS = "redis://127.0.0.1:1/0"


def limits(**kw) -> Limits:
    return Limits(ApiSettings(redis_url=DEAD_REDIS, **kw))


def refusal(call, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        call(*args)
    assert info.value.status == 400
    return info.value


def test_depth_is_measured_on_the_text():
    assert depth_over(b"[" * 100_000 + b"]" * 100_000, 64)  # far past any recursion limit
    assert not depth_over(orjson.dumps({"a": [[1, 2], {"b": []}]}), 4)  # object, list, list or object, list
    assert depth_over(orjson.dumps({"a": [[1, 2], {"b": []}]}), 3)
    assert not depth_over(orjson.dumps({"s": "[[[[{{{{\\\"[[[", "t": ["]]]"]}), 2)  # brackets in strings
    assert depth_over(orjson.dumps({"s": "\\", "t": [[[]]]}), 3)
    many = orjson.dumps({"prompt": [list(range(1000)) for _ in range(3000)]})  # 11 MiB of token ids
    t0 = time.thread_time()  # this thread's CPU time, which other busy processes do not stretch
    assert not depth_over(many, 64)
    assert time.thread_time() - t0 < 0.5  # ~0.04 s: at C speed (a walk of its 3M elements takes ~0.3 s)


def test_the_field_too_deep_is_named():
    lim = limits(max_json_depth=4)
    body = {"model": "m", "ok": [[1]], "bad": {"a": [[[]]]}}
    err = refusal(lim.nesting, orjson.dumps(body), body)
    assert err.param == "bad" and "more than 4 deep" in err.message
    lim.nesting(orjson.dumps({"ok": [[[]]]}), {"ok": [[[]]]})
    deep = orjson.loads(b"[" * 1000 + b"]" * 1000)  # past what orjson writes back (255 levels)
    assert refusal(lim.nesting, b'{"x": ' + b"[" * 1000 + b"]" * 1000 + b"}", {"x": deep}).param == "x"


def test_stop_strings_are_counted_in_utf8_bytes():
    lim = limits(max_stop_bytes=8, max_stop_total_bytes=12)
    lim.sampling(SamplingParams(stop=["12345678", "abcd"]))
    assert refusal(lim.sampling, SamplingParams(stop=["ééééé"])).param == "stop"  # 5 characters, 10 bytes
    assert "(--max-stop-total-bytes)" in refusal(lim.sampling, SamplingParams(stop=["1234567", "abcdef"])).message
    assert refusal(lim.sampling, SamplingParams(stop=["é" * 5]), "sampling_params.").param == "sampling_params.stop"


def test_a_constraint_is_named_by_the_field_it_came_from():
    lim = limits(max_constraint_bytes=1024)
    lim.sampling(SamplingParams(guided=Guided("regex", "a" * 1024, param="regex")))
    err = refusal(lim.sampling, SamplingParams(guided=Guided("json_schema", "{" + " " * 1024, param="guided_json")))
    assert err.param == "guided_json" and "(--max-constraint-bytes)" in err.message


def test_an_omitted_max_tokens_counts_as_the_context():
    lim = limits(max_request_tokens=8192)
    lim.fan_out(Budget(1, 2, None), 4096)  # 2 x the context: at the budget
    err = refusal(lim.fan_out, Budget(1, 3, None), 4096)
    assert err.param == "max_tokens" and "12288 tokens" in err.message and "context" in err.message
    lim.fan_out(Budget(1, 2, 100_000), 4096)  # past the context counts as the context: the tokenizer's 400
    lim.fan_out(Budget(1, 1, None), None)  # context unknown: one sequence is always taken...
    assert "not known" in refusal(lim.fan_out, Budget(1, 2, None), None).message  # ...several need max_tokens


def test_an_omitted_max_tokens_counts_as_the_model_s_default_where_it_has_one():
    lim = limits(max_request_tokens=1024)
    lim.fan_out(Budget(1, 4, None), 4096, 256)  # 4 x the default of 256 (the tokenizer gives each that much)
    err = refusal(lim.fan_out, Budget(1, 5, None), 4096, 256)
    assert "1280 tokens" in err.message and "default" in err.message
    lim.fan_out(Budget(1, 1, None), None, 256)  # context unknown: the default bounds it


def test_sequences_tokens_and_logprobs_are_budgeted():
    lim = limits(max_request_sequences=8, max_request_tokens=1000, max_request_logprobs=2000)
    assert refusal(lim.fan_out, Budget(3, 3, 1, choices_param="best_of"), 4096).param == "best_of"
    assert refusal(lim.fan_out, Budget(9, 1, 1), 4096).param == "prompt"
    lim.fan_out(Budget(1, 4, 250), 4096)
    assert refusal(lim.fan_out, Budget(1, 4, 251, tokens_param="max_completion_tokens"), 4096).param == \
        "max_completion_tokens"
    lim.fan_out(Budget(1, 1, 400, logprobs=4), 4096)  # 400 x 5 = 2000
    err = refusal(lim.fan_out, Budget(1, 1, 401, logprobs=4, logprobs_param="top_logprobs"), 4096)
    assert err.param == "top_logprobs" and "2005 logprob entries" in err.message
    # An echoed prompt's logprobs count too, each choice's copy (its tokens bounded by its bytes).
    assert "echoed" in refusal(lim.fan_out, Budget(1, 2, 1, logprobs=0, echo_prompt_tokens=(1000,)), 4096).message


def test_record_fields_follow_openai_limits():
    lim = limits()
    lim.record_fields("u" * 256, "s" * 256, {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)})
    assert refusal(lim.record_fields, "u" * 257).param == "user"
    assert refusal(lim.record_fields, None, "s" * 257).param == "safety_identifier"
    assert refusal(lim.record_fields, None, None, {str(i): "" for i in range(17)}).param == "metadata"


async def _chunks(n: int, size: int, delay: float = 0.0):
    for i in range(n):
        if delay:
            await asyncio.sleep(delay)  # a slow client, the behaviour under test (the reader's own timer ends it)
        yield {"type": "http.request", "body": b"x" * size, "more_body": i < n - 1}


async def _reader(n: int, size: int, limit: int, *, piece_timeout: float = 5.0, delay: float = 0.0) -> int:
    """The bytes a BodyReader (its `limit`, its wait for each piece) lets through of `n` pieces of `size`."""
    source = _chunks(n, size, delay)

    async def receive():
        return await anext(source)

    reader, seen = BodyReader(receive, limit, piece_timeout), 0
    while not reader.whole:
        seen += len((await reader())["body"])
    return seen


async def test_the_body_reader_counts_bytes_as_they_arrive():
    assert await _reader(16, 1024, 16 * 1024) == 16 * 1024
    with pytest.raises(ApiError) as info:
        await _reader(1000, 1024, 16 * 1024)  # no Content-Length: refused at the 17th piece, not at the end
    assert info.value.status == 413 and info.value.close
    with pytest.raises(ApiError) as info:
        await _reader(3, 10, 1024, piece_timeout=0.05, delay=0.2)
    assert info.value.status == 408 and info.value.close


def test_a_stage_refusal_keeps_its_status():
    """A 4xx ReplyError (a grammar the engine could not build, say) is the client's error, not a 500."""
    err = ended_early(StageFailed(ReplyError("bad regex", 400, "invalid_request_error", param="regex")))
    assert (err.status, err.type, err.param, err.reason) == (400, "invalid_request_error", "regex", "rejected")


async def test_field_limits_come_before_anything_needs_redis():
    app = create_app(ApiSettings(redis_url=DEAD_REDIS))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
        resp = await client.post("/v1/chat/completions", json={"model": "m", "messages": [
            {"role": "user", "content": "hi"}], "user": "u" * 300})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "user"


def test_text_that_cannot_fit_the_context_is_refused_before_it_is_queued():
    """A prompt of more bytes than the context's tokens can stand for (the tokenizer's `max_token_bytes`) is a 400
    naming the field; a model that did not say its bound, or text within it, passes."""
    info = {"max_model_len": 100, "max_token_bytes": 10}  # at most 1,000 bytes of text

    def job(**kw) -> TokenizeJob:
        return TokenizeJob(uid="u", model="m", pod="p", created_at=0.0, deadline=1.0, params=SamplingParams(), **kw)

    jobs_fit_context([job(prompt="é" * 500), job(messages=[ChatMessage("user", "x" * 1000)])], info, "prompt")
    jobs_fit_context([job(prompt="x" * 5000)], {"max_model_len": 100}, "prompt")
    for bad, param in ((job(prompt="é" * 501), "prompt"),
                       (job(messages=[ChatMessage("system", "x" * 600), ChatMessage("user", "y" * 401)]), "messages")):
        with pytest.raises(ApiError) as e:
            jobs_fit_context([job(prompt="ok"), bad], info, "prompt")
        assert (e.value.status, e.value.param, e.value.code) == (400, param, "context_length_exceeded")
