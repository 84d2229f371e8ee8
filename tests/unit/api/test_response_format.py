"""services/api/responses_api/response_format.py: reply events -> the Responses API's events and objects, checked
against the official SDK's own types; numbering is a pure function of the reply events, whatever the reads' batching."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from openai.types.responses import Response
from pydantic import ValidationError

from services.api.responses_api.response_format import ResponseFormat
from services.api.responses_api.response_schemas import ResponseRequest
from shared.messages import ReplyEvent
from tests.support.openai_types import strict_event, strict_response


@dataclass
class Counts:
    prompt_tokens: int = 7
    completion_tokens: int = 0
    cached_tokens: int = 0


def fmt(parse: dict | None = None, **body) -> ResponseFormat:
    req = ResponseRequest.model_validate({"model": "m", "input": "hi", **body})
    f = ResponseFormat(req.shown(None), parse)
    f.start("u1", 1700000000)
    return f


def events(texts: list[str], finish: str = "stop") -> list[ReplyEvent]:
    last = len(texts) - 1
    return [ReplyEvent(start=k, end=k + 1, text=text, prompt_tokens=7, finish_reason=finish if k == last else None)
            for k, text in enumerate(texts)]


def run(f: ResponseFormat, evs: list[ReplyEvent], batches: list[int]) -> list[dict]:
    """The stream's events for `evs` read in batches of the given sizes."""
    out, at = [], 0
    for size in batches:
        out += f.chunks(evs[at:at + size], Counts())
        at += size
    return out + f.closing_chunks(Counts(completion_tokens=len(evs)))


def test_text_stream_events_parse_with_the_sdk_types():
    out = run(fmt(), events(["Hel", "lo", " there"]), [1, 2])
    for ev in out:
        strict_event(ev)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    final = strict_response(out[-1]["response"])
    assert final.output_text == "Hello there" and final.status == "completed"
    assert final.usage.output_tokens == 3 and final.usage.input_tokens == 7


@pytest.mark.parametrize("batches", [[5], [1, 1, 1, 1, 1], [2, 3], [4, 1]])
def test_numbering_does_not_depend_on_batching(batches):
    evs = events(["a", "b", "c", "d", "e"])
    assert run(fmt(), evs, batches) == run(fmt(), evs, [1] * 5)


def test_resume_skips_what_was_sent():
    evs = events(["a", "b", "c", "d"])
    whole = run(fmt(), evs, [4])
    f = fmt()
    f.skip_through = 5
    assert run(f, evs, [2, 2]) == whole[6:]


def test_length_ends_incomplete_and_abort_cancelled():
    out = run(fmt(), events(["a", "b"], "length"), [2])
    assert out[-1]["type"] == "response.incomplete"
    assert out[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    strict_event(out[-1])
    f = fmt()
    f.add(events(["a"], "abort"))
    assert strict_response(f.response(Counts())).status == "cancelled"


def test_tool_calls_are_function_call_items_with_stable_ids():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    out = run(fmt({"tools": "hermes"}, tools=tools), events([call[:20], call[20:]]), [1, 1])
    for ev in out:
        strict_event(ev)
    final = strict_response(out[-1]["response"])
    [item] = final.output
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id == "call_u1_0"
    assert item.arguments == '{"city": "Paris"}'
    assert "response.function_call_arguments.done" in [e["type"] for e in out]


def test_failure_is_a_failed_response():
    f = fmt()
    f.chunks(events(["a"], None)[:1], Counts())  # type: ignore[arg-type]
    [ev] = f.failure_chunks({"error": {"message": "boom", "code": "engine_error", "type": "server_error"}})
    strict_event(ev)
    assert ev["type"] == "response.failed"
    assert ev["response"]["error"] == {"code": "server_error", "message": "engine_error: boom"}


def test_reasoning_is_its_own_output_item_before_the_message():
    out = run(fmt({"reasoning": "deepseek_r1"}, reasoning={"effort": "low"}),
              events(["<think>let me ", "see</think>", "It is 4."]), [1, 1, 1])
    for ev in out:
        strict_event(ev)
    final = strict_response(out[-1]["response"])
    reasoning, message = final.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "let me see"
    assert message.type == "message" and final.output_text == "It is 4."
    kinds = [e["type"] for e in out]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")


def test_a_prompt_that_opened_the_thinking_makes_the_first_text_reasoning():
    """The first reply event says the prompt opened `<think>` (services/detokenizer): no literal `</think>` in the
    message, whose text is what follows it."""
    evs = events(["let me ", "see</think>\n\n", "It is 4."])
    evs[0] = ReplyEvent(start=0, end=1, text="let me ", prompt_tokens=7, thinking=True)
    final = strict_response(run(fmt({"reasoning": "qwen3"}), evs, [1, 2])[-1]["response"])
    reasoning, _ = final.output
    assert reasoning.content[0].text == "let me see" and final.output_text == "It is 4."


def test_a_tool_call_cut_by_max_output_tokens_is_not_text():
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    out = run(fmt({"tools": "hermes"}, tools=tools), events(["Let me check.\n<tool_", 'call>\n{"name": "get_w'],
                                                           "length"), [1, 1])
    final = strict_response(out[-1]["response"])
    assert final.status == "incomplete" and final.output_text == "Let me check.\n"
    assert "<tool_call>" not in str(out)


@pytest.mark.parametrize(("body", "param"), [
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "has space", "schema": {}}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x" * 65, "schema": {}}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
])
def test_what_the_response_echoes_is_validated_first(body, param):
    """Fields the Response object echoes hold what OpenAI's schema allows (else the SDK cannot read it back)."""
    with pytest.raises(ValidationError) as e:
        ResponseRequest.model_validate({"model": "m", "input": "hi", **body})
    assert e.value.errors()[0]["ctx"]["error"].param == param
    with pytest.raises(ValidationError):
        ResponseRequest.model_validate({"model": "m", "input": "hi", "reasoning": {"summary": "verbose"}})
    for effort in ("none", "minimal", "low", "medium", "high", "xhigh", "max"):
        shown = fmt(reasoning={"effort": effort, "summary": "auto"}).shown
        Response.model_validate({**fmt().obj("completed"), "reasoning": shown["reasoning"]})
