"""Ordered reply events -> Anthropic's Message and its stream events (services/api/answer/formats.py's role for
`POST /v1/messages`).

A stream is, as Anthropic sends it: `message_start` (the message with no content yet, and the input's usage),
a `ping`, then each content block in turn (`content_block_start`, its deltas: `thinking_delta`, `text_delta`,
`input_json_delta`, then `content_block_stop`), `message_delta` (the stop reason and the usage) and
`message_stop`; an `error` event if the request ends early. Blocks are, in order: the answer's reasoning (a
`thinking` block, shown when the request asked for thinking), its text, and its tool calls (`tool_use` blocks),
as services/api/answer/parsers.py splits the answer.

The events are a pure function of the reply stream (block ids are derived from the request's uid): a client
that reattaches (GET /v1/requests/{id}/stream with Last-Event-ID, on any API process) is sent exactly the events
after the ones it had.

Usage as Anthropic counts it: `input_tokens` are the prompt's tokens not read from the prefix cache,
`cache_read_input_tokens` those read from it (their sum is the prompt, what count_tokens answers);
`cache_creation_input_tokens` is 0 (caching costs nothing extra here).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import orjson

from services.api.answer.formats import Counts, Format, Head
from services.api.answer.parsers import AnswerParser
from services.api.errors import anthropic_error
from shared.messages import ReplyEvent
from shared.request_states import Finish

STOP_REASONS = {Finish.STOP: "end_turn", Finish.LENGTH: "max_tokens"}
DELTA_FIELDS = {"text_delta": "text", "thinking_delta": "thinking"}


def message_usage(prompt: int, cached: int, output: int) -> dict[str, int]:
    return {"input_tokens": prompt - cached, "output_tokens": output, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached}


def coalesced(events: list[dict]) -> list[dict]:
    """Consecutive text (or thinking) deltas of one block as one event: the API's cost follows its events."""
    out: list[dict] = []
    for ev in events:
        last = out[-1] if out else None
        kind = ev.get("delta", {}).get("type") if ev["type"] == "content_block_delta" else None
        if kind in DELTA_FIELDS and last is not None and last["type"] == "content_block_delta" and \
                last["index"] == ev["index"] and last["delta"]["type"] == kind:
            field = DELTA_FIELDS[kind]
            last["delta"] = {"type": kind, field: last["delta"][field] + ev["delta"][field]}
            continue
        out.append(ev)
    return out


class MessageFormat(Format):
    """`parse`: how answers are split (reasoning, tool calls), as for chat; `shows_thinking`: the request asked
    for thinking (else the reasoning of a model that reasons anyway is not shown)."""

    named_events = True  # `event: message_start` ...
    sends_done = False  # no `data: [DONE]`: message_stop ends it

    def __init__(self, uid: str, model: str, created: int, parse: dict | None = None, shows_thinking: bool = False):
        super().__init__(Head(f"msg_{uid}", model, created, 1))
        self.uid, self.parse, self.shows_thinking = uid, parse or {}, shows_thinking
        self.parser = AnswerParser(bool(self.parse.get("reasoning")), self.parse.get("tools"))
        self.blocks: list[dict[str, Any]] = []
        self.open_kind: str | None = None  # the text or thinking block being streamed
        self.pending: list[dict] = []
        self.started = False
        self.finish: str | None = None
        self.stop_sequence: str | None = None  # the stop sequence that ended it
        self.prompt_tokens = self.cached_tokens = 0

    def record_fields(self) -> dict:
        return {"rid": self.rid, "created": self.created, "thinking": int(self.shows_thinking)}

    def thinking_opened(self, index: int) -> None:
        self.parser.open_thinking()

    # -- events ----------------------------------------------------------------------------------------------
    def chunks(self, events: list[ReplyEvent], counts: Counts | None) -> list[dict]:
        self.note_prompts(events)
        for ev in events:
            if not self.started:
                self._start(ev.prompt_tokens, ev.cached_tokens)
            self._feed(ev)
        out, self.pending = coalesced(self.pending), []
        return out

    def _start(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.started = True
        self.prompt_tokens, self.cached_tokens = prompt_tokens, cached_tokens
        start = self.message(None, message_usage(prompt_tokens, cached_tokens, 0), [])
        self.pending += [{"type": "message_start", "message": start}, {"type": "ping"}]

    def _feed(self, ev: ReplyEvent) -> None:
        final = ev.finish_reason is not None
        parsed = self.parser.feed(ev.text, final=final)
        if parsed.reasoning and self.shows_thinking:
            self._text("thinking", parsed.reasoning)
        if parsed.content:
            self._text("text", parsed.content)
        for call in parsed.tool_calls:
            self._tool_use(call["function"]["name"], call["function"]["arguments"])
        if final:
            self.finish, self.stop_sequence = ev.finish_reason, ev.stop_sequence
            self._close()

    def _text(self, kind: str, text: str) -> None:
        if self.open_kind != kind:
            self._close()
            block = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "",
                                                                          "signature": ""}
            self.blocks.append(block)
            self.pending.append({"type": "content_block_start", "index": len(self.blocks) - 1,
                                 "content_block": copy.copy(block)})
            self.open_kind = kind
        self.blocks[-1][kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        self.pending.append({"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta})

    def _close(self) -> None:
        if self.open_kind is not None:
            self.pending.append({"type": "content_block_stop", "index": len(self.blocks) - 1})
            self.open_kind = None

    def _tool_use(self, name: str, arguments: str) -> None:
        self._close()
        at = len(self.blocks)
        try:
            args = json.loads(arguments or "{}")
        except ValueError:  # the parser passes only JSON; kept whole if a template's parser ever does not
            args = {"arguments": arguments}
        block = {"type": "tool_use", "id": f"toolu_{self.uid}_{at}", "name": name,
                 "input": args if isinstance(args, dict) else {"value": args}}
        self.blocks.append(block)
        delta = {"type": "input_json_delta", "partial_json": orjson.dumps(block["input"]).decode()}
        self.pending += [{"type": "content_block_start", "index": at, "content_block": {**block, "input": {}}},
                         {"type": "content_block_delta", "index": at, "delta": delta},
                         {"type": "content_block_stop", "index": at}]

    # -- the end ---------------------------------------------------------------------------------------------
    def stop_reason(self) -> str | None:
        if self.finish == Finish.STOP and any(b["type"] == "tool_use" for b in self.blocks):
            return "tool_use"
        if self.finish == Finish.STOP and self.stop_sequence is not None:
            return "stop_sequence"
        return STOP_REASONS.get(self.finish or "")

    def matched(self, stop_reason: str | None) -> str | None:
        return self.stop_sequence if stop_reason == "stop_sequence" else None

    def usage_of(self, counts: Counts) -> dict[str, int]:
        return message_usage(counts.prompt_tokens, counts.cached_tokens, counts.completion_tokens)

    def closing_chunks(self, counts: Counts) -> list[dict]:
        if not self.started:
            self._start(counts.prompt_tokens, counts.cached_tokens)
        self._close()
        reason = self.stop_reason()
        delta = {"stop_reason": reason, "stop_sequence": self.matched(reason)}
        self.pending += [{"type": "message_delta", "delta": delta, "usage": self.usage_of(counts)},
                         {"type": "message_stop"}]
        out, self.pending = self.pending, []
        return out

    def failure_chunks(self, error: dict) -> list[dict]:
        return [anthropic_error(error.get("error", error))]

    def add(self, events: list[ReplyEvent]) -> None:
        self.chunks(events, None)

    def response(self, counts: Counts) -> dict:
        self._close()
        self.pending = []
        return self.message(self.stop_reason(), self.usage_of(counts))

    def message(self, stop_reason: str | None, usage: dict[str, int], content: list | None = None) -> dict[str, Any]:
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.model,
                "content": copy.deepcopy(self.blocks) if content is None else content, "stop_reason": stop_reason,
                "stop_sequence": self.matched(stop_reason), "usage": usage}


def message_format_of_record(record: dict, uid: str) -> MessageFormat:
    """The format of a message submitted elsewhere, from its record (reattach)."""
    model = record.get("adapter") or record.get("model", "")
    return MessageFormat(uid, model, int(record.get("created", 0)), orjson.loads(record.get("parse") or "{}"),
                         bool(int(record.get("thinking", 0))))
