"""A SentencePiece-style (Metaspace) tokenizer through real processes: the demo model's weights with a
locally made Llama/Mistral-like tokenizer. Completion text, streamed and not, is what a reference server
shows, decode(prompt + completion) minus decode(prompt), starting with the first word's leading space."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.messages import ReplyEvent, ScheduleJob, decode
from tests.metaspace_tokenizer import completion_reference, metaspace_tokenizer
from tests.support.stack import MODEL, Stack, running_pipeline

pytestmark = pytest.mark.timeout(120)
WEIGHTS = ("config.json", "generation_config.json", "model.safetensors")


@pytest.fixture(scope="module")
def metaspace_model_dir(demo_model_dir, tmp_path_factory) -> Path:
    """The demo checkpoint's weights with a Metaspace tokenizer of exactly the model's vocabulary size, so
    every id the model emits is a piece (nearly all of them words with a leading "▁")."""
    out = tmp_path_factory.mktemp("models") / "metaspace-demo"
    out.mkdir()
    for name in WEIGHTS:
        shutil.copy(demo_model_dir / name, out / name)
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    metaspace_tokenizer(vocab).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def sp_stack(redis_server, metaspace_model_dir, tmp_path_factory) -> Iterator[Stack]:
    with running_pipeline(redis_server, metaspace_model_dir, tmp_path_factory, "sp") as s:
        yield s


@pytest.fixture(scope="module")
def tok(metaspace_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(metaspace_model_dir)


def reference(stack: Stack, tok, response_id: str) -> str:
    """The reference text for a finished request, from the prompt the scheduler got and the ids it produced."""
    uid = response_id.split("-", 1)[1]
    r = stack.redis()
    jobs = [decode(f["data"], ScheduleJob) for _, f in r.xrange(stack.keys.schedule(MODEL))]
    prompt = next(j.input_ids for j in jobs if j.uid == uid)
    events = sorted((decode(f["data"], ReplyEvent) for _, f in r.xrange(stack.keys.reply(uid))),
                    key=lambda e: e.start)
    completion = [t for e in events for t in e.ids]
    assert tok.convert_ids_to_tokens(completion[0]).startswith("▁"), "the first word must carry a space"
    return completion_reference(tok, prompt, completion)


@pytest.mark.parametrize("prompt", ["Hello", "Hello there world"])
def test_completion_keeps_the_first_space_streamed_and_not(sp_stack, tok, prompt):
    client = sp_stack.client()
    args = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**args)
    expected = reference(sp_stack, tok, full.id)
    assert expected.startswith(" ")
    assert full.choices[0].text == expected
    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference(sp_stack, tok, chunks[0].id)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected


def test_chat_answer_after_control_tokens_keeps_the_first_space(sp_stack, tok):
    """The prompt ends in [/INST] (a special token, skipped): the window still holds the words before it."""
    client = sp_stack.client()
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**args)
    expected = reference(sp_stack, tok, full.id)
    assert expected.startswith(" ")
    assert full.choices[0].message.content == expected
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
