"""/tokenize and /detokenize answered by the tokenizer stage's code: the same tokens as the generation request of
the same messages or prompt (its usage.prompt_tokens), round trips, and refusals naming the field. The demo
tokenizer and the real Qwen vocabulary (shared/demo_model.py) with the demo's ChatML template."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from services.tokenizer.encode import PromptEncoder
from services.tokenizer.queries import answer
from shared.messages import ChatMessage, ReplyError, SamplingParams, ScheduleJob, TokenizeJob, TokenizerAnswer
from shared.messages import TokenizerQuery as Query

TEXT = "Hello wörld 🌍 你好，世界"
CHAT = [ChatMessage("system", "be brief"), ChatMessage("user", TEXT)]
BASE = dict(uid="u", model="m", pod="p", created_at=0.0, deadline=1e12)
# qwen_tok's users share one xdist worker, where it is made once (tests/unit/conftest.py)
ENCODERS = ["demo", pytest.param("qwen", marks=pytest.mark.xdist_group("qwen_tok"))]


@pytest.fixture(scope="module")
def demo(random_model_dir) -> PromptEncoder:
    return PromptEncoder(AutoTokenizer.from_pretrained(random_model_dir), max_context=64)


@pytest.fixture(scope="module")
def qwen(qwen_tok) -> PromptEncoder:
    return PromptEncoder(qwen_tok, max_context=40960)


def query(**kw) -> Query:
    return Query(**{**BASE, **kw})


def scheduled(encoder: PromptEncoder, **kw) -> ScheduleJob:
    (job,) = encoder.encode([TokenizeJob(**BASE, params=SamplingParams(max_tokens=1), **kw)])
    assert isinstance(job, ScheduleJob), job
    return job


@pytest.mark.parametrize("name", ENCODERS)
def test_counts_are_the_generation_requests_prompt_tokens(request, name):
    enc = request.getfixturevalue(name)
    cases = [{"messages": CHAT}, {"messages": CHAT, "add_generation_prompt": False},
             {"messages": [*CHAT, ChatMessage("assistant", "Sure:")], "add_generation_prompt": False,
              "continue_final_message": True},
             {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": True}}, {"prompt": TEXT}]
    for fields in cases:
        got = answer(enc, query(**fields))
        assert isinstance(got, TokenizerAnswer), got
        assert got.tokens == scheduled(enc, **fields).input_ids
        assert got.count == len(got.tokens) and got.max_model_len == enc.max_context


@pytest.mark.parametrize("name", ENCODERS)
def test_round_trips(request, name):
    enc = request.getfixturevalue(name)
    tokens = answer(enc, query(prompt=TEXT)).tokens
    assert answer(enc, query(op="detokenize", tokens=tokens)).prompt == TEXT
    chat = answer(enc, query(messages=CHAT, return_token_strs=True))
    text = answer(enc, query(op="detokenize", tokens=chat.tokens)).prompt
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>\n") and TEXT in text  # special tokens kept
    assert chat.token_strs == enc.tokenizer.convert_ids_to_tokens(chat.tokens)
    assert answer(enc, query(prompt=text, add_special_tokens=False)).tokens == chat.tokens


def test_special_tokens_as_asked(demo):
    chat = answer(demo, query(messages=CHAT)).tokens
    assert answer(demo, query(messages=CHAT, add_special_tokens=False)).tokens == chat
    assert answer(demo, query(messages=CHAT, add_special_tokens=True)).tokens == demo.tokenizer(
        demo.render_chat(TokenizeJob(**BASE, params=SamplingParams(), messages=CHAT)))["input_ids"]


def test_longer_than_the_context_is_counted_not_refused(demo):
    got = answer(demo, query(prompt="word " * 200))
    assert isinstance(got, TokenizerAnswer) and got.count > demo.max_context


def test_refusals_name_the_field(demo):
    bad = answer(demo, query(op="detokenize", tokens=[1, demo.vocab_size]))
    assert isinstance(bad, ReplyError) and (bad.status, bad.param) == (400, "tokens")
    assert "tokens[1]" in bad.message
    assert answer(demo, query(op="detokenize", tokens=[-1])).param == "tokens"
    kwargs = answer(demo, query(messages=CHAT, chat_template_kwargs={"tokenize": True}))
    assert isinstance(kwargs, ReplyError) and kwargs.param == "chat_template_kwargs"
    roles = answer(demo, query(messages=[ChatMessage("assistant", "x")], add_generation_prompt=False,
                               continue_final_message=True, chat_template_kwargs={"nope": 1}))
    assert isinstance(roles, TokenizerAnswer)  # an unknown template variable is the template's business
    assert answer(demo, query(op="count")).param == "op"
