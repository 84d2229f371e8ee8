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

    def follow():
        with httpx.stream("GET", f"{stack.base_url}/v1/requests/{uid}/stream", timeout=30) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:])["choices"][0]["text"])

    reader = threading.Thread(target=follow)
    reader.start()
    time.sleep(0.3)
    for i, token in enumerate(ids):  # one engine step per token, as the scheduler sends them
        delta = TokenDelta(uid=uid, start=i, ids=[token], prompt_tokens=3, context=ids[max(0, i - 8):i],
                           finish="length" if i == len(ids) - 1 else None)
        r.xadd(stack.keys.detokenize(MODEL), {streams.FIELD: encode(DetokenizeBatch("test", i, [delta]))})
        time.sleep(0.01)
    reader.join(30)
    assert "".join(chunks) == TEXT
    assert all("\ufffd" not in c for c in chunks), chunks
    assert len([c for c in chunks if c]) > 10  # it really streamed piece by piece

