"""A response's items (services/api/responses_api/response_schemas.py): the input items a client sends, normalized
and checked, and the chat messages they stand for.

Every item type of OpenAI's ResponseInputItemParam the server can honour: messages (a user's, a system or
developer's, an assistant's earlier answer with `output_text` or `refusal` parts), `reasoning` (its
`encrypted_content` opened with the server's key, services/api/responses_api/sealing.py, else its `content`
text; it becomes the next assistant message's `reasoning_content`, which templates that render earlier
reasoning (Qwen3's) show and others ignore), `function_call` / `function_call_output` and `custom_tool_call` /
`custom_tool_call_output` (a custom tool is a function of one string argument, `input`, to the template).
Items of hosted tools (web search, file search, computer use, MCP, shell...), `item_reference` and non-text
content parts are refused, naming the item. Fields an item may carry that change nothing here (`id`,
`status`, `annotations`, `logprobs`) are ignored.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from services.api.errors import BadRequest
from shared.messages import ChatMessage

TEXT_PARTS = ("input_text", "output_text", "text")
CALLS = ("function_call", "custom_tool_call")
OUTPUTS = ("function_call_output", "custom_tool_call_output")
SUPPORTED = "message, reasoning, function_call, function_call_output, custom_tool_call, custom_tool_call_output"

Opener = Callable[[str, str], str]  # (encrypted_content, its field) -> the reasoning text, or a 400


def checked_item(item: dict[str, Any], where: str, opener: Opener | None = None) -> dict[str, Any]:
    """One input item in OpenAI's shape, normalized (content as a list of text parts, a `type`); `where`: its
    place (`input[3]`), named in errors."""
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise BadRequest(f"{where}: a message's role is user, system, developer or assistant", "input")
        return {"type": "message", "role": role, "content": text_parts(item.get("content"), where)}
    if kind in CALLS:
        value = "arguments" if kind == "function_call" else "input"
        fields = {k: item.get(k) for k in ("call_id", "name", value)}
        if not all(isinstance(v, str) for v in fields.values()):
            raise BadRequest(f"{where}: a {kind} has string `call_id`, `name` and `{value}`", "input")
        return {"type": kind, **fields}
    if kind in OUTPUTS:
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise BadRequest(f"{where}: a {kind} has a string `call_id`", "input")
        return {"type": kind, "call_id": call_id, "output": output_text(item.get("output"), where, kind)}
    if kind == "reasoning":
        return reasoning_item(item, where, opener)
    raise BadRequest(f"{where}: item type {str(kind)[:40]!r} is not supported ({SUPPORTED})", "input")


def text_parts(content: Any, where: str) -> list[dict[str, str]]:
    if isinstance(content, str):
        return [{"type": "input_text", "text": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{where}: `content` is a string or a list of text parts", "input")
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "output_text", "text": part["refusal"]})
            continue
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise BadRequest(f"{where}: content part {str(kind)[:40]!r} is not supported: only text parts "
                             "(input_text, output_text, refusal)", "input")
        parts.append({"type": part["type"], "text": part["text"]})
    return parts


def output_text(output: Any, where: str, kind: str) -> str:
    """A tool's output: a string, or a list of text parts (their text together)."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "".join(p["text"] for p in text_parts(output, f"{where}.output"))
    raise BadRequest(f"{where}: a {kind}'s `output` is a string or a list of text parts", "input")


def reasoning_item(item: dict[str, Any], where: str, opener: Opener | None) -> dict[str, Any]:
    """A reasoning item's text: opened from `encrypted_content` (checked: a value the server did not seal is a
    400 naming it), else its `content` parts as given (the client's own, like an assistant message's); a
    summary alone is not the reasoning and is not shown to the model."""
    sealed, content = item.get("encrypted_content"), item.get("content")
    if sealed is not None:
        param = f"{where}.encrypted_content"
        if not isinstance(sealed, str) or opener is None:
            raise BadRequest(f"`{param}` is not reasoning this server sealed", param)
        text = opener(sealed, param)
    elif content is None:
        text = ""
    elif isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "reasoning_text"
                                           and isinstance(p.get("text"), str) for p in content):
        text = "".join(p["text"] for p in content)
    else:
        raise BadRequest(f"{where}: a reasoning item's `content` is a list of reasoning_text parts", "input")
    return {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def chat_messages(items: list[dict[str, Any]]) -> list[ChatMessage]:
    """Items -> chat messages: an assistant's text and the calls after it (consecutive) are one assistant message
    with its tool calls, and the reasoning before them its `reasoning_content`."""
    out: list[ChatMessage] = []
    reasoning = ""  # of the assistant message to come
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            reasoning += item["content"][0]["text"] if item["content"] else ""
            continue
        if kind == "message" and item["role"] == "assistant":
            text = "".join(p["text"] for p in item["content"])
            out.append(ChatMessage(role="assistant", content=text, reasoning_content=reasoning or None))
        elif kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            out.append(ChatMessage(role=role, content="".join(p["text"] for p in item["content"])))
        elif kind in OUTPUTS:
            out.append(ChatMessage(role="tool", content=item["output"], tool_call_id=item["call_id"]))
        else:
            out.append(_with_call(out[-1] if out else None, item, reasoning, out))
        reasoning = ""
    return out


def _with_call(last: ChatMessage | None, item: dict[str, Any], reasoning: str, out: list[ChatMessage]
               ) -> ChatMessage:
    """The assistant message that carries this call: the one just before it (then taken out of `out`), or a new
    one."""
    arguments = item["arguments"] if item["type"] == "function_call" else json.dumps({"input": item["input"]})
    call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}}
    if last is not None and last.role == "assistant" and not reasoning:
        out.pop()
        return ChatMessage(role="assistant", content=last.content, tool_calls=[*(last.tool_calls or []), call],
                           reasoning_content=last.reasoning_content)
    return ChatMessage(role="assistant", content="", tool_calls=[call], reasoning_content=reasoning or None)


def as_input(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the input items of the next turn."""
    items = []
    for item in output:
        if item["type"] == "message":
            items.append({"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": p["text"]} for p in item["content"]]})
        elif item["type"] in CALLS:
            value = "arguments" if item["type"] == "function_call" else "input"
            items.append({k: item[k] for k in ("type", "call_id", "name", value)})
        elif item["type"] == "reasoning":
            text = "".join(p["text"] for p in item.get("content") or [])
            items.append({"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]})
    return items
