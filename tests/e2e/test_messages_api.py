"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) with the official `anthropic` client and
LangChain's ChatAnthropic, on the demo model (its Hermes/Qwen3-style template: tool calls and reasoning).

Two API processes on the session stack's pipeline: the session's own (no keys) and one more that takes keys
(`x-api-key` or a bearer key) from a keys file, with a resume window, so that a stream started there can be
dropped and read on to its end through the session's API.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from rsinfer.launcher import api_ready
from rsinfer.redis_server import free_port
from tests.support.helpers import engines_idle, raw_post, wait_for
from tests.support.stack import MODEL, Stack

pytestmark = pytest.mark.timeout(120)
KEY, RPM_KEY = "sk-msg-admin-" + "0" * 24, "sk-msg-rpm-" + "0" * 24
EVENTS = TypeAdapter(RawMessageStreamEvent)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather forecast", "input_schema": WEATHER},
         {"name": "get_time", "input_schema": {"type": "object", "properties": {"tz": {"type": "string",
                                                                                     "enum": ["UTC", "CET"]}},
                                               "required": ["tz"]}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def keyed(stack, tmp_path_factory) -> Iterator[str]:
    """The second API process: keys from a file (an admin key, and one with no requests per minute), and a
    resume window for a dropped stream."""
    keys = tmp_path_factory.mktemp("msg-keys") / "keys.json"
    keys.write_text(json.dumps([{"key": KEY, "tenant": "ops", "admin": True},
                                {"key": RPM_KEY, "tenant": "team-rpm", "requests_per_minute": 0}]))
    s = Stack(stack.redis_url, stack.model_dir, stack.namespace, stack.log_dir)
    s.port = free_port()
    try:
        s.start("api-messages", "api", RSINFER_API_KEYS_FILE=str(keys), RSINFER_RESUME_WINDOW_S="5",
                RSINFER_GRACE_PERIOD_S="1")
        wait_for(lambda: api_ready(s.base_url), timeout=60)
        yield s.base_url
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(keyed) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=keyed, api_key=KEY, max_retries=0)


def sse_events(text: str) -> list[dict]:
    """Each event of a stream, checked: its `event:` line names its data's type."""
    out = []
    for frame in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines() if ": " in line and not line.startswith(":"))
        if "data" in lines:
            data = json.loads(lines["data"])
            assert lines["event"] == data["type"], frame
            out.append({**data, "_id": lines.get("id")})
    return out


def test_create_and_stream_with_the_official_client(client, stack):
    msg = client.messages.create(model=MODEL, max_tokens=12, system="Be brief.", messages=ASK,
                                 extra_body={"temperature": 0})
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.content[0].type == "text"
    assert msg.usage.output_tokens <= 12 and msg.usage.cache_creation_input_tokens == 0
    with client.messages.stream(model=MODEL, max_tokens=12, system="Be brief.", messages=ASK,
                                extra_body={"temperature": 0}) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.content[0].text == msg.content[0].text and final.stop_reason == msg.stop_reason
    assert final.usage.output_tokens == msg.usage.output_tokens
    # the raw events, as sent: every one valid for the SDK's types (the SDK's stream skips `ping`)
    raw = httpx.post(f"{stack.base_url}/v1/messages", timeout=60, json={
        "model": MODEL, "max_tokens": 12, "system": "Be brief.", "messages": ASK, "stream": True,
        "temperature": 0}).text
    events = sse_events(raw)
    assert [e["type"] for e in events][:2] == ["message_start", "ping"]
    for ev in events:
        ev.pop("_id")
        if ev["type"] != "ping":
            EVENTS.validate_python(ev)
    assert "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta") == \
        final.content[0].text


def test_count_tokens_is_the_prompt_of_the_same_message(client, stack):
    """count_tokens through one API process, the message through the other: the prompt it counts is the
    message's (usage's input_tokens plus what the prefix cache held)."""
    conversation = {"system": [{"type": "text", "text": "You forecast."}], "tools": TOOLS, "messages": [
        *ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                 "input": {"city": "Paris", "days": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]}
    counted = client.messages.count_tokens(model=MODEL, **conversation).input_tokens
    other = anthropic.Anthropic(base_url=stack.base_url, api_key="unused", max_retries=0)
    msg = other.messages.create(model=MODEL, max_tokens=3, **conversation)
    assert counted == msg.usage.input_tokens + msg.usage.cache_read_input_tokens > 50
    plain = client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    assert 0 < plain < counted


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_a_tool_use_round_trip(client, choice):
    """tool_choice tool or any: the call is constrained by a grammar from the input_schema (valid arguments even
    from the demo model), comes back as a tool_use block, and its result goes back as a tool_result block."""
    # greedy: sampled at temperature 1, the demo model may pad the call's JSON with whitespace past max_tokens
    msg = client.messages.create(model=MODEL, max_tokens=200, messages=ASK, tools=TOOLS, tool_choice=choice,
                                 extra_body={"temperature": 0})
    assert msg.stop_reason == "tool_use", msg
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert uses and all(u.id.startswith("toolu_") for u in uses)
    if choice["type"] == "tool":
        assert [u.name for u in uses] == ["get_weather"]
    for use in uses:
        jsonschema.validate(use.input, {t["name"]: t["input_schema"] for t in TOOLS}[use.name])
    results = [{"type": "tool_result", "tool_use_id": u.id, "content": "sunny"} for u in uses]
    follow = client.messages.create(model=MODEL, max_tokens=8, tools=TOOLS, messages=[
        *ASK, {"role": "assistant", "content": msg.content}, {"role": "user", "content": results}])
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with client.messages.stream(model=MODEL, max_tokens=200, messages=ASK, tools=TOOLS, tool_choice=choice,
                                extra_body={"temperature": 0}) as s:  # greedy, as above
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and any(b.type == "tool_use" for b in final.content)


def test_a_stop_sequence_is_the_stop_reason(client):
    """The grammar of a named call makes the answer say `"arguments"`: the stop sequence cuts it there."""
    msg = client.messages.create(model=MODEL, max_tokens=200, messages=ASK, tools=TOOLS, stop_sequences=[
        "never said", '"arguments"'], tool_choice={"type": "tool", "name": "get_time"})
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", '"arguments"')


def test_thinking_blocks_with_a_reasoning_template(client):
    msg = client.messages.create(model=MODEL, max_tokens=1100, messages=[{"role": "user", "content": "Paris?"}],
                                 thinking={"type": "enabled", "budget_tokens": 1024})
    kinds = [b.type for b in msg.content]
    assert kinds[0] == "thinking" and msg.content[0].thinking.strip(), msg
    assert "think>" not in msg.content[0].thinking
    with client.messages.stream(model=MODEL, max_tokens=1100, messages=[{"role": "user", "content": "Paris?"}],
                                thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        deltas = {ev.delta.type for ev in stream if ev.type == "content_block_delta"}
        final = stream.get_final_message()
    assert "thinking_delta" in deltas and final.content[0].type == "thinking"
    off = client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Paris?"}])
    assert all(b.type != "thinking" for b in off.content)


def test_errors_in_anthropic_s_shape(client, keyed, stack):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content.0" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="frobnicate"):
        client.messages.create(model=MODEL, max_tokens=5, messages=ASK, extra_body={"frobnicate": 1})
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        client.messages.create(model=MODEL, max_tokens=5, messages=ASK, extra_body={"temperature": 1.5})
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=keyed, api_key="sk-wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=ASK)
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    bearer = httpx.post(f"{keyed}/v1/messages/count_tokens", headers={"Authorization": f"Bearer {KEY}",
                                                                      "anthropic-version": "2023-06-01"},
                        json={"model": MODEL, "messages": ASK}, timeout=30)
    assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=5, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.RateLimitError) as e:
        anthropic.Anthropic(base_url=keyed, api_key=RPM_KEY, max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=ASK)
    assert e.value.body["error"]["type"] == "rate_limit_error" and int(e.value.response.headers["retry-after"]) >= 1
    # OpenAI's routes keep OpenAI's shape
    assert httpx.post(f"{keyed}/v1/chat/completions", json={}, timeout=30).json()["error"]["code"] == \
        "invalid_api_key"


LONG = {"model": MODEL, "max_tokens": 1500, "stream": True, "messages": [{"role": "user", "content": "Write."}],
        "tools": [{"name": "essay", "input_schema": {"type": "object", "properties": {
            "text": {"type": "string", "minLength": 1400}}, "required": ["text"]}}],
        "tool_choice": {"type": "tool", "name": "essay"}}  # the grammar makes it run to its max_tokens


def test_a_stream_dropped_on_one_api_process_is_read_on_the_other(keyed, stack):
    """Started on the keyed process (resume window 5 s), dropped after its first batch of events, read on through the
    session's process from the last event id it had: the events after it, and no other, to the message's end
    (the same as a read from the start sends after the ones it had)."""
    body = {**LONG, "max_tokens": 300, "temperature": 0}
    with httpx.stream("POST", f"{keyed}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as resp:
        text = ""
        for piece in resp.iter_text():
            text += piece
            if "event: ping" in text and text.endswith("\n\n"):
                break  # the tool_use block comes once its grammar-bound call ends, 300 tokens on
    had = sse_events(text)
    uid = had[0]["message"]["id"]
    last = [e["_id"] for e in had if e["_id"]][-1]
    rest = sse_events(httpx.get(f"{stack.base_url}/v1/requests/{uid}/stream", headers={"Last-Event-ID": last},
                                timeout=60).text)
    assert rest[-1]["type"] == "message_stop" and rest[0]["type"] != "message_start"
    whole = sse_events(httpx.get(f"{stack.base_url}/v1/requests/{uid}/stream", timeout=60).text)
    assert [e["type"] for e in whole][:2] == ["message_start", "ping"]

    def bare(events: list[dict]) -> list[dict]:  # the ids name reply entries, which each read batches its own way
        return [{k: v for k, v in e.items() if k != "_id"} for e in events]
    assert bare(whole) == bare(had) + bare(rest)
    end = next(e for e in rest if e["type"] == "message_delta")
    assert end["delta"]["stop_reason"] == "max_tokens" and end["usage"]["output_tokens"] == 300


def test_a_disconnect_aborts_the_message(stack):
    """The client leaving a stream aborts the request everywhere (the session's API has no resume window):
    the scheduler drops it, as chat's do (tests/e2e/test_cancellation.py)."""
    r = stack.redis()
    sock = raw_post(stack.port, "/v1/messages", LONG)
    buf = b""
    while b'"id":"msg_' not in buf:
        buf += sock.recv(4096)
    uid = buf.split(b'"id":"msg_')[1][:32].decode()
    sock.close()
    wait_for(lambda: r.exists(stack.keys.abort(uid)), timeout=10, every=0.002)
    assert r.get(stack.keys.abort(uid)) == "client_disconnected"
    wait_for(lambda: r.hget(stack.keys.request(uid), "status") == "aborted", timeout=10)
    wait_for(lambda: engines_idle(stack), timeout=10)


def test_langchain_chat_anthropic(keyed):
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(model=MODEL, base_url=keyed, api_key=KEY, max_tokens=10, max_retries=0)
    reply = llm.invoke("Hello")
    assert isinstance(reply.content, (str, list)) and reply.usage_metadata["output_tokens"] <= 10
    chunks = list(llm.stream("Hello"))
    assert chunks and sum(c.usage_metadata["output_tokens"] for c in chunks if c.usage_metadata) <= 10
    # a tool in Anthropic's shape, its string bounded (an unbounded one may run past max_tokens: no call)
    bound = ChatAnthropic(model=MODEL, base_url=keyed, api_key=KEY, max_tokens=200, max_retries=0).bind_tools(
        [TOOLS[0]], tool_choice="get_weather")
    call = bound.invoke("Weather in Paris?").tool_calls[0]
    assert call["name"] == "get_weather" and call["id"].startswith("toolu_")
    jsonschema.validate(call["args"], WEATHER)
