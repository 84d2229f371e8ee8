"""A pipeline on the synthetic engine streams exactly the tokens the engine's hash names, through every stage
and the official openai client: what bench/run_all.py relies on to measure the plumbing alone."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from services.scheduler.engine.factory import build_engine
from shared.settings import SchedulerSettings
from tests.support.helpers import wait_for, workers
from tests.support.stack import MODEL, running_pipeline

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def synthetic(redis_server, demo_model_dir, tmp_path_factory):
    with running_pipeline(redis_server, demo_model_dir, tmp_path_factory, "synth", RSINFER_ENGINE="synthetic",
                          RSINFER_STEP_MS="5", RSINFER_MAX_RUNNING="64") as s:
        yield s


@pytest.fixture(scope="module")
def reference(demo_model_dir):
    """The same engine in-process (same vocabulary): the tokens each request must get."""
    return build_engine(SchedulerSettings(engine="synthetic", step_ms=0), str(demo_model_dir))


async def _stream(client, i: int) -> tuple[str, dict[int, str], dict[int, str], int]:
    stream = await client.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=8 + i, n=2,
                                             stream=True, stream_options={"include_usage": True})
    texts, finish, usage, rid = {0: "", 1: ""}, {}, 0, ""
    async for c in stream:
        rid = c.id
        if c.usage:
            usage = c.usage.completion_tokens
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    return rid.removeprefix("cmpl-"), texts, finish, usage


async def test_concurrent_streams_carry_the_deterministic_tokens(synthetic, reference, demo_model_dir):
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    results = await asyncio.gather(*(_stream(synthetic.async_client(), i) for i in range(24)))
    for i, (uid, texts, finish, usage) in enumerate(results):
        assert finish == {0: "length", 1: "length"}, (i, finish)
        assert usage == 2 * (8 + i)
        for k in (0, 1):
            assert texts[k] == tok.decode(reference.expected_ids(uid, k, 8 + i), skip_special_tokens=True), (i, k)
    assert len({t for _, texts, _, _ in results for t in texts.values()}) == 48


def test_chat_stream_and_heartbeat(synthetic, reference, demo_model_dir):
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    chunks = list(synthetic.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=33, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 33
    assert text == tok.decode(reference.expected_ids(chunks[0].id.removeprefix("chatcmpl-"), 0, 33),
                              skip_special_tokens=True)
    (load,) = [w.load for w in workers(synthetic, "scheduler")]
    assert load["engine"] == "synthetic" and load["step_ms"] == 5.0 and load["dtype"] is None
    wait_for(lambda: [w.load["running"] for w in workers(synthetic, "scheduler")] == [0])  # every slot back
