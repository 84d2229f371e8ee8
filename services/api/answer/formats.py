"""Step 3 of a request's path (services/api/answer/service.py `ApiService.answer`): ordered reply events -> the
bodies sent, chat.completion(.chunk), text_completion, and SGLang's /generate (`GenerateFormat`).

A format is built from the request body (services/api/answer/schemas/submission.py `Submission`; on reattach, from its
record: `format_of_record`) and turns each batch of events into chunk dicts (`chunks`, `batch_chunks` with the events'
reply entry ids), or all of them into one response (`add`, then `response`). The usage comes from the request
as it answers (services/api/answer/request/ `counts`), given to each call that shows it.

Keys OpenAI's schema requires but allows to be null are sent as null (`logprobs`, `message.refusal`,
each chunk's `finish_reason` until the last). Events that arrive together are coalesced into one chunk
per choice: the API's cost follows the number of chunks it sends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from services.api.answer.parsers import AnswerParser, Parsed
from shared import streams
from shared.messages import ReplyEvent, TokenLogprob
from shared.request_states import Finish

TOOL_CALLS = "tool_calls"  # OpenAI's finish_reason for an answer that ends in tool calls (it is `Finish.STOP` here)


class Counts(Protocol):
    """Token counts of a request so far (shared/reply_order.py OrderedReplies, or a group's in request.py)."""

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def completion_tokens(self) -> int: ...

    @property
    def cached_tokens(self) -> int: ...


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _lp_chat(lps: list[TokenLogprob]) -> list[dict]:
    return [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes,
             "top_logprobs": [{"token": x.token, "logprob": x.logprob, "bytes": x.bytes} for x in t.top_logprobs]}
            for t in lps]


def _lp_text(lps: list[TokenLogprob], offset: int) -> dict:
    """Legacy completions logprobs; an echoed prompt's first token has neither logprob nor alternatives."""
    offsets, at = [], offset
    for t in lps:
        offsets.append(at)
        at += len(t.token)
    return {"tokens": [t.token for t in lps], "token_logprobs": [t.logprob for t in lps],
            "top_logprobs": [None if t.logprob is None else {x.token: x.logprob for x in t.top_logprobs}
                             for t in lps], "text_offset": offsets}


@dataclass
class Choice:
    """One choice's text so far (non-stream bodies and completion logprob offsets)."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    length: int = 0
    started: bool = False
    prompt: str = ""  # echo: the prompt's text, and its tokens' logprobs when asked
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    thinking: bool = False  # its prompt opened the thinking: the answer is reasoning until </think>


def group_by_choice(events: list[ReplyEvent]) -> dict[int, tuple[str, list[TokenLogprob], str | None]]:
    out: dict[int, tuple[str, list[TokenLogprob], str | None]] = {}
    for ev in events:
        text, lps, _ = out.get(ev.index, ("", [], None))
        out[ev.index] = (text + ev.text, lps + list(ev.logprobs or []), ev.finish_reason)
    return out


@dataclass(frozen=True, slots=True)
class Head:
    """What every format of a response is built with: its id, model and `created`, how many choices, and whether
    it shows logprobs and ends a stream with a usage chunk."""

    rid: str
    model: str
    created: int
    n: int
    logprobs: bool = False
    include_usage: bool = False


class Format:
    """Base: builds bodies for one request; subclasses say how a choice looks."""

    object_chunk = ""
    object_full = ""
    event_ids = True  # each SSE event names the last reply entry it covers (Last-Event-ID, reattach)
    named_events = False  # each SSE event says its `type` in an `event:` line (the Responses API's do)
    sends_done = True  # a stream ends with `data: [DONE]`

    def __init__(self, head: Head):
        self.rid, self.model, self.created = head.rid, head.model, head.created
        self.want_logprobs, self.include_usage = head.logprobs, head.include_usage
        self.continuous_usage = False  # every chunk carries the usage so far
        self.choices = [Choice() for _ in range(head.n)]

    def record_fields(self) -> dict:
        """What a reattaching process needs to build this format again (`format_of_record`)."""
        return {"rid": self.rid, "created": self.created, "include_usage": int(self.include_usage),
                "logprobs": int(self.want_logprobs)}

    def _usage(self, c: Counts) -> dict:
        return usage(c.prompt_tokens, c.completion_tokens, c.cached_tokens)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def note_prompts(self, events: list[ReplyEvent]) -> None:
        for ev in events:
            if ev.prompt_text is not None:
                c = self.choices[ev.index]
                c.prompt, c.prompt_logprobs = ev.prompt_text, list(ev.prompt_logprobs or [])
            if ev.thinking:
                self.choices[ev.index].thinking = True
                self.thinking_opened(ev.index)

    def thinking_opened(self, index: int) -> None:
        """Choice `index`'s prompt opened the thinking (said before its first text)."""

    def batch_chunks(self, batch: list[tuple[str, ReplyEvent]], counts: Counts, replay_until: str | None = None
                     ) -> tuple[list[dict], str | None]:
        """A batch of a stream: its chunks and the id its events carry (the last reply entry they cover, if this
        format names them). Entries up to `replay_until` (a reattach's Last-Event-ID) go into the format but
        make no chunk: the client has them."""
        if replay_until:
            self.chunks([ev for eid, ev in batch if not streams.id_after(eid, replay_until)], counts)
            batch = [(eid, ev) for eid, ev in batch if streams.id_after(eid, replay_until)]
        if not batch:
            return [], None
        return self.chunks([ev for _, ev in batch], counts), batch[-1][0] if self.event_ids else None

    def chunks(self, events: list[ReplyEvent], counts: Counts) -> list[dict]:
        self.note_prompts(events)
        out = []
        for index, (text, lps, finish) in sorted(group_by_choice(events).items()):
            c = self.choices[index]
            if not text and finish is None and c.started and not (lps and self.want_logprobs):
                continue  # nothing visible yet (bytes held back until a character completes)
            choice = self.chunk_choice(index, c, text, lps, finish)
            c.length += len(text)
            if choice is None:
                continue  # held back by a parser
            body = self._head(self.object_chunk)
            body["choices"] = [choice]
            if self.include_usage:
                body["usage"] = None
            if self.continuous_usage:  # vLLM's stream_options.continuous_usage_stats
                body["usage"] = self._usage(counts)
            c.started = True
            out.append(body)
        return out

    def closing_chunks(self, counts: Counts) -> list[dict]:
        """What a stream sends after its last batch: the usage, when asked."""
        return [self.usage_chunk(counts)] if self.include_usage else []

    def failure_chunks(self, error: dict) -> list[dict]:
        """What a stream that ended early sends: the error's body (services/api/errors.py)."""
        return [error]

    async def settle(self) -> None:
        """Once a stream sent its last event (the Responses API stores its final object here)."""

    def usage_chunk(self, counts: Counts) -> dict:
        body = self._head(self.object_chunk)
        body["choices"] = []
        body["usage"] = self._usage(counts)
        return body

    def add(self, events: list[ReplyEvent]) -> None:
        self.note_prompts(events)
        for ev in events:
            c = self.choices[ev.index]
            c.text.append(ev.text)
            c.logprobs.extend(ev.logprobs or [])
            c.finish_reason = ev.finish_reason or c.finish_reason

    def response(self, counts: Counts) -> dict:
        body = self._head(self.object_full)
        body["choices"] = [self.full_choice(i, c) for i, c in enumerate(self.choices)]
        body["usage"] = self._usage(counts)
        return body

    def chunk_choice(self, index: int, c: Choice, text: str, lps: list[TokenLogprob], finish: str | None
                     ) -> dict | None:
        raise NotImplementedError

    def full_choice(self, index: int, c: Choice) -> dict:
        raise NotImplementedError


class ChatFormat(Format):
    """`parse` ({"reasoning": format, "tools": format}, services/api/answer/schemas/chat.py `answer_parsing`) splits
    each answer into `reasoning_content`, `content` and `tool_calls` (services/api/answer/parsers.py)."""

    object_chunk = "chat.completion.chunk"
    object_full = "chat.completion"

    def __init__(self, head: Head, parse: dict | None = None):
        super().__init__(head)
        self.parse = parse or {}
        self.parsers = [self._parser() for _ in range(head.n)] if self.parse else None
        self.calls = [0] * head.n

    def _parser(self, opened: bool = False) -> AnswerParser:
        return AnswerParser(bool(self.parse.get("reasoning")), self.parse.get("tools"), opened)

    def thinking_opened(self, index: int) -> None:
        if self.parsers is not None:
            self.parsers[index].open_thinking()

    def chunk_choice(self, index, c, text, lps, finish):
        parsed = Parsed(content=text)
        if self.parsers is not None:  # the last piece of a choice releases what its parser held back
            parsed = self.parsers[index].feed(text, final=finish is not None)
        delta: dict[str, Any] = {"role": "assistant", "content": parsed.content} if not c.started else {}
        if parsed.content:
            delta["content"] = parsed.content
        if parsed.reasoning:
            delta["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            delta["tool_calls"] = [{"index": self.calls[index] + k, **call} for k, call in enumerate(parsed.tool_calls)]
            self.calls[index] += len(parsed.tool_calls)
        if c.started and len(delta) == 0 and finish is None and not lps:
            return None
        if lps and not delta.keys() & {"content", "reasoning_content", "tool_calls"}:
            delta["content"] = ""  # a token whose text is held back (part of a character) still has its logprobs
        logprobs = {"content": _lp_chat(lps), "refusal": None} if self.want_logprobs and lps else None
        finish = TOOL_CALLS if finish == Finish.STOP and self.calls[index] else finish
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def full_choice(self, index, c):
        logprobs = {"content": _lp_chat(c.logprobs), "refusal": None} if self.want_logprobs else None
        text, finish = "".join(c.text), c.finish_reason
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if self.parse:
            parsed = self._parser(c.thinking).parse_all(text)
            calls = parsed.tool_calls
            message["content"] = None if calls and not parsed.content.strip() else parsed.content
            if self.parse.get("reasoning"):
                message["reasoning_content"] = parsed.reasoning or None
            if calls:
                message["tool_calls"] = calls
                finish = TOOL_CALLS if finish == Finish.STOP else finish
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


class CompletionFormat(Format):
    """`echo`: each choice starts with its prompt (and its tokens' logprobs). `best_of`: of every `best_of`
    consecutive choices (one prompt's), the `n` with the highest cumulative logprob are returned."""

    object_chunk = "text_completion"
    object_full = "text_completion"

    def __init__(self, head: Head, echo: bool = False, best_of: int | None = None, keep: int | None = None):
        super().__init__(head)
        self.echo, self.best_of, self.keep = echo, best_of, keep

    def chunk_choice(self, index, c, text, lps, finish):
        offset = c.length  # text_offset counts from the start of the choice's text, echoed prompt included
        if self.echo and not c.started:
            text, lps = c.prompt + text, c.prompt_logprobs + lps
            c.length += len(c.prompt)
        logprobs = _lp_text(lps, offset) if self.want_logprobs else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def full_choice(self, index, c):
        text, lps = "".join(c.text), c.logprobs
        if self.echo:
            text, lps = c.prompt + text, c.prompt_logprobs + lps
        logprobs = _lp_text(lps, 0) if self.want_logprobs else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}

    def response(self, counts: Counts) -> dict:
        if self.best_of and self.keep and self.best_of > self.keep:
            self.choices = self._best()
        return super().response(counts)

    def _best(self) -> list[Choice]:
        out = []
        for at in range(0, len(self.choices), self.best_of or 1):
            group = self.choices[at:at + (self.best_of or 1)]
            ranked = sorted(group, key=lambda c: -sum(t.logprob or 0.0 for t in c.logprobs))
            out += ranked[:self.keep]
        return out


class GenerateFormat(Format):
    """SGLang's /generate shape: text, output_ids and meta_info; a stream sends the whole body so far with
    every batch, without event ids. One choice (GenerateRequest, services/api/answer/schemas/completions.py, refuses `n`
    above 1)."""

    event_ids = False

    def __init__(self, uid: str, model: str, created: int):
        super().__init__(Head(uid, model, created, 1))
        self.choice, self.ids = self.choices[0], []

    def record_fields(self) -> dict:
        return {"n": 1}

    def add(self, events: list[ReplyEvent]) -> None:
        for ev in events:
            self.choice.text.append(ev.text)
            self.ids.extend(ev.ids)
            self.choice.finish_reason = ev.finish_reason or self.choice.finish_reason

    def chunks(self, events: list[ReplyEvent], counts: Counts) -> list[dict]:
        self.add(events)
        return [self.response(counts)]

    def response(self, counts: Counts) -> dict:
        c = self.choice
        return {"text": "".join(c.text), "output_ids": self.ids,
                "meta_info": {"id": self.rid, "finish_reason": {"type": c.finish_reason} if c.finish_reason else None,
                              "prompt_tokens": counts.prompt_tokens, "completion_tokens": len(self.ids)}}


def format_of_record(record: dict, uid: str) -> Format:
    """The format of a request submitted elsewhere, from its record (what `record_fields` wrote): reattach."""
    model = record.get("adapter") or record.get("model", "")  # a LoRA adapter answers under its own name
    head = Head(record.get("rid", uid), model, int(record.get("created", 0)), int(record.get("n", 1)),
                bool(int(record.get("logprobs", 0))), bool(int(record.get("include_usage", 0))))
    if record.get("kind") in ("chat", "response"):  # a response's events as chat chunks (GET /v1/responses
        # streams it again in its own shape, services/api/responses_api/responses.py)
        return ChatFormat(head, orjson.loads(record.get("parse") or "{}"))
    return CompletionFormat(head, echo=record.get("echo") == "1")
