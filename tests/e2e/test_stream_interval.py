"""--stream-interval N: the scheduler merges N steps' tokens into one delta per choice; --stream-flush-ms T merges
a choice's tokens for up to T ms. Clients get the same text, logprobs and finish reasons as with a delta per step
(stop strings that fall inside a merged range included), in fewer chunks; a choice's first token is not held
back."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.support.helpers import sse_payloads
from tests.support.stack import MODEL, Stack, running_pipeline

pytestmark = pytest.mark.timeout(120)
INTERVAL = 4
FLUSH_MS = 300  # many CPU steps of the demo model: with it, a choice's tokens go in a few deltas
# (unpaced: --stream-entry-rate would publish every step for so few streams; tests/unit/scheduler/test_flush_by_time.py)


@pytest.fixture(scope="module")
def merged(redis_server, demo_model_dir, tmp_path_factory) -> Iterator[Stack]:
    with running_pipeline(redis_server, demo_model_dir, tmp_path_factory, "merge",
                          RSINFER_STREAM_INTERVAL=str(INTERVAL), RSINFER_STREAM_FLUSH_MS="0") as s:
        yield s


@pytest.fixture(scope="module")
def timed(redis_server, demo_model_dir, tmp_path_factory) -> Iterator[Stack]:
    with running_pipeline(redis_server, demo_model_dir, tmp_path_factory, "flush",
                          RSINFER_STREAM_FLUSH_MS=str(FLUSH_MS), RSINFER_STREAM_ENTRY_RATE="0") as s:
        yield s


def streamed(stack: Stack, **body) -> tuple[dict[int, dict], list[int]]:
    """Per choice: text, token logprobs and finish reason joined over the chunks; and the tokens per chunk."""
    out: dict[int, dict] = {}
    sizes: list[int] = []
    ignore_eos = body.pop("ignore_eos", False)
    for chunk in stack.client().completions.create(model=MODEL, stream=True, extra_body={"ignore_eos": ignore_eos},
                                                   **body):
        for c in chunk.choices:
            acc = out.setdefault(c.index, {"text": "", "logprobs": [], "finish": None})
            acc["text"] += c.text
            if c.logprobs:
                acc["logprobs"] += c.logprobs.token_logprobs
                sizes.append(len(c.logprobs.token_logprobs))
            acc["finish"] = c.finish_reason or acc["finish"]
    return out, sizes


SAMPLINGS = [dict(temperature=0, max_tokens=41), dict(temperature=0.8, seed=11, n=2, max_tokens=30)]


def assert_same_choices(got: dict, want: dict) -> None:
    """The same choices, text, logprobs and finish, however the tokens were grouped into chunks."""
    assert got.keys() == want.keys()
    for i in want:
        assert got[i]["text"] == want[i]["text"] and got[i]["finish"] == want[i]["finish"] == "length"
        assert got[i]["logprobs"] == pytest.approx(want[i]["logprobs"], abs=1e-4)

@pytest.mark.parametrize("params", SAMPLINGS, ids=["greedy", "seeded-n2"])
def test_merged_steps_give_the_same_choices_in_fewer_chunks(stack, merged, params):
    body = dict(prompt="The capital of France is", logprobs=1, ignore_eos=True, **params)
    want, per_step = streamed(stack, **body)
    got, per_chunk = streamed(merged, **body)
    assert_same_choices(got, want)
    # Each choice's first token goes alone, then ranges of INTERVAL steps (the API may join ranges that are ready
    # together into one chunk, never split one): at most this many chunks, whatever the machine's load.
    n, tokens = params.get("n", 1), params["max_tokens"]
    assert per_chunk[0] == 1  # the first token is not held back
    assert sum(per_chunk) == n * tokens == sum(per_step)
    assert max(per_chunk) >= INTERVAL and len(per_chunk) <= n * (2 + (tokens - 1) // INTERVAL) < n * tokens / 2


@pytest.mark.parametrize("params", SAMPLINGS, ids=["greedy", "seeded-n2"])
def test_tokens_merged_by_time_give_the_same_choices_in_fewer_chunks_the_first_at_once(stack, timed, params):
    body = dict(prompt="The capital of France is", logprobs=1, ignore_eos=True, **params)
    want, per_step = streamed(stack, **body)
    got, per_chunk = streamed(timed, **body)
    assert_same_choices(got, want)
    n, tokens = params.get("n", 1), params["max_tokens"]
    assert per_chunk[0] == 1  # the first token went alone: not held for the flush interval with the next steps'
    assert sum(per_chunk) == n * tokens == sum(per_step)
    assert len(per_chunk) < n * tokens / 4 and len(per_chunk) < len(per_step)


@pytest.mark.parametrize("coalesced", ["merged", "timed"])
def test_a_stop_string_inside_a_merged_range_ends_the_text_where_it_would(stack, coalesced, request):
    merged = request.getfixturevalue(coalesced)
    body = dict(prompt="Once upon a time", temperature=0, max_tokens=40, ignore_eos=True)
    full, _ = streamed(stack, **body)
    text = full[0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]  # lands inside some merged range
    want, _ = streamed(stack, stop=[stop], **body)
    got, _ = streamed(merged, stop=[stop], **body)
    assert got[0]["text"] == want[0]["text"] == text[:text.index(stop)]
    assert got[0]["finish"] == want[0]["finish"] == "stop"


@pytest.mark.parametrize("coalesced", ["merged", "timed"])
def test_stop_strings_spanning_merged_ranges_cut_each_choice_where_they_would(stack, coalesced, request):
    """Stop strings travel on a choice's first delta only (the detokenizer keeps them): with merged steps, n = 2
    and a stop string of about a dozen tokens that spans several merged ranges, each choice ends where it would
    with a delta per step."""
    merged = request.getfixturevalue(coalesced)
    body = dict(prompt="Once upon a time", temperature=0.8, seed=3, n=2, max_tokens=60, ignore_eos=True)
    full, _ = streamed(stack, **body)
    long_stop = full[0]["text"][15:55]
    stops = [long_stop, full[1]["text"][30:36]]
    want, _ = streamed(stack, stop=stops, **body)
    got, _ = streamed(merged, stop=stops, **body)
    assert got == want
    for i in (0, 1):
        text = full[i]["text"]
        assert want[i]["text"] == text[:min(text.find(x) for x in stops if x in text)]
        assert want[i]["finish"] == "stop"


GET_TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"]}}}


def streamed_call(stack: Stack) -> tuple[list[tuple[str, str]], str]:
    """A streamed, seeded call of a named tool (as tests/e2e/test_tools.py's): (name, arguments) per call joined
    over the chunks, and the finish reason."""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stack.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What time is it?"}], tools=[GET_TIME], max_tokens=200,
            seed=4, stream=True, tool_choice={"type": "function", "function": {"name": "get_time"}}):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                acc = calls.setdefault(tc.index, ["", ""])
                acc[0] += tc.function.name or ""
                acc[1] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish


def test_a_tool_call_streamed_in_merged_ranges_is_the_same_call(stack, timed):
    want, want_finish = streamed_call(stack)
    got, finish = streamed_call(timed)
    assert got == want and finish == want_finish == "tool_calls"
    assert json.loads(got[0][1])["tz"] in ("UTC", "CET")


def test_a_reattach_after_a_merged_entry_gets_exactly_the_rest(timed):
    """Last-Event-ID names a reply entry; with --stream-flush-ms one entry carries several tokens, and a reattach
    after any of them gets exactly the text after it (a background request runs on with nobody attached)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "resume merged"}], "max_tokens": 80,
            "temperature": 0, "ignore_eos": True, "background": True, "stream": True}
    events: list[tuple[str, str]] = []  # (event id, text)
    uid = ""
    with httpx.stream("POST", f"{timed.base_url}/v1/chat/completions", json=body, timeout=60) as resp:
        last = ""
        for line in resp.iter_lines():
            if line.startswith("id: "):
                last = line[4:]
            elif line.startswith("data: {"):
                chunk = json.loads(line[6:])
                uid = chunk["id"].removeprefix("chatcmpl-")
                text = "".join(c["delta"].get("content") or "" for c in chunk["choices"])
                if text:
                    events.append((last, text))
    assert len(events) < 40, "tokens were not merged"  # 80 tokens
    for at in (0, len(events) // 2):
        with httpx.stream("GET", f"{timed.base_url}/v1/requests/{uid}/stream",
                          headers={"Last-Event-ID": events[at][0]}, timeout=60) as resp:
            assert resp.status_code == 200
            data = sse_payloads("".join(resp.iter_text()))
        rest = "".join(c["delta"].get("content") or "" for d in data[:-1] for c in json.loads(d)["choices"])
        assert rest == "".join(text for _, text in events[at + 1:])
