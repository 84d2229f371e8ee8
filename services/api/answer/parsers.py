"""A chat answer's text -> reasoning, content and tool calls, streamed: text arrives in pieces cut
anywhere (the detokenizer sends ranges as they decode), so each parser holds back a tail that could
still become a marker (`<think>`, `</think>`, `<tool_call>`) and releases it once it cannot.

Formats (services/tokenizer/tools.py says which a model uses): reasoning `qwen3` (`<think>...</think>`
at the start of the answer); tool calls `hermes` (`<tool_call>{"name", "arguments"}</tool_call>` blocks,
content around them kept) and `llama3_json` (an answer that is `{"name", "parameters"}` objects, optionally
after `<|python_tag|>`, separated by ";").
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass
class Parsed:
    """What one piece of text turned into."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __iadd__(self, other: Parsed) -> Parsed:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """OpenAI's tool-call object; arguments as JSON text."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


class ReasoningParser:
    """`<think>` at the start of the answer opens the reasoning, `</think>` ends it; anything else is
    content from the first character. A prompt that opened `<think>` itself (a template that makes the model
    think, Qwen3-Thinking's or DeepSeek-R1's) makes the answer reasoning from its first character: `opened`."""

    def __init__(self, opened: bool = False) -> None:
        self.state = "thinking" if opened else "start"  # start -> thinking -> after -> content, or -> content
        self.buf = ""

    def open(self) -> None:
        """The prompt opened the thinking (said with the answer's first text, before it is fed)."""
        if self.state == "start" and not self.buf:
            self.state = "thinking"

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) releasable after `text`; `final`: the answer ends with it, nothing is held."""
        reasoning, content = self._feed(text)
        if final:  # what is still held is whatever the state it stands in makes it
            rest, self.buf = self.buf, ""
            if self.state == "thinking":
                reasoning += rest
            else:
                content += rest
        return reasoning, content

    def _feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(THINK_OPEN):
                self.state, self.buf = "thinking", head[len(THINK_OPEN):]
            elif THINK_OPEN.startswith(head):
                return "", ""  # could still open the reasoning
            else:
                self.state = "content"
        if self.state == "thinking":
            at = self.buf.find(THINK_CLOSE)
            if at < 0:
                keep = _partial_suffix(self.buf, THINK_CLOSE)
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return reasoning, ""
            reasoning, self.buf = self.buf[:at], self.buf[at + len(THINK_CLOSE):]
            self.state = "after"
        if self.state == "after":  # the newlines between the reasoning and the answer belong to neither
            self.buf = self.buf.lstrip("\n")
            if not self.buf:
                return reasoning, ""
            self.state = "content"
        if self.state == "content":
            content, self.buf = self.buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        return self.feed("", final=True)


class HermesToolParser:
    """Content outside `<tool_call>` blocks stays content; each block whose JSON has a `name` becomes a
    call (a block that does not parse stays content, as vLLM keeps it)."""

    def __init__(self) -> None:
        self.buf = ""
        self.inside = self.after_call = False

    def feed(self, text: str) -> Parsed:
        self.buf += text
        out = Parsed()
        while True:
            if self.after_call:  # the newline after a call belongs to the call
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    return out
                self.after_call = False
            if not self.inside:
                at = self.buf.find(CALL_OPEN)
                if at < 0:
                    keep = _partial_suffix(self.buf, CALL_OPEN)
                    out.content += self.buf[:len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                out.content += self.buf[:at]
                self.buf, self.inside = self.buf[at:], True
            at = self.buf.find(CALL_CLOSE)
            if at < 0:
                return out
            block, self.buf = self.buf[:at + len(CALL_CLOSE)], self.buf[at + len(CALL_CLOSE):]
            self.inside = False
            call = _hermes_call(block)
            if call is None:
                out.content += block
            else:
                out.tool_calls.append(call)
                self.after_call = True

    def finish(self) -> Parsed:
        """What is held: a partial `<tool_call>` marker is content; a call that never closed (the answer was
        cut by max_tokens, its finish reason says so) is dropped, never shown as content."""
        rest, inside, self.buf, self.inside = self.buf, self.inside, "", False
        return Parsed(content="" if inside else rest)


def _hermes_call(block: str) -> dict[str, Any] | None:
    body = block[len(CALL_OPEN):-len(CALL_CLOSE)].strip()
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return tool_call(obj["name"], obj.get("arguments", obj.get("parameters", {})))


class Llama3JsonToolParser:
    """An answer that starts with `{` (or `<|python_tag|>`) is held until it ends, then read as calls;
    if it is not calls after all, it is released as content."""

    def __init__(self) -> None:
        self.buf = ""
        self.mode = "start"  # start -> calls (held) or content

    def feed(self, text: str) -> Parsed:
        self.buf += text
        if self.mode == "start":
            head = self.buf.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return Parsed()
            self.mode = "calls" if head.startswith(("{", PYTHON_TAG)) else "content"
        if self.mode == "content":
            content, self.buf = self.buf, ""
            return Parsed(content=content)
        return Parsed()

    def finish(self) -> Parsed:
        text, self.buf = self.buf, ""
        if self.mode == "calls":
            calls = _llama3_calls(text)
            if calls:
                return Parsed(tool_calls=calls)
        return Parsed(content=text)


def _llama3_calls(text: str) -> list[dict[str, Any]] | None:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    calls, decoder, at = [], json.JSONDecoder(), 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        calls.append(tool_call(obj["name"], obj.get("parameters", obj.get("arguments", {}))))
        at = end
        while at < len(body) and body[at] in " ;\n\t":
            at += 1
    return calls or None


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


class AnswerParser:
    """One choice's answer: reasoning first (if the model reasons), then tool calls in its content (if
    the request has tools)."""

    def __init__(self, reasoning: bool, tool_parser: str | None, opened: bool = False):
        """`opened`: the prompt opened the thinking (services/detokenizer/incremental.py `first_range`)."""
        self.reasoning = ReasoningParser(opened) if reasoning else None
        cls = TOOL_PARSERS.get(tool_parser or "")
        self.tools = cls() if cls else None
        self.calls = 0  # tool calls so far

    def feed(self, text: str, final: bool = False) -> Parsed:
        """What `text` releases; `final` (the answer ends with it): what is held too, as `finish` would."""
        return self._split(*(self.reasoning.feed(text, final) if self.reasoning else ("", text)), final=final)

    def finish(self) -> Parsed:
        return self.feed("", final=True)

    def open_thinking(self) -> None:
        """The prompt opened the thinking: the answer is reasoning until `</think>`."""
        if self.reasoning is not None:
            self.reasoning.open()

    def _split(self, reasoning: str, content: str, final: bool) -> Parsed:
        if self.tools is None:
            return Parsed(reasoning, content)
        out = Parsed(reasoning)
        out += self.tools.feed(content)
        if final:
            out += self.tools.finish()
        self.calls += len(out.tool_calls)
        return out

    def parse_all(self, text: str) -> Parsed:
        out = self.feed(text)
        out += self.finish()
        return out
