"""PromptEncoder: chat template + batched encoding, and refusals that become 400 replies."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from services.tokenizer.encode import PromptEncoder
from shared.messages import ChatMessage, ReplyError, SamplingParams, ScheduleJob, TokenizeJob


@pytest.fixture(scope="module")
def encoder(random_model_dir):
    return PromptEncoder(AutoTokenizer.from_pretrained(random_model_dir), max_context=64)


def job(**kw) -> TokenizeJob:
    base = dict(uid="u", model="m", pod="p", created_at=0.0, deadline=1e12, params=SamplingParams())
    return TokenizeJob(**{**base, **kw})


def test_batch_mixes_chat_text_and_ids(encoder):
    jobs = [job(uid="a", messages=[ChatMessage("user", "hello")]), job(uid="b", prompt="hello"),
            job(uid="c", input_ids=[1, 2, 3], params=SamplingParams(max_tokens=5))]
    a, b, c = encoder.encode(jobs)
    assert isinstance(a, ScheduleJob) and isinstance(b, ScheduleJob) and isinstance(c, ScheduleJob)
    tok = encoder.tokenizer
    thinking_off = "<think>\n\n</think>\n\n"
    assert tok.decode(a.input_ids) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n" + thinking_off
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


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_an_omitted_max_tokens_becomes_the_model_s_default(random_model_dir):
    """As vLLM takes generation_config.json's max_new_tokens: for a request without max_tokens, while the context
    leaves room for it (else up to the context, as before: the engine bounds it by its KV cache)."""
    enc = PromptEncoder(AutoTokenizer.from_pretrained(random_model_dir), max_context=64, default_max_tokens=20)
    short, given, at_least, long_prompt = enc.encode([
        job(prompt="hi"), job(prompt="hi", params=SamplingParams(max_tokens=5)),
        job(prompt="hi", params=SamplingParams(min_tokens=30)), job(input_ids=list(range(3, 50)))])
    assert (short.params.max_tokens, given.params.max_tokens, at_least.params.max_tokens) == (20, 5, 30)
    assert long_prompt.params.max_tokens is None  # 47 + 20 does not fit 64: what is left, as without a default
    [unset] = PromptEncoder(enc.tokenizer, max_context=64).encode([job(prompt="hi")])
    assert unset.params.max_tokens is None


def test_formats_are_detected_from_the_chat_template(encoder):
    assert encoder.parsers == {"tool_call_parser": "hermes", "reasoning_parser": "qwen3"}


def test_tools_and_tool_calls_in_the_history_are_rendered(encoder, random_model_dir):
    big = PromptEncoder(AutoTokenizer.from_pretrained(random_model_dir), max_context=4096)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [ChatMessage("user", "weather?"), ChatMessage("assistant", "", tool_calls=[call]),
                ChatMessage("tool", "sunny", tool_call_id="c1")]
    [out] = big.encode([job(messages=messages, tools=[WEATHER])])
    text = big.tokenizer.decode(out.input_ids)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


def test_required_tool_choice_becomes_a_grammar_and_thinking_comes_first(random_model_dir):
    from shared.grammars import check
    from shared.messages import Guided, ToolChoice

    enc = PromptEncoder(AutoTokenizer.from_pretrained(random_model_dir), max_context=4096)
    msgs = [ChatMessage("user", "weather?")]
    [out] = enc.encode([job(messages=msgs, tools=[WEATHER], tool_choice=ToolChoice("required"))])
    g = out.params.guided
    assert (g.kind, g.param, g.after) == ("lark", "tool_choice", []) and check(g) is None  # thinking off
    fmt = SamplingParams(guided=Guided("json_object", param="response_format"))
    thinking, regex = enc.encode([job(messages=msgs, params=fmt, chat_template_kwargs={"enable_thinking": True}),
                                  job(messages=msgs, chat_template_kwargs={"enable_thinking": True},
                                      params=SamplingParams(guided=Guided("regex", "a", param="regex")))])
    ids = enc.tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert (thinking.params.guided.think, thinking.params.guided.after) == (-1, [ids[1]])  # the prompt opened it
    assert regex.params.guided.after == []  # an extension's regex covers the whole answer
    hybrid = AutoTokenizer.from_pretrained(random_model_dir)  # Qwen3's own: the model decides whether it thinks
    hybrid.chat_template = hybrid.chat_template.replace("{{ '<think>\\n' }}", "")
    [decides] = PromptEncoder(hybrid, max_context=4096).encode([
        job(messages=msgs, params=fmt, chat_template_kwargs={"enable_thinking": True})])
    assert (decides.params.guided.think, decides.params.guided.after) == (ids[0], [ids[1]])
    [named] = enc.encode([job(messages=msgs, tools=[WEATHER], tool_choice=ToolChoice("function", "nope"))])
    assert isinstance(named, ReplyError) and named.param == "tool_choice"


def test_chat_template_kwargs_reach_the_template(encoder):
    msgs = [ChatMessage("user", "hi")]
    on, bad = encoder.encode([job(messages=msgs, chat_template_kwargs={"enable_thinking": True}),
                              job(messages=msgs, chat_template_kwargs={"tokenize": True})])
    assert encoder.tokenizer.decode(on.input_ids).endswith("<|im_start|>assistant\n<think>\n")
    assert isinstance(bad, ReplyError) and bad.param == "chat_template_kwargs"


def test_logit_bias_outside_the_vocabulary_is_refused(encoder):
    [out] = encoder.encode([job(prompt="hi", params=SamplingParams(logit_bias={10**6: 5.0}))])
    assert isinstance(out, ReplyError) and out.param == "logit_bias"


def test_a_null_prompt_is_the_default_document_start(encoder):
    """Completions' `"prompt": null`: OpenAI's `<|endoftext|>` where the vocabulary has it."""
    (null,) = encoder.encode([job(prompt=None)])
    assert isinstance(null, ScheduleJob)
    assert null.input_ids == encoder.tokenizer.encode("<|endoftext|>", add_special_tokens=False)
    assert len(null.input_ids) == 1


def test_a_prefill_only_prompt_is_bounded_by_its_limit_and_the_context(encoder):
    from shared.messages import Pooling

    def pooled(limit: int, **kw) -> TokenizeJob:
        return job(params=SamplingParams(max_tokens=1, pooling=Pooling("embed", max_input_tokens=limit,
                                                                       param="input")), **kw)

    fits, over_limit, over_context, bad_id = encoder.encode([
        pooled(8, input_ids=list(range(1, 9))), pooled(8, input_ids=list(range(1, 10))),
        pooled(0, input_ids=[1] * 64), pooled(0, input_ids=[10**6])])
    assert isinstance(fits, ScheduleJob) and fits.params.pooling.task == "embed"
    assert isinstance(over_limit, ReplyError) and over_limit.param == "input" and "--max-pooling-input-tokens" in \
        over_limit.message and over_limit.status == 400
    assert isinstance(over_context, ReplyError) and over_context.param == "input" and "at most 63" in \
        over_context.message and over_context.code == "context_length_exceeded"
    assert isinstance(bad_id, ReplyError) and bad_id.param == "input"
