"""Fair queueing between tenants (docs/operator-guide.md and docs/design.md, "Fair queueing"): the tokenizers hold
the backlog, pending in their group, or parked in Redis past their hold's cap, and release it to the schedulers
in turns per tenant; the API counts each tenant's share of the model's queue.

One stack for the module: two tokenizers with --fair-queueing left unset (on: the API has keys), watermark 1, a
hold of 4 jobs each and reads of 2 entries (so that a flood is parked), one scheduler on the synthetic engine
(20 ms steps, two requests running at most, so that a backlog builds), a detokenizer and an API process with a
keys file of two tenants and --max-queued 30. Speed is bench/fair_queue.py's; here the order, the shares and the
durability.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Iterator

import openai
import pytest
import redis

from shared import queued
from tests.support.helpers import wait_for
from tests.support.stack import MODEL, Stack, new_stack, start_replicas

pytestmark = [pytest.mark.timeout(180)]

A_KEY, B_KEY = "sk-fair-team-a-" + "0" * 20, "sk-fair-team-b-" + "0" * 20
A_FLOOD, A_TOKENS = 30, 20  # 30 requests of 0.4 s of engine time, 2 at a time: 6 s first come first served
MAX_QUEUED = 30
ENV = {"RSINFER_ENGINE": "synthetic", "RSINFER_STEP_MS": "20", "RSINFER_MAX_RUNNING": "2",
       "RSINFER_FAIR_WATERMARK": "1", "RSINFER_FAIR_MAX_HELD": "4", "RSINFER_MAX_QUEUED": str(MAX_QUEUED),
       "RSINFER_BATCH_SIZE": "2"}


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


async def one(s: Stack, key: str, max_tokens: int, started: asyncio.Event | None = None) -> tuple[float, float, int]:
    """A streamed completion: (when its first token came, when it ended, its completion tokens); `started` is set
    at its first token."""
    client = openai.AsyncOpenAI(base_url=f"{s.base_url}/v1", api_key=key, max_retries=0, timeout=120)
    first, tokens = 0.0, 0
    stream = await client.completions.create(model=MODEL, prompt="hello", max_tokens=max_tokens, stream=True,
                                             stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and not first:
            first = time.monotonic()
            if started is not None:
                started.set()
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    await client.close()
    return first, time.monotonic(), tokens


def held(s: Stack) -> dict[str, int]:
    """Pending entries per tokenizer (the jobs they hold): of the tokenize stream and of the tenants' parked streams
    (parked jobs read back)."""
    r, out = s.redis(), {}
    for key in (s.keys.tokenize(MODEL), s.keys.parked(MODEL, "team-a"), s.keys.parked(MODEL, "team-b")):
        with contextlib.suppress(redis.ResponseError):  # no such stream (nothing parked)
            for c in r.xpending(key, "tokenizer")["consumers"]:
                out[c["name"]] = out.get(c["name"], 0) + int(c["pending"])
    return out


def parked(s: Stack) -> int:
    """Jobs in the tenants' parked streams (read back or not)."""
    return sum(s.redis().xlen(s.keys.parked(MODEL, t)) for t in ("team-a", "team-b"))


def parked_waiting(s: Stack) -> int:
    """Parked jobs not released yet: undelivered (lag) or read back and held (pending)."""
    r, out = s.redis(), 0
    for t in ("team-a", "team-b"):
        with contextlib.suppress(redis.ResponseError):  # no such stream
            out += sum(int(g["lag"] or 0) + int(g["pending"]) for g in r.xinfo_groups(s.keys.parked(MODEL, t)))
    return out


def queue(s: Stack) -> dict[str, int]:
    """The model's queue count per tenant (shared/queued.py)."""
    return queued.parse_figures(s.redis().hgetall(s.keys.queued_tenants(MODEL))).counts


def submitted(s: Stack) -> int:
    """Jobs ever added to the tokenize stream."""
    return int(s.redis().xinfo_stream(s.keys.tokenize(MODEL))["entries-added"])


async def flood_then_b(s: Stack, during=None) -> tuple[list[tuple[float, float, int]], tuple[float, float, int]]:
    """A's flood, then (all of it submitted, most of it past the tokenizers' holds) one request of B, and `during`
    while they run; every result."""
    before = submitted(s)
    flood = [asyncio.create_task(one(s, A_KEY, A_TOKENS)) for _ in range(A_FLOOD)]
    await asyncio.to_thread(wait_for, lambda: submitted(s) >= before + A_FLOOD, 30, 0.05)
    b = asyncio.create_task(one(s, B_KEY, 2))
    if during is not None:
        await asyncio.to_thread(during)
    return await asyncio.gather(*flood), await b


def test_a_late_tenant_is_served_in_turn_not_behind_the_flood(fair):
    a, (b_first, _, b_tokens) = asyncio.run(flood_then_b(fair))
    assert b_tokens == 2 and all(tokens == A_TOKENS for _, _, tokens in a)
    after_b = sum(first > b_first for first, _, _ in a)
    # First come first served, B would start after all 30 (they were queued before it), and so it would if the
    # tokenizers stopped reading past their holds (4 each); in turn, after one of A's released jobs and the two
    # running.
    assert after_b >= A_FLOOD // 2, f"only {after_b} of A's {A_FLOOD} queued requests started after B's"
    # every job released and acknowledged, the parked streams ended, and each job out of the queue count
    wait_for(lambda: not sum(held(fair).values()) and not parked(fair) and not queue(fair), 10, 0.05)


def holder(s: Stack) -> str | None:
    """The tokenizer process holding the most of the backlog now (a consumer is named `<worker id>@...`)."""
    holders = {name: n for name, n in held(s).items() if n}
    return max(holders, key=holders.__getitem__).partition("@")[0] if holders else None


def test_held_jobs_survive_a_frozen_and_a_killed_tokenizer(fair):
    """SIGSTOP the tokenizer holding the backlog past the claim idle time (its peer takes what it held; thawed,
    it drops those), then SIGKILL whichever holds it then: every request, A's and B's, ends with all its tokens,
    each exactly once."""
    killed: list[str] = []
    at_kill: list[int] = []

    def freeze_then_kill() -> None:
        wait_for(lambda: parked_waiting(fair) and holder(fair), 10, 0.02)  # the flood past the holds: parked
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
            at_kill.append(parked_waiting(fair))
            fair.kill(victim)
            killed.append(victim)

    try:
        a, (_, _, b_tokens) = asyncio.run(flood_then_b(fair, freeze_then_kill))
        assert b_tokens == 2 and killed, "the backlog was gone before a holder could be killed"
        assert at_kill[0] > 0, "nothing was parked when the holder was killed"
        assert [tokens for _, _, tokens in a] == [A_TOKENS] * A_FLOOD  # usage counts each token once
        wait_for(lambda: not sum(held(fair).values()) and not queue(fair), 20, 0.1)
    finally:
        for name in killed:
            fair.start(name, "tokenizer", **ENV)


async def completion(s: Stack, key: str, max_tokens: int) -> int | str:
    """A completion, not streamed: its completion tokens, or "429" if refused."""
    client = openai.AsyncOpenAI(base_url=f"{s.base_url}/v1", api_key=key, max_retries=0, timeout=120)
    try:
        reply = await client.completions.create(model=MODEL, prompt="hello", max_tokens=max_tokens,
                                                extra_body={"ignore_eos": True})
        return reply.usage.completion_tokens if reply.usage else 0
    except openai.RateLimitError:
        return "429"
    finally:
        await client.close()


def test_a_flooder_gets_its_share_of_the_queue_and_the_other_tenant_is_admitted(fair):
    """B's two long requests take both engine slots, then A sends 40 at once against --max-queued 30: exactly 30
    are queued (no stale figure lets more in), the rest refused; B, arriving at the full queue, is admitted (its
    share); A's requests whose clients leave, and every other, leave the count: it ends at 0."""
    async def scenario() -> None:
        running = [asyncio.Event(), asyncio.Event()]
        b_long = [asyncio.create_task(one(fair, B_KEY, 250, started)) for started in running]
        async with asyncio.timeout(30):  # both running: nothing of A's starts meanwhile
            await asyncio.gather(*(started.wait() for started in running))
        a = [asyncio.create_task(completion(fair, A_KEY, 2)) for _ in range(40)]

        def refused() -> int:
            return sum(t.done() and t.result() == "429" for t in a)

        await asyncio.to_thread(wait_for, lambda: refused() + queue(fair).get("team-a", 0) == 40, 30, 0.05)
        assert (refused(), queue(fair)) == (40 - MAX_QUEUED, {"team-a": MAX_QUEUED})
        b = asyncio.create_task(completion(fair, B_KEY, 2))
        await asyncio.to_thread(wait_for, lambda: queue(fair).get("team-b") == 1 or b.done(), 30, 0.05)
        gone = [t for t in a if not t.done()][:5]
        for t in gone:  # their clients leave while they wait
            t.cancel()
        await asyncio.gather(*a, return_exceptions=True)
        assert await b == 2 and [t.result() for t in a if t not in gone].count(2) == MAX_QUEUED - len(gone)
        assert [tokens for _, _, tokens in await asyncio.gather(*b_long)] == [250, 250]

    asyncio.run(scenario())
    wait_for(lambda: not queue(fair), 20, 0.05)  # finished, aborted (client gone): every job left the count
