"""32 concurrent greedy streams each get exactly the text the same request gets alone."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.stack import MODEL, running_up

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def stack(redis_server, random_model_dir, tmp_path_factory):
    """`rsinfer up` on the demo checkpoint's random twin (tests/conftest.py): random weights give prompts that
    differ only by a number texts of their own; the trained demo model answers them all alike, in a few tokens."""
    with running_up(redis_server, random_model_dir, tmp_path_factory, "conc") as s:
        yield s


async def _stream(client, i: int) -> tuple[str, list[str], int]:
    chunks, finish = [], None
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"Request number {i}: tell me a story"}],
        max_tokens=40 + i % 7, temperature=0, stream=True, stream_options={"include_usage": True})
    usage = 0
    async for c in stream:
        if c.usage:
            usage = c.usage.completion_tokens
        if c.choices:
            chunks.append(c.choices[0].delta.content or "")
            finish = c.choices[0].finish_reason or finish
    assert finish in ("length", "stop")
    return "".join(chunks), chunks, usage


async def test_concurrent_streams_equal_solo_runs(stack):
    client = stack.async_client()
    solo = [await _stream(client, i) for i in range(32)]
    together = await asyncio.gather(*(_stream(client, i) for i in range(32)))
    texts = [t for t, _, _ in solo]
    assert len(set(texts)) > 16, "the greedy outputs should differ between prompts"
    for i, ((alone, _, n_alone), (mixed, _, n_mixed)) in enumerate(zip(solo, together, strict=True)):
        assert mixed == alone, f"request {i} differs when batched"
        assert n_mixed == n_alone
