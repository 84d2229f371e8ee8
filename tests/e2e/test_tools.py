"""Tools and reasoning on the demo model (Hermes/Qwen3-style template, `<think>` and `<tool_call>` tokens):
a required or named tool choice is enforced with a grammar, so even random weights call the tool with
arguments valid against its schema; answers are split into reasoning, content and tool calls."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.support.stack import MODEL

pytestmark = pytest.mark.timeout(120)
WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                 "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER_ARGS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"]}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def assert_valid_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_tool_choice_round_trip(stack):
    client = stack.client()
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=200, seed=3)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    assert_valid_calls(choice.message.tool_calls)
    # the history with the call and its result renders through the template, as a plain prompt would
    results = [{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in choice.message.tool_calls]
    follow = client.chat.completions.create(model=MODEL, messages=[*ASK, choice.message, *results], tools=TOOLS,
                                            max_tokens=5, temperature=0)  # the message object, as returned
    history = [*ASK, choice.message.model_dump(exclude_none=True), *results]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stack.model_dir)
    calls = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
             for c in history[1]["tool_calls"]]
    rendered = tok.apply_chat_template([history[0], {**history[1], "tool_calls": calls}, *history[2:]],
                                       tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\nsunny\n</tool_response>" in rendered
    assert follow.usage.prompt_tokens == len(tok(rendered, add_special_tokens=False)["input_ids"])


def test_named_tool_streams_one_call(stack):
    client = stack.client()
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, seed=4, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_time"}}))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_time"
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS["get_time"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


# <tool_call> is one token of the demo vocabulary (as of Qwen's): a Lark grammar names it as a token
FORCED_CALL = ('start: "Let me check.\\n" <tool_call> "\\n{\\"name\\": \\"get_time\\", \\"arguments\\": '
               '{\\"tz\\": \\"" ("UTC" | "CET") "\\"}}\\n" </tool_call>')


def forced_call(stack, max_tokens: int, stream: bool) -> tuple[str, list[dict], str]:
    """A chat answer that a grammar makes a `get_time` call after "Let me check.": its content, tool calls and finish
    reason, streamed (gathered from the chunks) or not."""
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": max_tokens, "ebnf": FORCED_CALL,
            "stream": stream}
    resp = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    if stream:
        chunks = [json.loads(x[6:]) for x in resp.text.splitlines() if x.startswith("data: {")]
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        content = "".join(c["delta"].get("content") or "" for c in choices)
        calls = [t for c in choices for t in c["delta"].get("tool_calls") or []]
        return content, calls, choices[-1]["finish_reason"]
    choice = resp.json()["choices"][0]
    return choice["message"]["content"], choice["message"].get("tool_calls") or [], choice["finish_reason"]


def test_auto_parses_the_model_s_tool_call_text_and_none_does_not(stack):
    """With tool_choice "auto" whatever the model writes as <tool_call> becomes a call (a regex makes the
    random model write one); with "none" it stays text."""
    for stream in (False, True):
        content, calls, finish = forced_call(stack, 80, stream)
        assert content == "Let me check.\n" and finish == "tool_calls"  # as vLLM keeps it
        assert [c["function"]["name"] for c in calls] == ["get_time"]
        assert json.loads(calls[0]["function"]["arguments"])["tz"] in ("UTC", "CET")
    none = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "none", "max_tokens": 80,
        "ebnf": FORCED_CALL}).json()["choices"][0]
    assert "<tool_call>" in none["message"]["content"] and not none["message"].get("tool_calls")
    assert none["finish_reason"] == "stop"


def test_reasoning_is_separated_streamed_and_not(stack):
    """chat_template_kwargs reach the template (enable_thinking opens <think> in the demo template's prompt);
    what the answer says before </think> becomes reasoning_content, in whole answers and in stream deltas (before,
    the API read it as content: `</think>` and all)."""
    lark = 'start: /[a-z]{2,8}( [a-z]{2,8}){0,3}/ </think> "\\n\\n" ("yes" | "no")'
    body = {"model": MODEL, "messages": ASK, "max_tokens": 60, "ebnf": lark, "seed": 2,
            "chat_template_kwargs": {"enable_thinking": True}}
    whole = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60).json()
    msg = whole["choices"][0]["message"]
    assert msg["content"] in ("yes", "no") and msg["reasoning_content"]
    assert "think>" not in msg["reasoning_content"] + msg["content"] and whole["choices"][0]["finish_reason"] == "stop"
    resp = httpx.post(f"{stack.base_url}/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    deltas = [json.loads(x[6:])["choices"][0]["delta"] for x in resp.text.splitlines()
              if x.startswith("data: {") and json.loads(x[6:])["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
    off = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": ASK, "max_tokens": 3, "chat_template_kwargs": {"enable_thinking": False}}).json()
    on = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": ASK, "max_tokens": 3, "chat_template_kwargs": {"enable_thinking": True}}).json()
    assert off["usage"]["prompt_tokens"] > on["usage"]["prompt_tokens"]  # the closed <think></think> block


GUIDE_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
                 "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
                 "additionalProperties": False}}}]


def test_the_guide_tools_and_reasoning_examples_work_as_written(stack):
    """docs/user-guide.md's "Tools and reasoning" calls as written, with the official client, unseeded at the default
    temperature, a few times: the required call ends within max_tokens=100 with valid arguments (before: its
    string ran past the budget and `tool_calls[0]` raised TypeError 8/9), the history with its result renders and
    is answered, and with enable_thinking the reasoning is visible and split at its `</think>`."""
    client = stack.client()
    for _ in range(3):
        tools = GUIDE_TOOLS
        r = client.chat.completions.create(model="rsinfer-demo", messages=[{"role": "user", "content": "Paris?"}],
                                           tools=tools, tool_choice="required", max_tokens=100)
        call = r.choices[0].message.tool_calls[0]            # finish_reason "tool_calls"
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), tools[0]["function"]["parameters"])
        r = client.chat.completions.create(model="rsinfer-demo", max_tokens=100, tools=tools, messages=[
            {"role": "user", "content": "Paris?"}, r.choices[0].message,
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
        assert r.choices[0].finish_reason in ("stop", "tool_calls", "length")
        r = client.chat.completions.create(model="rsinfer-demo", messages=[{"role": "user", "content": "Paris?"}],
                                           max_tokens=100,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        message = r.choices[0].message
        assert message.reasoning_content and message.reasoning_content.strip(), message
        # the marker that ended the reasoning is in neither part (the model may sample `</think>` again later in
        # its answer, unseeded: that one is text of the answer, as at vLLM)
        assert "think>" not in message.reasoning_content
        assert not (message.content or "").lstrip().startswith("</think>"), message


def test_a_tool_call_cut_by_max_tokens_is_not_content(stack):
    """A call the budget cut before its `</tool_call>` is dropped, streamed or not: the content is the text
    before it, no `<tool_call>` markup, and the finish reason says `length` (before: the markup and the half
    call came back as content)."""
    for stream in (False, True):  # 20 tokens: past the opening marker, well before the call's end
        content, calls, finish = forced_call(stack, 20, stream)
        assert (content, calls, finish) == ("Let me check.\n", [], "length"), (stream, content)


@pytest.mark.parametrize(("extra", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
])
def test_tool_requests_that_cannot_be_served_are_refused(stack, extra, param):
    resp = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": ASK, "max_tokens": 4, **extra})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
