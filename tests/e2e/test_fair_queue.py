"""Fair queueing between tenants (README, "Tenants"; docs/design.md, "Fair queueing"): the tokenizers hold the
backlog, pending in their group, and release it to the schedulers in turns per tenant.

One stack for the module: two tokenizers with --fair-queueing (watermark 1), one scheduler on the synthetic
engine (20 ms steps, two requests running at most, so that a backlog builds), a detokenizer and an API process
with a keys file of two tenants. Speed is bench/fair_queue.py's; here the order and the durability.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator

import openai
import pytest

from tests.support.helpers import wait_for
from tests.support.stack import MODEL, Stack, new_stack, start_replicas

pytestmark = [pytest.mark.timeout(180)]

A_KEY, B_KEY = "sk-fair-team-a-" + "0" * 20, "sk-fair-team-b-" + "0" * 20
A_FLOOD, A_TOKENS = 30, 20  # 30 requests of 0.4 s of engine time, 2 at a time: 6 s first come first served
ENV = {"RSINFER_ENGINE": "synthetic", "RSINFER_STEP_MS": "20", "RSINFER_MAX_RUNNING": "2",
       "RSINFER_FAIR_QUEUEING": "true", "RSINFER_FAIR_WATERMARK": "1"}


@pytest.fixture(scope="module")
def fair(redis_server, demo_model_dir, tmp_path_factory) -> Iterator[Stack]:
    s = new_stack(redis_server, demo_model_dir, tmp_path_factory, "fair")
    keys_file = s.log_dir / "api-keys.json"
    keys_file.write_text(json.dumps([{"key": A_KEY, "tenant": "team-a"}, {"key": B_KEY, "tenant": "team-b"}]))
    try:
        start_replicas(s, {"tokenizer": 2}, 1, api_key=A_KEY, RSINFER_API_KEYS_FILE=str(keys_file), **ENV)
        yield s
    finally:
        s.stop()


async def one(s: Stack, key: str, max_tokens: int) -> tuple[float, float, int]:
    """A streamed completion: (when its first token came, when it ended, its completion tokens)."""
    client = openai.AsyncOpenAI(base_url=f"{s.base_url}/v1", api_key=key, max_retries=0, timeout=120)
    first, tokens = 0.0, 0
    stream = await client.completions.create(model=MODEL, prompt="hello", max_tokens=max_tokens, stream=True,
                                             stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and not first:
            first = time.monotonic()
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    await client.close()
    return first, time.monotonic(), tokens


def held(s: Stack) -> dict[str, int]:
    """Pending entries of the tokenize stream per tokenizer (the jobs they hold)."""
    summary = s.redis().xpending(s.keys.tokenize(MODEL), "tokenizer")
    return {c["name"]: int(c["pending"]) for c in summary["consumers"]}


async def flood_then_b(s: Stack, during=None) -> tuple[list[tuple[float, float, int]], tuple[float, float, int]]:
    """A's flood, then (its backlog held) one request of B, and `during` while they run; every result."""
    flood = [asyncio.create_task(one(s, A_KEY, A_TOKENS)) for _ in range(A_FLOOD)]
    await asyncio.to_thread(wait_for, lambda: sum(held(s).values()) >= A_FLOOD // 2, 30, 0.05)
    b = asyncio.create_task(one(s, B_KEY, 2))
    if during is not None:
        await asyncio.to_thread(during)
    return await asyncio.gather(*flood), await b


def test_a_late_tenant_is_served_in_turn_not_behind_the_flood(fair):
    a, (b_first, _, b_tokens) = asyncio.run(flood_then_b(fair))
    assert b_tokens == 2 and all(tokens == A_TOKENS for _, _, tokens in a)
    after_b = sum(first > b_first for first, _, _ in a)
    # First come first served, B would start after all 30 (they were queued before it); in turn, after one
    # of A's released jobs and the two running.
    assert after_b >= A_FLOOD // 2, f"only {after_b} of A's {A_FLOOD} queued requests started after B's"
    assert not held(fair) or not sum(held(fair).values())  # every held entry released and acknowledged


def holder(s: Stack) -> str | None:
    """The tokenizer process holding the most of the backlog now (a consumer is named `<worker id>@...`)."""
    holders = {name: n for name, n in held(s).items() if n}
    return max(holders, key=holders.__getitem__).partition("@")[0] if holders else None


def test_held_jobs_survive_a_frozen_and_a_killed_tokenizer(fair):
    """SIGSTOP the tokenizer holding the backlog past the claim idle time (its peer takes what it held; thawed,
    it drops those), then SIGKILL whichever holds it then: every request, A's and B's, ends with all its tokens,
    each exactly once."""
    killed: list[str] = []

    def freeze_then_kill() -> None:
        frozen = holder(fair)
        assert frozen is not None
        fair.send_signal(frozen, signal.SIGSTOP)
        try:
            peer = next(n for n in ("tokenizer1", "tokenizer2") if n != frozen)
            wait_for(lambda: holder(fair) in (peer, None), 10, 0.1)  # claimed after claim_idle_ms (1 s)
            time.sleep(0.5)
        finally:
            fair.send_signal(frozen, signal.SIGCONT)
        if (victim := holder(fair)) is not None:
            fair.kill(victim)
            killed.append(victim)

    try:
        a, (_, _, b_tokens) = asyncio.run(flood_then_b(fair, freeze_then_kill))
        assert b_tokens == 2 and killed, "the backlog was gone before a holder could be killed"
        assert [tokens for _, _, tokens in a] == [A_TOKENS] * A_FLOOD  # usage counts each token once
        wait_for(lambda: not sum(held(fair).values()), 20, 0.1)
    finally:
        for name in killed:
            fair.start(name, "tokenizer", **ENV)
