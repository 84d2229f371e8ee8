"""PromptEncoder: chat template + batched encoding, and refusals that become 400 replies."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from services.tokenizer.encode import PromptEncoder
from shared.messages import ChatMessage, ReplyError, SamplingParams, ScheduleJob, TokenizeJob


@pytest.fixture(scope="module")
def encoder(demo_model_dir):
    return PromptEncoder(AutoTokenizer.from_pretrained(demo_model_dir), max_context=64)


def job(**kw) -> TokenizeJob:
    base = dict(uid="u", model="m", pod="p", created_at=0.0, deadline=1e12, params=SamplingParams())
    return TokenizeJob(**{**base, **kw})


def test_batch_mixes_chat_text_and_ids(encoder):
    jobs = [job(uid="a", messages=[ChatMessage("user", "hello")]), job(uid="b", prompt="hello"),
            job(uid="c", input_ids=[1, 2, 3], params=SamplingParams(max_tokens=5))]
    a, b, c = encoder.encode(jobs)
    assert isinstance(a, ScheduleJob) and isinstance(b, ScheduleJob) and isinstance(c, ScheduleJob)
    tok = encoder.tokenizer
    assert tok.decode(a.input_ids) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(b.input_ids) == "hello"
    assert c.input_ids == [1, 2, 3] and c.params.max_tokens == 5
    # unset max_tokens stays unset: the engine resolves it from the context and its KV pool
    assert a.params.max_tokens is None and b.params.max_tokens is None


def test_refusals(encoder):
    too_long, too_many, empty, bad_id = encoder.encode([
        job(prompt="word " * 100), job(prompt="hi", params=SamplingParams(max_tokens=64)), job(prompt=""),
        job(input_ids=[10**6])])
    assert isinstance(too_long, ReplyError) and too_long.code == "context_length_exceeded"
    assert too_long.status == 400 and "maximum context length is 64" in too_long.message
    assert isinstance(too_many, ReplyError) and too_many.param == "max_tokens"
    assert isinstance(empty, ReplyError) and "empty" in empty.message
    assert isinstance(bad_id, ReplyError) and "outside the vocabulary" in bad_id.message


def test_min_tokens_must_fit_max_tokens_and_the_context(encoder):
    over_max, over_context, fine = encoder.encode([
        job(prompt="hi", params=SamplingParams(max_tokens=4, min_tokens=5)),
        job(prompt="hi", params=SamplingParams(min_tokens=64)),
        job(prompt="hi", params=SamplingParams(min_tokens=40))])
    assert isinstance(over_max, ReplyError) and over_max.param == "min_tokens" and over_max.status == 400
    assert isinstance(over_context, ReplyError) and over_context.param == "min_tokens"
    assert over_context.code == "context_length_exceeded"
    assert isinstance(fine, ScheduleJob) and fine.params.max_tokens is None and fine.params.min_tokens == 40


def test_a_constraint_that_cannot_compile_is_refused_naming_its_field(encoder):
    from shared.messages import Guided

    bad = SamplingParams(guided=Guided("regex", "(a|b", param="regex"))
    good = SamplingParams(guided=Guided("json_schema", '{"type":"object"}', param="response_format"))
    refused, ok = encoder.encode([job(prompt="hi", params=bad), job(prompt="hi", params=good)])
    assert isinstance(refused, ReplyError) and refused.status == 400 and refused.param == "regex"
    assert "unclosed group" in refused.message
    assert isinstance(ok, ScheduleJob) and ok.params.guided == good.guided
