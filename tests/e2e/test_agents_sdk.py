"""Agent clients against the Responses API and chat completions, on the session's `rsinfer up` stack (no stack of
their own): the openai Agents SDK (`openai-agents`) with its Responses model and its Chat Completions model, each a
two-turn run with a function tool, and a recorded Codex-style sequence (tests/e2e/data/codex_turns.json) replayed
turn by turn. Every event and object the server sends is checked against the official SDK's types, strictly
(tests/support/openai_types.py). The demo model calls a tool when the call is forced (tool_choice "required" or a
named tool, as tests/e2e/test_tools.py shows) and thinks first when reasoning is asked for."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Annotated, Any

import httpx
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from pydantic import Field

from tests.support.helpers import sse_payloads
from tests.support.openai_types import strict_event, strict_response
from tests.support.stack import MODEL

pytestmark = pytest.mark.timeout(180)
CODEX = json.loads((Path(__file__).parent / "data" / "codex_turns.json").read_text())
NOTE = next(t for t in CODEX["turns"][0]["tools"] if t["name"] == "write_note")["format"]["definition"]
asked: list[str] = []


@function_tool
def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
    """The weather in a city."""
    asked.append(city)
    return f"It is sunny in {city}."


def weather_agent(model) -> Agent:
    # forced on the first call of each run; the SDK resets tool_choice after a tool ran (reset_tool_choice), so the
    # call after the tool's output answers in text
    return Agent(name="weather", instructions="Answer weather questions with the tool.", tools=[get_weather],
                 model=model, model_settings=ModelSettings(tool_choice="required", max_tokens=200, temperature=0))


async def two_turns(agent: Agent, validate) -> list[Any]:
    """Two runs of one conversation (the second continues the first's items), the second streamed: each calls
    the tool and then answers."""
    config = RunConfig(tracing_disabled=True)
    first = await Runner.run(agent, "Weather in Paris?", run_config=config, max_turns=4)
    streamed = Runner.run_streamed(agent, [*first.to_input_list(), {"role": "user", "content": "And in Rome?"}],
                                   run_config=config, max_turns=4)
    async for event in streamed.stream_events():
        if event.type == "raw_response_event":
            validate(event.data)
    return [first, streamed]


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_an_agent_calls_its_tool_on_each_of_two_turns(stack, api):
    set_tracing_disabled(True)
    client = stack.async_client()
    model = (OpenAIResponsesModel(model=MODEL, openai_client=client) if api == "responses" else
             OpenAIChatCompletionsModel(model=MODEL, openai_client=client))
    asked.clear()
    runs = asyncio.run(two_turns(weather_agent(model), strict_event if api == "responses" else lambda e: None))
    assert len(asked) == 2, asked  # the tool ran once per run
    for run in runs:
        kinds = [item.type for item in run.new_items]
        assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item", kinds
        assert isinstance(run.final_output, str)
        if api == "responses":
            for response in run.raw_responses:
                assert response.response_id and response.response_id.startswith("resp_")


# -- a Codex-style sequence -------------------------------------------------------------------------------------
def replay_turn(url: str, body: dict, turn: int) -> tuple[list[dict], dict]:
    """One streamed turn: its events (each valid for the SDK) and the final response object."""
    events = []
    with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=90) as resp:
        assert resp.status_code == 200, resp.read()[:500]
        buf = ""
        for text in resp.iter_text():
            buf += text
            *frames, buf = buf.split("\n\n")
            for frame in frames:
                events += [json.loads(d) for d in sse_payloads(frame + "\n\n")]
    for ev in events:
        strict_event(ev)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed", (turn, final["output"], final.get("error"))
    strict_response(final)
    return events, final


def codex_bodies(turn: dict, history: list[dict], calls: list[str]) -> dict:
    """A recorded turn's body: `{"$history": true}` is what the client sent and got back so far (Codex sends the
    whole conversation each turn, with `store: false`), "$call" the id of the last call it got."""
    items = []
    for item in turn["input"]:
        if item.get("$history"):
            items += history
        else:
            items.append({k: (calls[-1] if v == "$call" else v) for k, v in item.items()})
    return {**{k: v for k, v in turn.items() if not k.startswith("$")}, "model": MODEL, "input": items}


def test_a_recorded_codex_sequence_replays(stack):
    history: list[dict] = []
    calls: list[str] = []
    for k, turn in enumerate(CODEX["turns"]):
        body = codex_bodies(turn, history, calls)
        _, final = replay_turn(stack.base_url, body, k)
        kinds = [o["type"] for o in final["output"]]
        assert kinds == turn["$expect"], (k, kinds)
        for reasoning in (o for o in final["output"] if o["type"] == "reasoning"):
            assert reasoning["encrypted_content"] and reasoning["content"][0]["text"] not in reasoning[
                "encrypted_content"]
        calls += [o["call_id"] for o in final["output"] if o["type"] in ("function_call", "custom_tool_call")]
        for call in (o for o in final["output"] if o["type"] == "custom_tool_call"):  # constrained by its regex
            assert re.fullmatch(NOTE, call["input"]), call
        history = [*body["input"], *final["output"]]
        with pytest.raises(openai.NotFoundError):  # store: false
            stack.client().responses.retrieve(final["id"])
    # a sealed reasoning altered, or sealed by another key, is refused naming it
    at = next(k for k, item in enumerate(history) if item["type"] == "reasoning")
    value = history[at]["encrypted_content"]
    forged = [*history[:at], {**history[at], "encrypted_content": value[:-8] + ("A" * 8 if value[-8:] != "A" * 8
                                                                                 else "B" * 8)}]
    body = {**codex_bodies(CODEX["turns"][0], [], []), "input": forged, "stream": False}
    resp = httpx.post(f"{stack.base_url}/v1/responses", json=body, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == f"input[{at}].encrypted_content", resp.text
