"""services/api/responses_api/response_items.py and the request fields of response_schemas.py: every input item
type agents send (the official SDK's ResponseInputItemParam that the server can honour) as chat messages, the
reasoning round trip through `encrypted_content`, and the request fields the official SDK and the Agents SDK send,
honoured or refused naming the field. No Redis: the translation is pure."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from pydantic import ValidationError

from services.api.answer.limits import Limits
from services.api.errors import ApiError, BadRequest, as_api_error
from services.api.responses_api.response_format import ResponseFormat
from services.api.responses_api.response_items import as_input, chat_messages
from services.api.responses_api.response_schemas import ResponseRequest
from services.api.responses_api.sealing import Sealer, key_from_setting
from shared.messages import ChatMessage, ReplyEvent
from shared.settings import ApiSettings
from tests.support.openai_types import strict_event, strict_response

SEALER = Sealer(b"k" * 32)
PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files",
         "format": {"type": "grammar", "syntax": "regex", "definition": "[a-z ]+"}}
LARK = {"type": "custom", "name": "shell", "format": {"type": "grammar", "syntax": "lark", "definition": "start: /x/"}}
FN = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": True}


@dataclass
class Counts:
    prompt_tokens: int = 7
    completion_tokens: int = 2
    cached_tokens: int = 0


def request(**body) -> ResponseRequest:
    return ResponseRequest.model_validate({"model": "m", "input": "hi", **body})


def opener(value: str, param: str) -> str:
    return SEALER.open(value, "m", "t1", param)


def items(*raw: dict) -> list[dict]:
    return request(input=list(raw)).input_items(opener)


def test_every_item_type_an_agent_sends_becomes_chat_messages():
    sealed = SEALER.seal("I should call the tool.", "m", "t1")
    conversation = items(
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix it"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "x"}],
         "encrypted_content": sealed},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Looking.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "get_weather", "arguments": "{}",
         "status": "completed"},
        {"type": "custom_tool_call", "id": "ctc_1", "call_id": "c2", "name": "apply_patch", "input": "add line"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "sunny"}]},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "done"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Now answer."}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]})
    assert chat_messages(conversation) == [
        ChatMessage(role="system", content="Be terse."),
        ChatMessage(role="user", content="Fix it"),
        ChatMessage(role="assistant", content="Looking.", reasoning_content="I should call the tool.", tool_calls=[
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
            {"id": "c2", "type": "function",
             "function": {"name": "apply_patch", "arguments": '{"input": "add line"}'}}]),
        ChatMessage(role="tool", content="sunny", tool_call_id="c1"),
        ChatMessage(role="tool", content="done", tool_call_id="c2"),
        ChatMessage(role="assistant", content="No.", reasoning_content="Now answer.")]


@pytest.mark.parametrize(("item", "param"), [
    ({"type": "web_search_call", "id": "ws", "status": "completed"}, "input"),
    ({"type": "item_reference", "id": "msg_1"}, "input"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}, "input"),
    ({"type": "function_call", "call_id": "c", "name": "f"}, "input"),
    ({"type": "custom_tool_call_output", "call_id": "c", "output": {"x": 1}}, "input"),
    ({"type": "reasoning", "summary": [], "encrypted_content": "bm90IHNlYWxlZA=="}, "input[0].encrypted_content"),
    ({"type": "reasoning", "summary": [], "encrypted_content": SEALER.seal("t", "other-model", "t1")},
     "input[0].encrypted_content"),
    ({"type": "reasoning", "summary": [], "encrypted_content": SEALER.seal("t", "m", "another-tenant")},
     "input[0].encrypted_content"),
    ({"type": "reasoning", "summary": [], "encrypted_content": Sealer(b"o" * 32).seal("t", "m", "t1")},
     "input[0].encrypted_content"),
])
def test_items_that_cannot_be_honoured_are_refused_naming_them(item, param):
    with pytest.raises(BadRequest) as e:
        items(item)
    assert e.value.param == param


def test_a_tampered_encrypted_content_is_refused():
    sealed = bytearray(SEALER.seal("secret plan", "m", "t1").encode())
    sealed[20] = ord("A") if sealed[20] != ord("A") else ord("B")
    with pytest.raises(BadRequest) as e:
        items({"type": "reasoning", "summary": [], "encrypted_content": sealed.decode()})
    assert e.value.param == "input[0].encrypted_content" and "secret" not in str(e.value)


def test_the_key_setting():
    assert len(key_from_setting(None)) == 32  # made for this process
    assert key_from_setting("a2V5a2V5a2V5a2V5a2V5a2V5a2V5a2V5a2V5a2V5a2U=") == b"key" * 10 + b"ke"
    with pytest.raises(ValueError, match="32 bytes"):
        key_from_setting("c2hvcnQ=")


def run(f: ResponseFormat, texts: list[str]) -> list[dict]:
    evs = [ReplyEvent(start=k, end=k + 1, text=t, prompt_tokens=7, finish_reason="stop" if k == len(texts) - 1
                      else None) for k, t in enumerate(texts)]
    return f.chunks(evs, Counts()) + f.closing_chunks(Counts())


def test_reasoning_and_a_custom_tool_call_round_trip():
    """The output, valid for the SDK's types, is the next turn's input: the sealed reasoning opens to what the
    model thought, the custom call is the template's function call of `input`."""
    req = request(tools=[PATCH], include=["reasoning.encrypted_content"], store=False)
    assert req.encrypts()
    f = ResponseFormat(req.shown(None), {"tools": "hermes", "reasoning": "qwen3", "seal": "t1"})
    f.sealer = SEALER
    f.start("u1", 1700000000)
    out = run(f, ["<think>patch it</think>", '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "a b"}}\n'
                                             "</tool_call>"])
    for ev in out:
        strict_event(ev)
    final = strict_response(out[-1]["response"])
    reasoning, call = final.output
    assert call.type == "custom_tool_call" and call.input == "a b" and call.name == "apply_patch"
    assert "patch it" not in reasoning.encrypted_content
    kinds = [e["type"] for e in out]
    assert "response.custom_tool_call_input.done" in kinds
    turn = items(*[o.model_dump(exclude_none=True) for o in final.output],
                 {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "ok"})
    assert chat_messages(turn)[0] == ChatMessage(role="assistant", content="", reasoning_content="patch it",
                                                 tool_calls=[{"id": call.call_id, "type": "function", "function": {
                                                     "name": "apply_patch", "arguments": '{"input": "a b"}'}}])
    assert as_input(out[-1]["response"]["output"])[1] == {"type": "custom_tool_call", "call_id": call.call_id,
                                                          "name": "apply_patch", "input": "a b"}


def test_a_custom_tool_is_a_function_of_one_string_constrained_by_its_regex():
    req = request(tools=[PATCH, {"type": "custom", "name": "note"}], tool_choice={"type": "custom", "name": "note"})
    patch, note = req.tool_dicts()
    assert patch["function"]["parameters"]["properties"]["input"] == {"type": "string", "pattern": "^(?:[a-z ]+)$"}
    assert note["function"]["parameters"]["properties"]["input"] == {"type": "string"}
    assert req.tool_choice_struct().mode == "function" and req.tool_choice_struct().name == "note"


def test_what_the_agents_sdk_and_codex_send_is_accepted_and_echoed():
    req = request(include=[], tools=[FN, PATCH, LARK], tool_choice="auto", parallel_tool_calls=True,
                  prompt_cache_key="conv-1", prompt_cache_retention="in_memory", safety_identifier="user-1",
                  max_tool_calls=3, top_logprobs=0, truncation="disabled", conversation=None, prompt=None,
                  context_management=None, stream_options={"include_obfuscation": False}, store=False,
                  reasoning={"effort": "medium", "summary": "auto"})
    req.checked(Limits(ApiSettings()), 1)
    shown = strict_response({"id": "resp_x", "object": "response", "created_at": 1, "status": "completed",
                             "output": [], **req.shown(None)})
    assert shown.prompt_cache_key == "conv-1" and shown.safety_identifier == "user-1" and shown.max_tool_calls == 3
    assert [t.type for t in shown.tools] == ["function", "custom", "custom"]
    assert req.annotations() == {"safety_identifier": "user-1", "prompt_cache_key": "conv-1"}


def test_allowed_tools_offers_only_those_tools():
    req = request(tools=[FN, PATCH], tool_choice={"type": "allowed_tools", "mode": "required",
                                                  "tools": [{"type": "custom", "name": "apply_patch"}]})
    assert [t["function"]["name"] for t in req.tool_dicts()] == ["apply_patch"]
    assert req.tool_choice_struct().mode == "required"


@pytest.mark.parametrize(("body", "param"), [
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"include": ["nonsense"]}, "include"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"context_management": [{"type": "compaction"}]}, "context_management"),
    ({"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"),
    ({"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [FN, {**FN}]}, "tools"),
    ({"tools": [FN], "tool_choice": {"type": "custom", "name": "get_weather"}}, "tool_choice"),
    ({"tools": [FN], "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                     "tools": [{"type": "function", "name": "nope"}]}}, "tool_choice"),
    ({"tools": [FN], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tools": [LARK], "tool_choice": "required"}, "tools"),
    ({"tools": [LARK], "tool_choice": {"type": "custom", "name": "shell"}}, "tools"),
])
def test_values_that_cannot_be_honoured_are_refused_naming_the_field(body, param):
    with pytest.raises((BadRequest, ValidationError)) as e:
        request(**body)
    err = as_api_error(e.value)
    assert err is not None and err.status == 400 and err.param == param, err


@pytest.mark.parametrize("field", ["prompt_cache_key", "safety_identifier"])
def test_client_strings_kept_with_the_request_are_bounded(field):
    with pytest.raises(ApiError) as e:
        request(**{field: "x" * 257}).checked(Limits(ApiSettings()), 1)
    assert e.value.param == field


def test_prompt_cache_key_scopes_the_prefix_cache_with_the_cache_salt():
    """OpenAI's `prompt_cache_key` is an isolation and routing key here (issue 35): requests naming different keys
    are salted apart, the same key alike, and it joins a `cache_salt` rather than replacing it."""
    from services.api.responses_api.response_schemas import ResponseRequest
    from services.api.responses_api.responses import ResponseBody

    def salt(**fields) -> str | None:
        request = ResponseRequest.model_validate({"model": "m", "input": "hi", **fields})
        return ResponseBody(request, None, None, [], None).cache_salt  # type: ignore[arg-type]

    assert salt() is None and salt(cache_salt="s") == "s"
    assert salt(prompt_cache_key="a") == salt(prompt_cache_key="a") != salt(prompt_cache_key="b")
    assert salt(cache_salt="s", prompt_cache_key="a") not in (salt(prompt_cache_key="a"), "s")
