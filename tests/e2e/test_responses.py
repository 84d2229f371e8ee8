"""The Responses API through the official `openai` SDK against `rsinfer up`, and a second API process on the same
Redis (reading back, resuming and cancelling work another process accepted); every object and event parsed by
the SDK's own types."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response

from rsinfer.launcher import api_ready
from rsinfer.redis_server import free_port
from tests.support.helpers import sse_payloads, wait_for
from tests.support.openai_types import strict_event, strict_response
from tests.support.stack import MODEL

pytestmark = pytest.mark.timeout(120)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}
SHORT = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10}}, "required": ["answer"],
         "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}
# The demo model ends its answers within a few tokens, and the Responses API has no ignore_eos: a string of at least
# 4,000 characters keeps an answer going until max_output_tokens cuts it.
LONG = {"type": "json_schema", "name": "long", "schema": {
    "type": "object", "properties": {"text": {"type": "string", "minLength": 4000}}, "required": ["text"]}}


@pytest.fixture(scope="module")
def second_api(stack):
    """Another API process on the stack's Redis and namespace: its client."""
    port = free_port()
    stack.start("api-responses", "api", RSINFER_PORT=str(port))
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: api_ready(url), timeout=90)
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    stack.kill("api-responses")


def strict(obj: dict) -> Response:
    return strict_response(obj)


def chat_text(stack, messages, max_tokens: int, fmt: dict | None = None) -> str:
    """The chat answer to `messages`, with the response_format a Responses `text.format` stands for."""
    extra = {"response_format": {"type": "json_schema", "json_schema": {"name": fmt["name"], "schema": fmt["schema"]}}
             } if fmt else {}
    r = stack.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                               **extra)
    return r.choices[0].message.content


def raw_events(url: str, body: dict, cut_after: int | None = None) -> list[dict]:
    """The stream's events as JSON; with `cut_after`, the connection is closed after that many."""
    out = []
    with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        buf = ""
        for text in resp.iter_text():
            buf += text
            *frames, buf = buf.split("\n\n")
            for frame in frames:
                out += [json.loads(d) for d in sse_payloads(frame + "\n\n")]
            if cut_after is not None and len(out) >= cut_after:
                return out
    return out


def test_create_answers_like_chat(stack):
    client = stack.client()
    r = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=12, temperature=0,
                                text={"format": LONG})
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == chat_text(stack, [{"role": "user", "content": "Hello there"}], 12, LONG)
    assert r.usage.output_tokens == 12 and r.usage.input_tokens > 0
    assert r.max_output_tokens == 12 and r.store is True and r.background is False
    assert 'rsinfer_responses_total{status="incomplete"}' in httpx.get(f"{stack.base_url}/metrics", timeout=10).text
    with_instructions = client.responses.create(model=MODEL, instructions="Be brief.", input="Hi", temperature=0,
                                                max_output_tokens=6)
    assert with_instructions.output_text == chat_text(
        stack, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], 6)


def test_stream_events_and_final_response(stack, second_api):
    client = stack.client()
    # an answer that ends by itself (the SDK's get_final_response needs response.completed): a JSON object
    with client.responses.stream(model=MODEL, input="Tell me a story", max_output_tokens=80, temperature=0,
                                 text={"format": {"type": "json_schema", "name": "a", "schema": SHORT}}) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text and final.status == "completed"
    jsonschema.validate(json.loads(final.output_text), SHORT)
    # read back from the other API process: the same object
    again = second_api.responses.retrieve(final.id)
    assert again.output_text == final.output_text and again.usage == final.usage
    items = second_api.responses.input_items.list(final.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "Tell me a story"


def test_stream_cut_by_max_output_tokens_ends_incomplete(stack):
    body = {"model": MODEL, "input": "Tell me a story", "max_output_tokens": 20, "temperature": 0, "stream": True,
            "text": {"format": LONG}}
    events = raw_events(stack.base_url, body)
    for ev in events:
        strict_event(ev)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == chat_text(stack, [{"role": "user", "content": "Tell me a story"}], 20, LONG)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_background_stream_resumes_on_another_process(stack, second_api):
    body = {"model": MODEL, "input": "Count to fifty", "max_output_tokens": 120, "temperature": 0,
            "background": True, "stream": True, "text": {"format": LONG}}
    whole = raw_events(stack.base_url, body)
    for ev in whole:
        strict_event(ev)
    expected = "".join(e["delta"] for e in whole if e["type"] == "response.output_text.delta")
    head = raw_events(stack.base_url, body, cut_after=12)  # the client goes away; the response goes on
    rid, last = head[0]["response"]["id"], head[-1]["sequence_number"]
    rest = list(second_api.responses.retrieve(rid, stream=True, starting_after=last))
    assert [e.sequence_number for e in rest] == list(range(last + 1, last + 1 + len(rest)))
    text = "".join(e["delta"] for e in head if e["type"] == "response.output_text.delta")
    text += "".join(e.delta for e in rest if e.type == "response.output_text.delta")
    assert text == expected
    assert rest[-1].type == "response.incomplete" and rest[-1].response.output_text == expected
    assert stack.client().responses.retrieve(rid).output_text == expected


def test_background_runs_without_a_client_and_cancel_is_idempotent(stack, second_api):
    client = stack.client()
    quick = client.responses.create(model=MODEL, input="Hi", max_output_tokens=8, temperature=0, background=True,
                                    text={"format": LONG})
    assert quick.status in ("queued", "in_progress")
    wait_for(lambda: second_api.responses.retrieve(quick.id).status == "incomplete", timeout=30)
    assert second_api.responses.retrieve(quick.id).output_text == chat_text(stack, [{"role": "user",
                                                                                      "content": "Hi"}], 8, LONG)
    long = client.responses.create(model=MODEL, input="Write a long essay", max_output_tokens=3000, temperature=0,
                                   background=True, text={"format": LONG})
    wait_for(lambda: client.responses.retrieve(long.id).status == "in_progress", timeout=30)
    cancelled = second_api.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.cancel(long.id) == cancelled  # idempotent, from either process
    assert stack.redis().hget(stack.keys.request(long.id.removeprefix("resp_")), "status") == "aborted"
    client.responses.delete(long.id)
    with pytest.raises(openai.NotFoundError):
        second_api.responses.retrieve(long.id)


def inflight(stack) -> float:
    """The API process's `rsinfer_inflight_requests` for the model."""
    text = httpx.get(f"{stack.base_url}/metrics", timeout=10).text
    line = next((ln for ln in text.splitlines() if ln.startswith(f'rsinfer_inflight_requests{{model="{MODEL}"}}')),
                None)
    return float(line.split()[-1]) if line else 0.0


@pytest.mark.timeout(240)
def test_cancelling_running_background_responses_leaks_no_inflight_count(stack):
    """Cancelled on the process that follows them (its reply stream read again to build the final object), each
    request it submitted still closes once: the in-flight gauge returns to where it was."""
    client, before = stack.client(), inflight(stack)
    ids = [client.responses.create(model=MODEL, input=f"Write a long essay {k}", max_output_tokens=3000,
                                   temperature=0, background=True, text={"format": LONG}).id for k in range(3)]
    for rid in ids:  # the session stack may still be finishing other modules' work: queued a while is fine
        wait_for(lambda rid=rid: client.responses.retrieve(rid).status == "in_progress", timeout=90)
        assert client.responses.cancel(rid).status == "cancelled"
    wait_for(lambda: inflight(stack) == before, timeout=15)
    for rid in ids:
        client.responses.delete(rid)


def test_function_call_round_trip_through_previous_response_id(stack, second_api):
    client = stack.client()
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[TOOL], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=200, temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and first.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    follow = second_api.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[TOOL], max_output_tokens=5, temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert follow.previous_response_id == first.id
    # the same conversation sent as chat messages in full gives the same answer
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": calls[0].call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
                {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                          tools=[{"type": "function", "function": {
                                              k: TOOL[k] for k in ("name", "description", "parameters")}}])
    assert follow.output_text == (chat.choices[0].message.content or "")
    assert follow.usage.input_tokens == chat.usage.prompt_tokens


def test_json_schema_text_format_validates(stack):
    r = stack.client().responses.create(model=MODEL, input="Answer in JSON", max_output_tokens=60, temperature=0,
                                        text={"format": {"type": "json_schema", "name": "a", "schema": SHORT}})
    jsonschema.validate(json.loads(r.output_text), SHORT)
    assert r.text.format.type == "json_schema" and r.status == "completed"


@pytest.mark.parametrize(("body", "param", "status"), [
    ({"input": "hi", "frobnicate": 1}, "frobnicate", 400),
    ({"input": "hi", "background": True, "store": False}, "store", 400),
    ({"input": "hi", "previous_response_id": "not-an-id"}, "previous_response_id", 400),
    ({"input": "hi", "previous_response_id": "resp_nosuchthing"}, "previous_response_id", 404),
    ({"input": [{"type": "image", "url": "x"}]}, "input", 400),
    ({"input": []}, "input", 400),
    ({"input": [{"role": "user", "content": "x"}] * 1025}, "input", 400),  # --max-response-items
    ({"input": "x" * (4 << 20)}, "input", 400),  # --max-stored-response-bytes
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text", 400),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice", 400),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include", 400),
    ({"input": "hi", "truncation": "auto"}, "truncation", 400),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", 400),
    ({"input": "hi", "prompt_cache_key": "k" * 300}, "prompt_cache_key", 400),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", 400),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "forged"}]}, "input[0].encrypted_content",
     400),
])
def test_bad_requests_are_refused_naming_the_field(stack, body, param, status):
    resp = httpx.post(f"{stack.base_url}/v1/responses", json={"model": MODEL, **body}, timeout=30)
    assert resp.status_code == status, resp.text[:300]
    err = resp.json()["error"]
    assert param in (err["param"] or "") or param in err["message"]


def test_the_fields_agent_sdks_send_are_honoured_and_kept(stack):
    """What the Agents SDK and Codex send on every call (before: `include` was a 400 even as [])."""
    r = stack.client().responses.create(
        model=MODEL, input="Hi", max_output_tokens=4, temperature=0, include=[], prompt_cache_key="conv-7",
        safety_identifier="user-7", prompt_cache_retention="in_memory", max_tool_calls=2, top_logprobs=0,
        truncation="disabled", conversation=None, prompt=None, context_management=None, store=False)
    strict(r.model_dump(by_alias=True, exclude_unset=True))
    assert r.prompt_cache_key == "conv-7" and r.safety_identifier == "user-7" and r.max_tool_calls == 2
    record = stack.redis().hgetall(stack.keys.request(r.id.removeprefix("resp_")))
    assert record["prompt_cache_key"] == "conv-7" and record["safety_identifier"] == "user-7"


def test_reasoning_round_trips_sealed_and_only_where_sealed(stack, second_api):
    """A stateless client gets its reasoning sealed (`encrypted_content`) and hands it back on its next turn;
    the API process that sealed it opens it, another one with a key of its own (no --responses-key) refuses it
    naming the field."""
    ask = {"role": "user", "content": "Paris?"}
    first = stack.client().responses.create(model=MODEL, input=[ask], reasoning={"effort": "medium"}, store=False,
                                            include=["reasoning.encrypted_content"], max_output_tokens=40,
                                            temperature=0)
    strict(first.model_dump(by_alias=True, exclude_unset=True))
    reasoning = first.output[0]
    assert reasoning.type == "reasoning" and reasoning.encrypted_content and reasoning.content[0].text
    assert reasoning.content[0].text not in reasoning.encrypted_content
    turn = [ask, *[o.model_dump(exclude_none=True) for o in first.output], {"role": "user", "content": "And?"}]
    again = stack.client().responses.create(model=MODEL, input=turn, store=False, max_output_tokens=4)
    assert again.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as e:
        second_api.responses.create(model=MODEL, input=turn, store=False, max_output_tokens=4)
    assert e.value.body["param"] == "input[1].encrypted_content"


def test_unknown_and_malformed_ids(stack):
    for path, status in (("/v1/responses/resp_nope", 404), ("/v1/responses/bad%20id", 400),
                         ("/v1/responses/resp_nope/input_items", 404)):
        assert httpx.get(f"{stack.base_url}{path}", timeout=10).status_code == status
    plain = stack.client().responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0)
    resp = httpx.get(f"{stack.base_url}/v1/responses/{plain.id}?stream=true", timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream"
    not_stored = stack.client().responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        stack.client().responses.retrieve(not_stored.id)


def stored_keys(stack) -> set[str]:
    """Every stored response of the stack's namespace (any layout: `resp:` or `response:` keys)."""
    return set(stack.redis().scan_iter(f"{stack.namespace}:resp*", count=1000))


def test_a_prompt_past_the_context_stores_nothing(stack):
    """Refused by the API (its text cannot fit the context, whatever it tokenizes to) or by the tokenizer (too
    many tokens): a create answered with an error leaves no stored response; a background one, whose id its
    client has, ends `failed` with the error (bounded like every stored response)."""
    words = " ".join(("alpha", "bravo", "charlie", "delta", "echo")[k * 7 % 5] for k in range(3000))  # ~11k tokens
    before = stored_keys(stack)
    for text, at_api in (("x" * 70_000, True), (words, False)):
        for stream in (False, True):
            resp = httpx.post(f"{stack.base_url}/v1/responses", timeout=30, json={
                "model": MODEL, "input": text, "max_output_tokens": 4, "stream": stream})
            assert resp.status_code == 400, resp.text[:300]
            assert stored_keys(stack) == before, text[:10]
            err = resp.json()["error"]
            assert err["code"] == "context_length_exceeded" and (err["param"] == "input") == at_api, err
    bg = stack.client().responses.create(model=MODEL, input=words, max_output_tokens=4, background=True)
    failed = wait_for(lambda: (r := stack.client().responses.retrieve(bg.id)).status == "failed" and r, timeout=30)
    assert "context_length_exceeded" in failed.error.message
    stack.client().responses.delete(bg.id)
    assert stored_keys(stack) == before


@pytest.mark.timeout(300)
def test_a_chain_of_responses_stores_each_turn_once(stack):
    """Each response stores its own input and output and the id of the one it continues, not the conversation
    again: 200 chained turns take about 200 times one turn's room (the 200th no more than the 2nd), and the
    conversation is still read back whole."""
    r, client, ids, prompts = stack.redis(), stack.client(), [], []
    prev = None
    for k in range(200):
        resp = client.responses.create(model=MODEL, input=f"turn {k}", max_output_tokens=1, temperature=0,
                                       previous_response_id=prev)
        prev = resp.id
        ids.append(resp.id)
        prompts.append(resp.usage.input_tokens)
    assert prompts == sorted(prompts) and prompts[-1] > 10 * prompts[0]  # every turn reads the whole conversation
    sizes = [r.memory_usage(k) for k in (stored_key(stack, rid) for rid in ids)]
    assert max(sizes[1:]) <= 2 * sizes[1], (sizes[1], max(sizes))
    # the conversation of a later turn, sent as chat messages in full, is the same prompt
    third = [client.responses.retrieve(rid) for rid in ids[:3]]
    messages = [m for k, resp in enumerate(third) for m in (
        {"role": "user", "content": f"turn {k}"}, {"role": "assistant", "content": resp.output_text})][:-1]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    assert third[2].usage.input_tokens == chat.usage.prompt_tokens


def stored_key(stack, response_id: str) -> str:
    """The key of a stored response (either layout)."""
    uid = response_id.removeprefix("resp_")
    return next(k for k in (f"{stack.namespace}:response:{{{uid}}}", f"{stack.namespace}:resp:{{{uid}}}")
                if stack.redis().exists(k))
