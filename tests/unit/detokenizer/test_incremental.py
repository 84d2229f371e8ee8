"""Stateless incremental detokenization: text per token range, held-back partial characters, stops."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from services.detokenizer.incremental import Detokenizer, merge_deltas, render_delta, stop_hold, visible
from shared.messages import ReplyEvent, TokenDelta
from shared.reply_order import OrderedReplies

# qwen_tok's users share one xdist worker, where it is made once (tests/unit/conftest.py)
TOKENIZERS = ["demo_tok", pytest.param("qwen_tok", marks=pytest.mark.xdist_group("qwen_tok"))]
TEXT = "你好，世界 🌍 KV Cache 是什么？ Hello world 🚀🤖 ok."


@pytest.fixture(scope="module")
def demo_tok(random_model_dir):
    return AutoTokenizer.from_pretrained(random_model_dir)


def stream_text(tok, ids, step_sizes, stops=(), window=8):
    """Feed ids in steps, each rendered only from a window before it, like separate replicas would."""
    detok, out, i, chunks = Detokenizer(tok), "", 0, []
    while i < len(ids):
        n = step_sizes[len(chunks) % len(step_sizes)]
        new = ids[i:i + n]
        final = i + n >= len(ids)
        delta = TokenDelta(uid="u", start=i, ids=new, prompt_tokens=1, context=ids[max(0, i - window):i],
                           stop=list(stops), finish="length" if final else None)
        r = detok.render([delta])[0]
        chunks.append(r.text)
        out += r.text
        i += n
        if r.stopped:
            return out, chunks, True
    return out, chunks, False


@pytest.mark.parametrize("tok_name", TOKENIZERS)
@pytest.mark.parametrize("steps", [[1], [2], [3, 1], [5]])
def test_chunks_concatenate_to_the_text_without_broken_characters(request, tok_name, steps):
    tok = request.getfixturevalue(tok_name)
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # the text really splits characters across tokens
    text, chunks, _ = stream_text(tok, ids, steps)
    assert text == TEXT
    assert all("\ufffd" not in c for c in chunks)


def test_stop_string_cuts_text_across_steps(demo_tok):
    ids = demo_tok.encode("alpha beta gamma delta", add_special_tokens=False)
    text, chunks, stopped = stream_text(demo_tok, ids, [1], stops=["gamma"], window=8 + 5)
    assert stopped and text == "alpha beta "
    assert all("gam" not in c for c in chunks)


def test_partial_stop_is_held_then_released(demo_tok):
    ids = demo_tok.encode("one two twin", add_special_tokens=False)
    text, _, stopped = stream_text(demo_tok, ids, [1], stops=["two three"], window=8 + 9)
    assert not stopped and text == "one two twin"


def test_stop_hold_and_visible():
    assert stop_hold("abc ga", ["gamma"]) == 2
    assert stop_hold("abc", ["gamma"]) == 0
    assert visible("abc\ufffd", [], final=False) == "abc"
    assert visible("abc\ufffd", [], final=True) == "abc\ufffd"
    assert render_delta("ab", "abcd", [], False).text == "cd"
    assert render_delta("ab ST", "ab STOP rest", ["STOP"], False).text == ""
    assert render_delta("ab ST", "ab STOP rest", ["STOP"], False).stopped


@pytest.fixture(scope="module")
def lone_byte_ids(demo_tok):
    return [i for i in range(len(demo_tok)) if demo_tok.decode([i]) == "\ufffd"]


@pytest.mark.parametrize("seed", range(40))
def test_random_token_streams_are_replica_independent(demo_tok, lone_byte_ids, seed):
    """Random ids heavy in lone UTF-8 bytes (as a random model emits, in runs longer than the context
    window): any step split renders exactly the decoded text, as a peer resuming mid-way must."""
    rng = random.Random(seed)
    ids = [rng.choice(lone_byte_ids) if rng.random() < 0.6 else rng.randrange(len(demo_tok)) for _ in range(120)]
    expected = demo_tok.decode(ids, skip_special_tokens=True)
    for steps in ([1], [3, 1, 4, 1, 5], [16]):
        assert stream_text(demo_tok, ids, steps)[0] == expected


def test_merge_joins_contiguous_steps_of_a_choice():
    a = TokenDelta(uid="u", start=0, ids=[1], prompt_tokens=2)
    b = TokenDelta(uid="v", start=4, ids=[9], prompt_tokens=2)
    c = TokenDelta(uid="u", start=1, ids=[2, 3], prompt_tokens=2, finish="length")
    d = TokenDelta(uid="u", start=7, ids=[5], prompt_tokens=2)  # not contiguous: kept apart
    merged = merge_deltas([a, b, c, d])
    assert [(m.uid, m.start, m.ids, m.finish) for m in merged] == [
        ("u", 0, [1, 2, 3], "length"), ("v", 4, [9], None), ("u", 7, [5], None)]


def test_merge_keeps_steps_written_twice_apart_from_new_ones():
    """Steps [1, 5) and [5, 9) already published, read again with the new [9, 12): joined, they would make
    [1, 12), which overlaps what the API delivered and is dropped there, leaving a gap before [12, ...)."""
    again = [TokenDelta(uid="u", start=1, ids=[1, 2, 3, 4], prompt_tokens=2),
             TokenDelta(uid="u", start=5, ids=[5, 6, 7, 8], prompt_tokens=2)]
    new = [TokenDelta(uid="u", start=9, ids=[9, 10], prompt_tokens=2),
           TokenDelta(uid="u", start=11, ids=[11], prompt_tokens=2)]
    other = TokenDelta(uid="v", start=0, ids=[3], prompt_tokens=2)
    merged = merge_deltas([*again, other, *new], {("u", 0): 9, ("v", 0): 0})
    assert [(m.uid, m.start, m.start + len(m.ids)) for m in merged] == [
        ("u", 1, 5), ("u", 5, 9), ("v", 0, 1), ("u", 9, 12)]
    assert [(m.start, len(m.ids)) for m in merge_deltas([*again, *new])] == [(1, 11)]


def test_merge_never_joins_ranges_of_two_epochs():
    """A scheduler let go after a peer took its request over (epoch 1, resumed at 20) sends the [20, 25) it made
    meanwhile; the successor's [20, 25) and [25, 26) come in the same read. Joined to the stale range, the
    successor's token 25 would be refused with it (shared/reply_order.py), and its client would wait at 25 for
    ever (the gap test_chaos saw once)."""
    successor = [TokenDelta(uid="u", start=s, ids=[100 + s], prompt_tokens=2, epoch=1) for s in range(20, 25)]
    stale = TokenDelta(uid="u", start=20, ids=[7, 7, 7, 7, 7], prompt_tokens=2)
    nxt = TokenDelta(uid="u", start=25, ids=[125], prompt_tokens=2, epoch=1)
    merged = merge_deltas([*successor, stale, nxt])
    assert [(m.epoch, m.start, m.start + len(m.ids)) for m in merged] == [(1, 20, 25), (0, 20, 25), (1, 25, 26)]

    def event(d: TokenDelta) -> ReplyEvent:
        return ReplyEvent(start=d.start, end=d.start + len(d.ids), text="", prompt_tokens=2, ids=d.ids,
                          epoch=d.epoch)

    order = OrderedReplies(1)  # the client had [0, 20) when the successor's fence came
    assert len(order.accept(event(TokenDelta(uid="u", start=0, ids=list(range(20)), prompt_tokens=2)))) == 1
    order.fence(1)
    delivered = [ev for m in merged for ev in order.accept(event(m))]
    assert [t for ev in delivered for t in ev.ids] == [100 + s for s in range(20, 26)]


def test_logprobs_name_tokens(demo_tok):
    ids = demo_tok.encode("hi there", add_special_tokens=False)
    d = TokenDelta(uid="u", start=0, ids=ids, prompt_tokens=1, logprobs=[-0.5] * len(ids),
                   top_logprobs=[[(ids[0], -0.5)]] * len(ids))
    lps = Detokenizer(demo_tok).logprobs(d)
    assert "".join(t.token for t in lps) == "hi there"
    assert lps[0].top_logprobs[0].logprob == -0.5


@pytest.mark.parametrize("tok_name", TOKENIZERS)
def test_the_batched_backend_decode_is_transformers_decode(request, tok_name):
    """Detokenizer.decode_batch takes the Rust backend's batch path; it must give exactly what
    tokenizer.batch_decode gives, special tokens skipped or not."""
    tokenizer = request.getfixturevalue(tok_name)
    detok = Detokenizer(tokenizer)
    assert detok.backend is not None
    rng = random.Random(3)
    windows = [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 20))] for _ in range(50)]
    for skip in (True, False):
        assert detok.decode_batch(windows, skip) == tokenizer.batch_decode(
            windows, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def metaspace_tok():
    from tests.metaspace_tokenizer import metaspace_tokenizer

    return metaspace_tokenizer(64)


@pytest.mark.parametrize("tok_name", TOKENIZERS)
def test_logprob_bytes_are_each_tokens_own(request, tok_name):
    """A token holding part of a character reports its own bytes (not U+FFFD's, nor none): joined, the bytes
    of a choice's tokens are its text, prompt logprobs and top alternatives alike."""
    tok = request.getfixturevalue(tok_name)
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    d = TokenDelta(uid="u", start=0, ids=ids, prompt_tokens=len(ids), logprobs=[-0.5] * len(ids),
                   top_logprobs=[[(t, -0.5)] for t in ids], prompt_ids=ids, prompt_logprobs=[(-1.0, [])] * len(ids))
    detok = Detokenizer(tok)
    lps = detok.logprobs(d)
    assert b"".join(bytes(t.bytes) for t in lps).decode() == TEXT
    assert all(t.bytes == t.top_logprobs[0].bytes and t.bytes for t in lps)
    assert [t.bytes for t in detok.first_range(d)["prompt_logprobs"]] == [t.bytes for t in lps]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert detok.token_bytes(im_end) == list(b"<|im_end|>")  # a special token is its text


def test_logprob_bytes_of_sentencepiece_pieces(metaspace_tok):
    ids = metaspace_tok.encode("Hello world there!", add_special_tokens=False)
    d = TokenDelta(uid="u", start=0, ids=ids, prompt_tokens=1, logprobs=[-0.5] * len(ids))
    assert b"".join(bytes(t.bytes) for t in Detokenizer(metaspace_tok).logprobs(d)) == b" Hello world there!"


def test_a_stop_string_that_cuts_says_which_one():
    """Anthropic's `stop_sequence` (services/api/messages_api/message_format.py): the earliest stop string, of
    two at one place the shorter (it ended first)."""
    assert render_delta("alpha ", "alpha beta gamma", ["gamma", "beta", "bet"], final=False) == \
        render_delta("alpha ", "alpha beta gamma", ["bet", "beta"], final=False)
    r = render_delta("alpha ", "alpha beta gamma", ["gamma", "beta", "bet"], final=False)
    assert (r.text, r.stopped, r.stop) == ("", True, "bet")
    assert render_delta("x", "x gamma", ["gamma"], final=False).stop == "gamma"
    assert render_delta("x", "x game", ["gamma"], final=True).stop is None
