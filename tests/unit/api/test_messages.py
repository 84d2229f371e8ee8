"""Anthropic's Messages API, translated without Redis: bodies -> chat messages, tools and tool choice
(services/api/messages_api/message_schemas.py), reply events -> Anthropic's message and stream events
(services/api/messages_api/message_format.py), each event valid for the official SDK's types and accumulated by the
SDK into the same message the non-stream body is; errors in Anthropic's shape (services/api/errors.py)."""

from __future__ import annotations

import json

import orjson
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter, ValidationError

from services.api.errors import ApiError, anthropic_error, as_api_error
from services.api.messages_api.message_format import MessageFormat, message_format_of_record
from services.api.messages_api.message_schemas import CountTokensRequest, MessagesRequest
from shared.messages import ChatMessage, ReplyEvent, SamplingParams, ToolChoice

EVENTS = TypeAdapter(RawMessageStreamEvent)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": SCHEMA}]


def body(**fields) -> dict:
    return {"model": "m", "max_tokens": 2000, "messages": [{"role": "user", "content": "Paris?"}], **fields}


def refusal(data: dict, model=MessagesRequest) -> ApiError:
    with pytest.raises((ValidationError, ValueError)) as e:
        model.model_validate(data)
    error = as_api_error(e.value)
    assert error is not None and error.status == 400
    return error


class Limits:
    """What `checked` asks of the server's limits, none of them reached."""

    def __init__(self):
        self.seen: list = []

    def record_fields(self, user, safety_identifier=None, metadata=None):
        self.seen.append(("user", user))

    def sampling(self, params, prefix=""):
        self.seen.append(("sampling", params))

    def chat_fields(self, tools, kwargs):
        self.seen.append(("tools", tools))


def test_a_conversation_with_tools_becomes_the_chat_request_it_stands_for():
    req = MessagesRequest.model_validate(body(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": [{"type": "text", "text": "Paris?"}, {"type": "text", "text": "Now."}]},
                  {"role": "assistant", "content": [
                      {"type": "thinking", "thinking": "look it up", "signature": ""},
                      {"type": "text", "text": "Checking."},
                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                      {"type": "text", "text": "And so?"}]}],
        stop_sequences=["END"], temperature=0.5, top_k=5, metadata={"user_id": "u-1"}))
    call = {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert req.chat_messages() == [
        ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Paris?\nNow."),
        ChatMessage(role="assistant", content="Checking.", tool_calls=[call], reasoning_content="look it up"),
        ChatMessage(role="tool", content="sunny", tool_call_id="toolu_1"), ChatMessage(role="user", content="And so?")]
    assert req.tool_dicts() == [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                                  "parameters": SCHEMA}}]
    assert req.tool_choice_struct() == ToolChoice("function", "get_weather", parallel=False)
    limits = Limits()
    params = req.checked(limits)
    assert params == SamplingParams(max_tokens=2000, temperature=0.5, top_k=5, stop=["END"])
    assert ("user", "u-1") in limits.seen and ("tools", req.tool_dicts()) in limits.seen
    assert req.template_kwargs() == {"enable_thinking": False}


def test_the_fields_of_every_generating_endpoint_are_taken():
    """cache_salt and slo, as on chat (services/api/answer/admission.py reads them off the body)."""
    req = MessagesRequest.model_validate(body(cache_salt="team-x", slo={"ttft_ms": 500}))
    assert req.cache_salt == "team-x" and req.slo is not None and req.slo.ttft_ms == 500
    assert "cache_salt" in refusal(body(cache_salt="")).named_message()


@pytest.mark.parametrize(("choice", "expected"), [
    (None, ToolChoice("auto")), ({"type": "auto"}, ToolChoice("auto")), ({"type": "any"}, ToolChoice("required")),
    ({"type": "none"}, ToolChoice("none")), ({"type": "any", "disable_parallel_tool_use": True},
                                             ToolChoice("required", parallel=False))])
def test_tool_choice_any_is_a_required_call(choice, expected):
    req = MessagesRequest.model_validate(body(tools=TOOLS, **({"tool_choice": choice} if choice else {})))
    assert req.tool_choice_struct() == expected


def test_thinking_switches_the_template_and_is_parsed_only_where_the_model_reasons():
    req = MessagesRequest.model_validate(body(thinking={"type": "enabled", "budget_tokens": 1024}))
    assert req.template_kwargs() == {"enable_thinking": True}
    assert req.answer_parsing({"reasoning_parser": "qwen3"}) == {"reasoning": "qwen3"}
    with pytest.raises(ValueError, match="thinking"):
        req.answer_parsing({"reasoning_parser": "none"})
    assert CountTokensRequest.model_validate({"model": "m", "messages": body()["messages"],
                                              "thinking": {"type": "disabled"}}).template_kwargs() == {
        "enable_thinking": False}


@pytest.mark.parametrize(("fields", "named"), [
    ({"max_tokens": None}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"stop_sequences": ["a"] * 17}, "stop_sequences"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 4000}}, "thinking.budget_tokens"),  # not below max_tokens
    ({"thinking": {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}}, "thinking.display"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ({"tools": [{**TOOLS[0], "input_schema": {"type": "string"}}]}, "tools.input_schema"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "colour": 1}]}]},
     "messages.0.content.0.colour"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"messages": []}, "messages"),
    ({"system": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}]}, "system.0.type"),
    ({"mcp_servers": [{"url": "x"}]}, "mcp_servers"),
    ({"service_tier": "priority"}, "service_tier"),
    ({"n": 2}, "n"),
])
def test_what_cannot_be_honoured_is_refused_naming_the_field(fields, named):
    data = {k: v for k, v in body(**fields).items() if v is not None}
    error = refusal(data)
    assert named in error.named_message()
    payload = orjson.loads(error.response(anthropic=True).body)
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
    assert named in payload["error"]["message"]


def test_the_server_s_limits_name_the_fields_as_this_body_names_them():
    from services.api.answer.limits import Limits as ServerLimits
    from shared.settings import ApiSettings

    limits = ServerLimits(ApiSettings())
    for fields, named in (({"metadata": {"user_id": "u" * 100_000}}, "metadata.user_id"),
                          ({"stop_sequences": ["x" * 100_000]}, "stop_sequences")):
        with pytest.raises(ApiError) as e:
            MessagesRequest.model_validate(body(**fields)).checked(limits)
        assert e.value.param == named and named in e.value.named_message()


def test_errors_in_anthropic_s_shape_and_statuses():
    for status, kind, sent in ((401, "authentication_error", 401), (403, "permission_error", 403),
                               (404, "not_found_error", 404), (413, "request_too_large", 413),
                               (429, "rate_limit_error", 429), (500, "api_error", 500), (503, "overloaded_error", 529)):
        resp = ApiError(status, "no", retry_after=2 if status in (429, 503) else None).response(anthropic=True)
        assert resp.status_code == sent
        assert orjson.loads(resp.body) == {"type": "error", "error": {"type": kind, "message": "no"}}
        assert (resp.headers.get("retry-after") == "2") == (status in (429, 503))
    event = anthropic_error(ApiError(504, "too late", code="request_timeout").body()["error"])
    assert event == {"type": "error", "error": {"type": "timeout_error", "message": "too late"}}
    assert ApiError(400, "bad", param="x").response().status_code == 400  # OpenAI's routes keep theirs


def events_of(texts: list[str], finish: str = "stop", thinking: bool = False) -> list[ReplyEvent]:
    out = []
    for k, text in enumerate(texts):
        first = {"cached_tokens": 16, "thinking": thinking} if k == 0 else {}
        out.append(ReplyEvent(start=k, end=k + 1, text=text, prompt_tokens=40, ids=[k],
                              finish_reason=finish if k == len(texts) - 1 else None, **first))
    return out


class Counted:
    prompt_tokens, cached_tokens, completion_tokens = 40, 16, 7


def streamed(fmt: MessageFormat, events: list[ReplyEvent], per: int = 1) -> list[dict]:
    out = []
    for at in range(0, len(events), per):
        out += fmt.chunks(events[at:at + per], Counted())
    return out + fmt.closing_chunks(Counted())


def whole(fmt: MessageFormat, events: list[ReplyEvent]) -> dict:
    fmt.add(events)
    return fmt.response(Counted())


def sdk_message(events: list[dict]):
    """The SDK's own accumulation of the stream (what messages.stream's get_final_message returns), every event
    validated against its types first (a `ping` the SDK's stream reads and skips)."""
    snapshot, bufs = None, {}
    for ev in events:
        if ev == {"type": "ping"}:
            continue
        EVENTS.validate_python(ev)
        snapshot = accumulate_event(event=ev, current_snapshot=snapshot, json_bufs=bufs)
    return snapshot


ANSWER = ["<think>", "look", " it up</think>", "\n\nLet me ", "check.", "<tool_call>",
          '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "</tool_call>"]


@pytest.mark.parametrize("per", [1, 3, 8])
def test_a_stream_is_anthropic_s_and_the_sdk_accumulates_the_whole_message(per):
    parse = {"reasoning": "qwen3", "tools": "hermes"}
    events = streamed(MessageFormat("abc", "m", 7, parse, shows_thinking=True), events_of(ANSWER), per)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"] == [
        "thinking", "text", "tool_use"]
    assert kinds.count("content_block_stop") == 3
    deltas = {e["delta"]["type"] for e in events if e["type"] == "content_block_delta"}
    assert deltas == {"thinking_delta", "text_delta", "input_json_delta"}
    full = whole(MessageFormat("abc", "m", 7, parse, shows_thinking=True), events_of(ANSWER))
    Message.model_validate(full)
    assert full["content"] == [{"type": "thinking", "thinking": "look it up", "signature": ""},
                               {"type": "text", "text": "Let me check."},
                               {"type": "tool_use", "id": "toolu_abc_2", "name": "get_weather",
                                "input": {"city": "Paris"}}]
    assert full["stop_reason"] == "tool_use" and full["id"] == "msg_abc"
    assert full["usage"] == {"input_tokens": 24, "output_tokens": 7, "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": 16}
    assert sdk_message(events).model_dump(exclude_none=True) == Message.model_validate(full).model_dump(
        exclude_none=True)


def test_reasoning_is_shown_only_when_thinking_was_asked_and_length_is_max_tokens():
    fmt = MessageFormat("abc", "m", 7, {"reasoning": "qwen3"}, shows_thinking=False)
    full = whole(fmt, events_of(["look</think>", "\n\nYes", " and"], finish="length", thinking=True))
    assert full["content"] == [{"type": "text", "text": "Yes and"}] and full["stop_reason"] == "max_tokens"
    plain = streamed(MessageFormat("abc", "m", 7), events_of(["Hi", " there"]))
    assert sdk_message(plain).stop_reason == "end_turn"
    assert sdk_message(plain).content[0].text == "Hi there"


def test_a_stop_sequence_ends_it_with_its_reason_and_the_sequence():
    """The detokenizer says which stop string cut the answer (ReplyEvent.stop_sequence)."""
    events = events_of(["Hi", " there"])
    events[-1] = ReplyEvent(start=1, end=2, text=" there", prompt_tokens=40, finish_reason="stop", stop_sequence="END")
    full = whole(MessageFormat("abc", "m", 7), events)
    assert (full["stop_reason"], full["stop_sequence"]) == ("stop_sequence", "END")
    final = sdk_message(streamed(MessageFormat("abc", "m", 7), events))
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "END")


def test_a_reattached_stream_sends_exactly_the_events_after_the_ones_it_had():
    """The events are a function of the reply stream: a format built from the record, fed the entries the
    client had without sending them, sends what the first would have sent after them."""
    parse = {"reasoning": "qwen3", "tools": "hermes"}
    record = {"rid": "msg_abc", "created": "7", "model": "m", "parse": json.dumps(parse), "thinking": "1",
              "kind": "message"}
    batch = [(f"1-{k}", ev) for k, ev in enumerate(events_of(ANSWER))]
    first = MessageFormat("abc", "m", 7, parse, True)
    sent = [first.batch_chunks(batch[k:k + 1], Counted())[0] for k in range(len(batch))]
    again = message_format_of_record(record, "abc")
    rest, event_id = again.batch_chunks(batch, Counted(), replay_until="1-3")
    assert rest == [c for chunks in sent[4:] for c in chunks] and event_id == "1-7"
    assert again.closing_chunks(Counted()) == first.closing_chunks(Counted())
    assert again.failure_chunks(ApiError(503, "bye").body())[0]["error"]["type"] == "overloaded_error"
