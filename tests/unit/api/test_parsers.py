"""Reasoning and tool-call parsers on real Qwen3, Hermes and Llama 3 answers, fed in every possible
split: the pieces a stream delivers must add up to what the whole text parses to."""

from __future__ import annotations

import itertools
import json

import pytest

from services.api.parsers import AnswerParser, Parsed

QWEN3_THINK_AND_CALLS = (
    "<think>\nOkay, the user wants the weather in Paris and the local time. I should call get_weather with "
    "city \"Paris\" and then get_time.\n</think>\n\n"
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n"
    "</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"Europe/Paris\"}}\n</tool_call>")
QWEN3_THINK_ANSWER = "<think>\n2 + 2 is 4; x < y holds.\n</think>\n\nThe answer is 4 (since <think> tags aside, 2+2=4)."
QWEN3_NO_THINK = "Sure! Here is a list:\n- a < b\n- <tool> is not a call"
HERMES_CALL = ("I'll look that up.\n<tool_call>\n{\"arguments\": {\"symbol\": \"TSLA\"}, "
               "\"name\": \"get_stock_fundamentals\"}\n</tool_call>")
HERMES_BROKEN = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}\n</tool_call> then text"
LLAMA3 = "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; " \
         "{\"name\": \"get_time\", \"parameters\": {}}"
LLAMA3_TEXT = "I can answer that without tools: {it is sunny}."

CASES = [
    (QWEN3_THINK_AND_CALLS, True, "hermes", (
        "\nOkay, the user wants the weather in Paris and the local time. I should call get_weather with city "
        "\"Paris\" and then get_time.\n", "", [("get_weather", {"city": "Paris", "unit": "celsius"}),
                                               ("get_time", {"tz": "Europe/Paris"})])),
    (QWEN3_THINK_ANSWER, True, None, ("\n2 + 2 is 4; x < y holds.\n",
                                      "The answer is 4 (since <think> tags aside, 2+2=4).", [])),
    (QWEN3_NO_THINK, True, "hermes", ("", QWEN3_NO_THINK, [])),
    (HERMES_CALL, False, "hermes", ("", "I'll look that up.\n", [("get_stock_fundamentals", {"symbol": "TSLA"})])),
    (HERMES_BROKEN, False, "hermes", ("", HERMES_BROKEN, [])),
    (LLAMA3, False, "llama3_json", ("", "", [("get_weather", {"city": "Paris"}), ("get_time", {})])),
    (LLAMA3_TEXT, False, "llama3_json", ("", LLAMA3_TEXT, [])),
    ("<think>cut off by max_tok", True, None, ("cut off by max_tok", "", [])),
]


def summary(p: Parsed) -> tuple[str, str, list]:
    return p.reasoning, p.content, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                    for c in p.tool_calls]


def streamed(text: str, cuts: tuple[int, ...], reasoning: bool, tools: str | None) -> Parsed:
    parser, out = AnswerParser(reasoning, tools), Parsed()
    for a, b in itertools.pairwise((0, *cuts, len(text))):
        out += parser.feed(text[a:b])
    out += parser.finish()
    return out


def splits(n: int):
    """Every split into two pieces, every split into three (text of up to 200 characters), and one
    character at a time."""
    yield from ((k,) for k in range(1, n))
    yield from itertools.combinations(range(1, n), 2)
    yield tuple(range(1, n))


@pytest.mark.parametrize(("text", "reasoning", "tools", "expected"), CASES, ids=range(len(CASES)))
def test_every_split_parses_like_the_whole(text, reasoning, tools, expected):
    assert summary(AnswerParser(reasoning, tools).parse_all(text)) == expected
    for cuts in splits(len(text)):
        assert summary(streamed(text, cuts, reasoning, tools)) == expected, cuts


def test_held_back_text_is_released_as_soon_as_it_cannot_be_a_marker():
    parser = AnswerParser(True, "hermes")
    assert parser.feed("<thi").content == ""  # may still open the reasoning
    assert parser.feed("s is not it <tool").content == "<this is not it "  # may still open a call
    assert parser.feed("box>").content == "<toolbox>"
    calls = parser.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>').tool_calls
    assert [c["function"] for c in calls] == [{"name": "f", "arguments": "{}"}] and calls[0]["id"]


def streamed_final(text: str, cuts: tuple[int, ...], reasoning: bool, tools: str | None) -> Parsed:
    """As a stream's format feeds a choice: its last piece with `final` (services/api/formats.py ChatFormat)."""
    parser, out = AnswerParser(reasoning, tools), Parsed()
    pieces = list(itertools.pairwise((0, *cuts, len(text))))
    for k, (a, b) in enumerate(pieces):
        out += parser.feed(text[a:b], final=k == len(pieces) - 1)
    return out


@pytest.mark.parametrize(("text", "reasoning", "tools", "expected"), CASES, ids=range(len(CASES)))
def test_a_final_piece_releases_what_finish_would(text, reasoning, tools, expected):
    for cuts in splits(len(text)):
        assert summary(streamed_final(text, cuts, reasoning, tools)) == expected, cuts
