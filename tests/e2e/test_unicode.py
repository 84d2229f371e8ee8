"""Chinese and emoji round-trip through the real tokenizer and detokenizer processes, chunk by chunk,
with no replacement characters in any chunk."""

from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import pytest
from transformers import AutoTokenizer

from shared import streams
from shared.messages import DetokenizeBatch, ScheduleJob, TokenDelta, decode, encode
from tests.support.stack import MODEL

pytestmark = pytest.mark.timeout(60)
TEXT = "你好，世界 🌍 KV Cache 是什么？ Redis 流 🚀 works with 中文 and emoji 🤖🧠 together."


def test_tokenizer_stage_encodes_chinese_and_emoji(stack, demo_model_dir):
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    r = stack.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TEXT}],
                                               max_tokens=1)
    uid = r.id.removeprefix("chatcmpl-")
    entries = stack.redis().xrange(stack.keys.schedule(MODEL))
    jobs = [decode(f["data"], ScheduleJob) for _, f in entries]
    job = next(j for j in jobs if j.uid == uid)
    assert TEXT in tok.decode(job.input_ids)
    assert r.usage.prompt_tokens == len(job.input_ids)


def test_detokenizer_holds_partial_characters_chunk_by_chunk(stack, demo_model_dir):
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    ids = tok.encode(TEXT)
    assert any("\ufffd" in tok.decode([t]) for t in ids), "the text must contain tokens that split a character"
    uid = f"unicode-{uuid.uuid4().hex[:8]}"
    r = stack.redis()
    now = time.time()
    r.hset(stack.keys.request(uid), mapping={"kind": "completion", "n": 1, "rid": f"cmpl-{uid}", "model": MODEL,
                                             "created": int(now), "deadline": now + 60})
    chunks: list[str] = []
    following = threading.Event()

    def follow():
        with httpx.stream("GET", f"{stack.base_url}/v1/requests/{uid}/stream", timeout=30) as resp:
            following.set()
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:])["choices"][0]["text"])

    reader = threading.Thread(target=follow)
    reader.start()
    assert following.wait(30), "the follower's stream never opened"
    for i, token in enumerate(ids):  # one engine step per token, as the scheduler sends them
        delta = TokenDelta(uid=uid, start=i, ids=[token], prompt_tokens=3, context=ids[max(0, i - 8):i],
                           finish="length" if i == len(ids) - 1 else None)
        r.xadd(stack.keys.detokenize(MODEL), {streams.FIELD: encode(DetokenizeBatch("test", i, [delta]))})
        time.sleep(0.01)
    reader.join(30)
    assert "".join(chunks) == TEXT
    assert all("\ufffd" not in c for c in chunks), chunks
    assert len([c for c in chunks if c]) > 10  # it really streamed piece by piece



CONSTRAINED = "🌍你好，世界🚀"  # a regex that admits only this text: the demo model must spell it, token by token


def _joined(lps: list) -> str:
    return b"".join(bytes(t.bytes) for t in lps).decode()


@pytest.mark.parametrize("stream", [False, True])
def test_logprob_bytes_rebuild_split_characters(stack, demo_model_dir, stream):
    """Tokens that hold part of a character report their own bytes, so joining a choice's logprob bytes gives its
    text back, chat and completions, streamed and not; and a chunk of such a token, whose text is held back,
    still says `content` (an empty string) beside its logprobs, never an empty delta."""
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    assert any("\ufffd" in tok.decode([t]) for t in tok.encode(CONSTRAINED, add_special_tokens=False))
    client, body = stack.client(), {"model": MODEL, "max_tokens": 40, "extra_body": {"regex": CONSTRAINED}}
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                          top_logprobs=2, stream=stream, **body)
    comp = client.completions.create(prompt="hi", logprobs=2, stream=stream, **body)
    if not stream:
        assert chat.choices[0].message.content == CONSTRAINED
        assert _joined(chat.choices[0].logprobs.content) == CONSTRAINED
        assert comp.choices[0].text == CONSTRAINED
        assert "\ufffd" in "".join(comp.choices[0].logprobs.tokens)  # the split characters' tokens are there
        return
    chunks = [c for c in chat if c.choices]
    with_lps = [c.choices[0] for c in chunks if c.choices[0].logprobs and c.choices[0].logprobs.content]
    assert all(isinstance(c.delta.content, str) for c in with_lps)  # "" while held back, never missing
    assert any(c.delta.content == "" for c in with_lps)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == CONSTRAINED
    assert _joined([t for c in with_lps for t in c.logprobs.content]) == CONSTRAINED
    assert "".join(c.choices[0].text for c in comp if c.choices) == CONSTRAINED
