"""The scheduler's windows reach into the prompt while the completion is short, so that the completion's
text is what a reference server shows (decode(prompt + completion) minus decode(prompt)), with the first
word's leading space on SentencePiece-style tokenizers, in every split of steps and from any replica."""

from __future__ import annotations

import random

import msgspec
import pytest
from transformers import AutoTokenizer

from services.detokenizer.incremental import Detokenizer, merge_deltas
from services.scheduler.book import CONTEXT_TOKENS, Running
from services.scheduler.engine.base import StepOutput
from shared.messages import SamplingParams, ScheduleJob, TokenDelta
from tests.metaspace_tokenizer import SPECIALS, completion_reference, metaspace_tokenizer


@pytest.fixture(scope="module")
def tok():
    return metaspace_tokenizer()


def compositions(n: int) -> list[list[int]]:
    """Every way to cut n tokens into steps."""
    if n == 0:
        return [[]]
    return [[k, *rest] for k in range(1, n + 1) for rest in compositions(n - k)]


def peer_delta(prompt: list[int], done: list[int], new: list[int], final: bool, **params) -> TokenDelta:
    """The delta a scheduler sends for `new` after `done`, built afresh each step as a peer resuming the
    request from its reply stream would build it."""
    job = ScheduleJob(uid="u", model="m", pod="p", created_at=0.0, deadline=0.0,
                      params=SamplingParams(**params), input_ids=prompt)
    run = Running("0-0", job, [list(done)])
    delta = run.delta(StepOutput("u", len(done), new, finish_reason="length" if final else None))
    assert delta.stops == len(job.params.stop) and delta.stop == (job.params.stop if not done else [])
    # only a choice's first delta carries the stop strings: the worker fills them in (main.py `_with_stops`)
    return msgspec.structs.replace(delta, stop=job.params.stop)


def stream(tok, prompt: list[int], completion: list[int], steps: list[int], **params) -> tuple[list[str], bool]:
    detok, chunks, i = Detokenizer(tok), [], 0
    for n in steps:
        if i >= len(completion):
            break
        final = i + n >= len(completion)
        r = detok.render([peer_delta(prompt, completion[:i], completion[i:i + n], final, **params)])[0]
        chunks.append(r.text)
        i += n
        if r.stopped:
            return chunks, True
    return chunks, False


def test_first_word_keeps_its_leading_space_in_every_split(tok):
    prompt = tok.encode("Hello")
    completion = tok.encode(" world there!", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(prompt) == ["<s>", "▁Hello"]
    assert tok.convert_ids_to_tokens(completion) == ["▁world", "▁there", "!"]
    assert tok.decode(completion) == "world there!"  # what a window of completion tokens only renders
    expected = completion_reference(tok, prompt, completion)
    assert expected == " world there!"
    for steps in compositions(len(completion)):
        chunks, stopped = stream(tok, prompt, completion, steps)
        assert "".join(chunks) == expected, steps
        assert chunks[0].startswith(" ") and not stopped


def test_non_stream_body_is_the_merged_deltas(tok):
    """A non-stream reply joins the same deltas, merged as the detokenizer merges one read's steps."""
    prompt = tok.encode("Hello")
    completion = tok.encode(" world there!", add_special_tokens=False)
    deltas = [peer_delta(prompt, completion[:i], completion[i:i + 1], i == len(completion) - 1)
              for i in range(len(completion))]
    merged = merge_deltas(deltas)
    assert len(merged) == 1
    assert "".join(r.text for r in Detokenizer(tok).render(merged)) == " world there!"


@pytest.mark.parametrize("skip", [True, False])
def test_prompt_of_special_tokens_only_renders_like_the_reference(tok, skip):
    """A prompt tail of special tokens (as chat templates leave) is decoded as the reference decodes it."""
    prompt = [tok.bos_token_id]
    completion = tok.encode(" world there!", add_special_tokens=False)
    expected = completion_reference(tok, prompt, completion, skip_special_tokens=skip)
    for steps in compositions(len(completion)):
        chunks, _ = stream(tok, prompt, completion, steps, skip_special_tokens=skip)
        assert "".join(chunks) == expected, (steps, skip)


@pytest.mark.parametrize(("stop", "text", "stopped"), [
    (["o w"], " world there!", False),  # would match only across the prompt's end: text stops only on itself
    (["Hello"], " world there!", False),
    ([" there"], " world", True),
    (["d t"], " worl", True),
])
def test_stop_strings_see_only_the_completion(tok, stop, text, stopped):
    prompt = tok.encode("Hello")
    completion = tok.encode(" world there!", add_special_tokens=False)
    for steps in compositions(len(completion)):
        chunks, was_stopped = stream(tok, prompt, completion, steps, stop=stop)
        assert ("".join(chunks), was_stopped) == (text, stopped), steps


def test_windows_past_the_prompt_and_past_the_window(tok):
    """Long prompt, completion longer than the window: the window leaves the prompt as the completion grows."""
    prompt = tok.encode(" ".join(["Hello world there!"] * 6))
    rng = random.Random(0)
    completion = [rng.randrange(len(SPECIALS), len(tok)) for _ in range(3 * CONTEXT_TOKENS)]
    expected = completion_reference(tok, prompt, completion)
    assert expected.startswith(" ") and len(prompt) > CONTEXT_TOKENS
    for steps in ([1], [2], [3, 1], [CONTEXT_TOKENS - 1, 5], [len(completion)]):
        cut = [steps[k % len(steps)] for k in range(len(completion))]
        assert "".join(stream(tok, prompt, completion, cut)[0]) == expected, steps


def test_scheduler_context_is_bounded_and_starts_with_the_prompt_tail():
    prompt, done = list(range(100, 130)), list(range(10))
    assert peer_delta(prompt, [], [7], False).context == prompt[-CONTEXT_TOKENS:]
    assert peer_delta(prompt, done[:3], [7], False).context == prompt[-(CONTEXT_TOKENS - 3):] + done[:3]
    assert peer_delta(prompt, done, [7], False).context == done[-CONTEXT_TOKENS:]
    assert peer_delta(prompt[:2], [], [7], False).context == prompt[:2]
    # A stop string widens the completion's part only: stop strings never look at the prompt.
    assert peer_delta(prompt, done[:1], [7], False, stop=["abcd"]).context == prompt[-(CONTEXT_TOKENS - 1):] + done[:1]
    assert peer_delta(prompt, done, [7], False, stop=["abcd"]).context == done


@pytest.fixture(scope="module")
def demo_tok(random_model_dir):
    return AutoTokenizer.from_pretrained(random_model_dir)


@pytest.mark.parametrize("seed", range(20))
def test_byte_level_prompt_cut_mid_character(demo_tok, seed):
    """Random ids heavy in lone UTF-8 bytes in the prompt and the completion: a character the prompt leaves
    unfinished may be finished by the completion; every split still renders the reference text."""
    lone = [i for i in range(len(demo_tok)) if demo_tok.decode([i]) == "\ufffd"]
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.choice(lone) if rng.random() < 0.6 else rng.randrange(len(demo_tok)) for _ in range(n)]

    prompt, completion = ids(20), ids(30)
    expected = completion_reference(demo_tok, prompt, completion)
    for steps in ([1], [3, 1, 4, 1, 5], [30]):
        cut = [steps[k % len(steps)] for k in range(len(completion))]
        assert "".join(stream(demo_tok, prompt, completion, cut)[0]) == expected, steps


def byte_ids(tok, data: bytes) -> list[int]:
    """One byte-level BPE token per byte (GPT-2's byte-to-character map)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in
                                              enumerate(b for b in range(256) if b not in printable)}
    return tok.convert_tokens_to_ids([chars[b] for b in data])


def splits(n: int, rng: random.Random) -> list[list[int]]:
    if n <= 7:
        return compositions(n)
    return [[1] * n, [n]] + [[rng.randint(1, 3) for _ in range(n)] for _ in range(30)]


@pytest.mark.parametrize("in_prompt", [1, 2, 3])
@pytest.mark.parametrize("garbage", [b"", b"\xe4", b"\xff\xc3", b"\xe4\xff\xc3", b"\xff\xe4\xff\xc3\xff"])
def test_character_the_prompt_left_unfinished(demo_tok, in_prompt, garbage):
    """The prompt ends inside a 4-byte character that the completion finishes, then invalid bytes (held
    back while they could still start a character), then text: every split renders the reference, also
    when the window stops reaching into the prompt in the middle of them."""
    globe = "🌍".encode()
    prompt = demo_tok.encode("Hi ", add_special_tokens=False) + byte_ids(demo_tok, globe[:in_prompt])
    completion = byte_ids(demo_tok, globe[in_prompt:] + garbage + b"ok")
    expected = completion_reference(demo_tok, prompt, completion)
    assert expected.startswith("🌍")
    for steps in splits(len(completion), random.Random(len(completion))):
        assert "".join(stream(demo_tok, prompt, completion, steps)[0]) == expected, steps


def test_a_choice_s_first_range_says_whether_its_prompt_opened_the_thinking(demo_tok):
    """The API reads an answer as reasoning until `</think>` when the prompt opened `<think>` (the demo
    template's with enable_thinking, Qwen3-Thinking's, DeepSeek-R1's): the first range says so, from the prompt's
    last tokens in its context; later ranges and a prompt that closed the thinking say nothing."""
    detok = Detokenizer(demo_tok)
    chat = [{"role": "user", "content": "Paris?"}]
    for thinking in (True, False):
        prompt = demo_tok.apply_chat_template(chat, add_generation_prompt=True, enable_thinking=thinking)
        prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
        first = peer_delta(prompt, [], [5, 6], False)
        assert detok.first_range(first).get("thinking", False) is thinking
        assert "thinking" not in detok.first_range(peer_delta(prompt, [5, 6], [7], False))
