"""Ordered reply events -> the Responses API's objects and stream events (services/api/answer/formats.py's role for
`POST /v1/responses`).

Each reply event is fed on its own, never coalesced with the events read with it, so the events a stream sends,
and their `sequence_number`s, are a pure function of the reply stream: any API process that reads it again
(`GET /v1/responses/{id}?stream=true&starting_after=N`, services/api/responses_api/responses.py) numbers them the same
and can send exactly those after N. Item ids and call ids are derived from the response's uid for the same reason.

A response's output items are, in order: its reasoning (where the model's answers have it), its message, and its
function calls (services/api/answer/parsers.py splits the answer), each announced (`response.output_item.added`),
streamed (`.delta`) and closed (`.done`) in turn. A call of a custom tool (a function of one string, `input`, to the
template: services/api/responses_api/response_schemas.py) is a `custom_tool_call` with that string as its input.
With `include: ["reasoning.encrypted_content"]` a reasoning item carries its text sealed with the server's key
(services/api/responses_api/sealing.py; a fresh nonce each time, so the value differs between reads of one
response, and each opens to the same text).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from services.api.answer.formats import Counts, Format, Head
from services.api.answer.parsers import AnswerParser
from shared.messages import ReplyEvent
from shared.request_states import Finish

if TYPE_CHECKING:
    from services.api.responses_api.sealing import Sealer

ENDS = {Finish.STOP: "completed", Finish.LENGTH: "incomplete", Finish.ABORT: "cancelled", Finish.ERROR: "failed"}
END_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete",
              "cancelled": "response.incomplete", "failed": "response.failed"}


def response_usage(c: Counts) -> dict:
    # every prompt's pages go into the prefix cache (services/scheduler/engine/prefix_cache.py), those not read
    # from it are written to it
    details = {"cached_tokens": c.cached_tokens, "cache_write_tokens": c.prompt_tokens - c.cached_tokens}
    return {"input_tokens": c.prompt_tokens, "input_tokens_details": details,
            "output_tokens": c.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": c.prompt_tokens + c.completion_tokens}


def response_error(err: dict) -> dict:
    """OpenAI's error object of a response: its `code` is one of a fixed set (the SDK's ResponseError), so ours
    goes into the message."""
    ours, message = err.get("code") or "", err.get("message", "")
    code = "invalid_prompt" if err.get("type") == "invalid_request_error" else "server_error"
    if ours in ("overloaded", "rate_limit_exceeded"):
        code = "rate_limit_exceeded"
    return {"code": code, "message": f"{ours}: {message}" if ours else message}


def custom_input(arguments: str) -> str:
    """A custom tool's input from the arguments the model wrote: their `input` string, else (a model that wrote
    something else) the arguments as they are."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value["input"] if isinstance(value, dict) and isinstance(value.get("input"), str) else arguments


class ResponseFormat(Format):
    """`shown`: the request's fields the response object echoes (services/api/responses_api/response_schemas.py
    `shown`); `parse`: how answers are split (reasoning, tool calls), as for chat."""

    event_ids = False  # resumed by sequence number, not by Last-Event-ID
    named_events = True  # each SSE event says its type (`event:`), as OpenAI's do
    sends_done = False  # no `data: [DONE]` at the end

    def __init__(self, shown: dict[str, Any], parse: dict | None = None, uid: str = "", created: int = 0):
        super().__init__(Head(f"resp_{uid}", shown["model"], created, 1))
        self.shown, self.parse = shown, parse or {}
        self.parser = AnswerParser(bool(self.parse.get("reasoning")), self.parse.get("tools"))
        self.uid = uid
        self.seq = 0
        self.skip_through = -1  # events numbered up to this were sent before (a resumed stream)
        self.pending: list[dict] = []
        self.output: list[dict] = []
        self.current: dict | None = None  # the reasoning or message item being streamed
        self.finish: str | None = None
        self.error: dict | None = None
        self.opened = False
        self.on_end: Callable[[dict], Awaitable[None]] | None = None  # stores the final object (responses.py)
        self.final: dict | None = None
        self.sealer: Sealer | None = None  # seals reasoning when `parse` says so (responses.py sets it)
        self.custom = {t["name"] for t in shown.get("tools") or [] if t.get("type") == "custom"}

    def start(self, uid: str, created: int) -> None:
        """The uid and time of the job it answers, once known (services/api/responses_api/response_schemas.py)."""
        self.uid, self.rid, self.created = uid, f"resp_{uid}", created

    def record_fields(self) -> dict:
        return {"rid": self.rid, "created": self.created}

    # -- events ----------------------------------------------------------------------------------------------
    def _emit(self, kind: str, **fields: Any) -> None:
        if self.seq > self.skip_through:
            self.pending.append({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1

    def thinking_opened(self, index: int) -> None:
        self.parser.open_thinking()

    def batch_chunks(self, batch, counts, replay_until=None):
        return self.chunks([ev for _, ev in batch], counts), None

    def chunks(self, events: list[ReplyEvent], counts: Counts) -> list[dict]:
        if not self.opened:
            self.opened = True
            self._emit("response.created", response=self.obj("in_progress"))
            self._emit("response.in_progress", response=self.obj("in_progress"))
        self.note_prompts(events)
        for ev in events:
            self._feed(ev)
        out, self.pending = self.pending, []
        return out

    def _feed(self, ev: ReplyEvent) -> None:
        final = ev.finish_reason is not None
        parsed = self.parser.feed(ev.text, final=final)
        if parsed.reasoning:
            self._text("reasoning", parsed.reasoning)
        if parsed.content:
            self._text("message", parsed.content)
        for call in parsed.tool_calls:
            self._call(call["function"]["name"], call["function"]["arguments"])
        if final:
            self.finish = ev.finish_reason
            self._close_current()

    def _text(self, kind: str, text: str) -> None:
        if self.current is not None and self.current["type"] != kind:
            self._close_current()
        if self.current is None:
            self._open(kind)
        item, at = self.current, len(self.output) - 1
        item["_text"] += text
        if kind == "message":
            self._emit("response.output_text.delta", item_id=item["id"], output_index=at, content_index=0,
                       delta=text, logprobs=[])
        else:
            self._emit("response.reasoning_text.delta", item_id=item["id"], output_index=at, content_index=0,
                       delta=text)

    def _open(self, kind: str) -> None:
        at = len(self.output)
        if kind == "message":
            item = {"id": f"msg_{self.uid}_{at}", "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
        else:
            item = {"id": f"rs_{self.uid}_{at}", "type": "reasoning", "summary": [], "status": "in_progress"}
        self.output.append(item)
        self._emit("response.output_item.added", output_index=at, item=copy.deepcopy(item))
        item["_text"] = ""
        self.current = item
        if kind == "message":
            self._emit("response.content_part.added", item_id=item["id"], output_index=at, content_index=0,
                       part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def _close_current(self) -> None:
        item, at = self.current, len(self.output) - 1
        if item is None:
            return
        self.current = None
        text = item.pop("_text")
        item["status"] = "incomplete" if self.finish == Finish.LENGTH else "completed"
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            self._emit("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                       text=text, logprobs=[])
            self._emit("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                       part=part)
            item["content"] = [part]
        else:
            self._emit("response.reasoning_text.done", item_id=item["id"], output_index=at, content_index=0,
                       text=text)
            item["content"] = [{"type": "reasoning_text", "text": text}]
            if self.parse.get("seal") is not None and self.sealer is not None:  # the tenant's name
                item["encrypted_content"] = self.sealer.seal(text, self.shown["model"], self.parse["seal"])
        self._emit("response.output_item.done", output_index=at, item=copy.deepcopy(item))

    def _call(self, name: str, arguments: str) -> None:
        self._close_current()
        if name in self.custom:
            self._custom_call(name, custom_input(arguments))
            return
        at = len(self.output)
        item = {"id": f"fc_{self.uid}_{at}", "type": "function_call", "call_id": f"call_{self.uid}_{at}",
                "name": name, "arguments": "", "status": "in_progress"}
        self._emit("response.output_item.added", output_index=at, item=dict(item))
        self._emit("response.function_call_arguments.delta", item_id=item["id"], output_index=at, delta=arguments)
        self._emit("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                   arguments=arguments)
        item.update(arguments=arguments, status="completed")
        self.output.append(item)
        self._emit("response.output_item.done", output_index=at, item=dict(item))

    def _custom_call(self, name: str, text: str) -> None:
        at = len(self.output)
        item = {"id": f"ctc_{self.uid}_{at}", "type": "custom_tool_call", "call_id": f"call_{self.uid}_{at}",
                "name": name, "input": ""}
        self._emit("response.output_item.added", output_index=at, item=dict(item))
        self._emit("response.custom_tool_call_input.delta", item_id=item["id"], output_index=at, delta=text)
        self._emit("response.custom_tool_call_input.done", item_id=item["id"], output_index=at, input=text)
        item["input"] = text
        self.output.append(item)
        self._emit("response.output_item.done", output_index=at, item=dict(item))

    # -- the end ---------------------------------------------------------------------------------------------
    def closing_chunks(self, counts: Counts) -> list[dict]:
        """The stream's last event: the response's end, with the whole object."""
        final = self.response(counts)
        self._emit(END_EVENTS[final["status"]], response=final)
        out, self.pending = self.pending, []
        return out

    def failure_chunks(self, error: dict) -> list[dict]:
        self.error = response_error(error.get("error", error))
        self.final = self.obj("failed")
        self._emit("response.failed", response=self.final)
        out, self.pending = self.pending, []
        return out

    async def settle(self) -> None:
        if self.on_end is not None and self.final is not None:
            await self.on_end(self.final)

    def add(self, events: list[ReplyEvent]) -> None:
        self.chunks(events, None)  # type: ignore[arg-type]  (the opening events need no counts)

    def response(self, counts: Counts) -> dict:
        """The final object, once every reply event was fed."""
        self._close_current()
        status = ENDS.get(self.finish or "", "failed") if self.error is None else "failed"
        self.final = self.obj(status, response_usage(counts))
        return self.final

    def obj(self, status: str, usage: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        output = [{k: v for k, v in item.items() if k != "_text"} for item in self.output]
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "error": self.error, "incomplete_details": incomplete, "output": output, "usage": usage,
                **self.shown}
