"""Reasoning and tool-call parsers on real Qwen3, Hermes and Llama 3 answers, fed in every possible
split: the pieces a stream delivers must add up to what the whole text parses to."""

from __future__ import annotations

import itertools
import json

import pytest

from services.api.answer.parsers import AnswerParser, Parsed

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
HERMES_CUT = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"c"  # max_tokens cut it

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
    (HERMES_CUT, True, "hermes", ("", "Let me check.\n", [])),  # an unfinished call is not content
    (HERMES_CALL + "\n<tool_call>\n{\"na", False, "hermes", ("", "I'll look that up.\n",
                                                         [("get_stock_fundamentals", {"symbol": "TSLA"})])),
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


MARKER_SPAN = 16  # longer than any marker the parsers look for (`<|python_tag|>`: 14 characters)


def splits(n: int):
    """Every split into two pieces, every split into three (of a longer text than 200 characters, those whose two
    cuts fall within one marker's span: a cut far from the other one is what the splits in two check), and one
    character at a time."""
    yield from ((k,) for k in range(1, n))
    yield from (c for c in itertools.combinations(range(1, n), 2) if n <= 200 or c[1] - c[0] <= MARKER_SPAN)
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
    """As a stream's format feeds a choice: its last piece with `final` (services/api/answer/formats.py ChatFormat)."""
    parser, out = AnswerParser(reasoning, tools), Parsed()
    pieces = list(itertools.pairwise((0, *cuts, len(text))))
    for k, (a, b) in enumerate(pieces):
        out += parser.feed(text[a:b], final=k == len(pieces) - 1)
    return out


@pytest.mark.parametrize(("text", "reasoning", "tools", "expected"), CASES, ids=range(len(CASES)))
def test_a_final_piece_releases_what_finish_would(text, reasoning, tools, expected):
    for cuts in splits(len(text)):
        assert summary(streamed_final(text, cuts, reasoning, tools)) == expected, cuts


# A template that opens `<think>` in the prompt (Qwen3-Thinking, DeepSeek-R1): the answer starts inside the thinking.
OPENED = [
    ("The user says hi.\n</think>\n\nHello!", "hermes", ("The user says hi.\n", "Hello!", [])),
    ("Weather first.\n</think>\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>", "hermes",
     ("Weather first.\n", "", [("f", {})])),
    ("still thinking when max_tokens ended it", None, ("still thinking when max_tokens ended it", "", [])),
]


@pytest.mark.parametrize(("text", "tools", "expected"), OPENED, ids=range(len(OPENED)))
def test_a_prompt_that_opened_the_thinking_makes_its_text_reasoning_until_it_closes(text, tools, expected):
    """The text before `</think>` is reasoning, never content (no literal `</think>` in content), whether the
    parser is made knowing it or told before the first piece (as a stream's format learns it, with the first
    reply event)."""
    assert summary(AnswerParser(True, tools, opened=True).parse_all(text)) == expected
    for cuts in splits(len(text)):
        parser, out = AnswerParser(True, tools), Parsed()
        parser.open_thinking()
        pieces = list(itertools.pairwise((0, *cuts, len(text))))
        for k, (a, b) in enumerate(pieces):
            out += parser.feed(text[a:b], final=k == len(pieces) - 1)
        assert summary(out) == expected, cuts
    assert summary(AnswerParser(False, tools, opened=True).parse_all("a</think>b"))[1] == "a</think>b"  # no reasoning
