"""Tool calls and reasoning, as far as the tokenizer stage sees them: which formats a model's chat template
speaks (named in the heartbeat's model_info, so the API parses answers with the same), the grammar that
enforces tool_choice "required" or a named function, and where a reasoning model's answer starts.

Formats: `hermes` (Qwen2.5/Qwen3, Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) and
`llama3_json` (Llama 3.x: `{"name": ..., "parameters": {...}}`, calls separated by "; "). Reasoning:
`qwen3` (`<think>...</think>` before the answer).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import msgspec

from shared.grammars import JSON_OPTIONS
from shared.messages import Guided, TokenizeJob, ToolChoice

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def tool_parser_for(template: str, setting: str) -> str:
    """The tool-call format: the setting, or (auto) the one the chat template writes."""
    if setting != "auto":
        return setting
    if HERMES_OPEN in template:
        return "hermes"
    if "<|python_tag|>" in template or '"parameters": ' in template:
        return "llama3_json"
    return "none"


def reasoning_parser_for(template: str, setting: str) -> str:
    if setting != "auto":
        return setting
    return "qwen3" if THINK_OPEN in template and THINK_CLOSE in template else "none"


def _lark_literal(text: str) -> str:
    return json.dumps(text)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """The tool's parameter schema, with the compact JSON layout every constraint uses."""
    params = tool.get("function", {}).get("parameters")
    params = params if isinstance(params, dict) and params else {"type": "object"}
    return {**params, "x-guidance": JSON_OPTIONS}


def tool_grammar(tools: list[dict[str, Any]], choice: ToolChoice, parser: str, marker_tokens: bool = False
                 ) -> Guided:
    """A grammar whose every answer is one call (a named function, or parallel off) or several calls of
    the given tools, in the model's format, with arguments valid against each tool's parameters.
    `marker_tokens`: `<tool_call>` and `</tool_call>` are single tokens the model writes (Qwen): the
    grammar names those tokens (llguidance reads such added tokens only as tokens, not as text)."""
    fns = [t for t in tools if choice.mode != "function" or t.get("function", {}).get("name") == choice.name]
    if parser == "hermes" and marker_tokens:
        head = HERMES_OPEN + " " + _lark_literal("\n")
        tail = _lark_literal("}\n") + " " + HERMES_CLOSE
        key, sep = "arguments", "\n"
    elif parser == "hermes":
        head, tail = _lark_literal(HERMES_OPEN + "\n"), _lark_literal("}\n" + HERMES_CLOSE)
        key, sep = "arguments", "\n"
    else:
        head, tail, key, sep = "", _lark_literal("}"), "parameters", "; "
    rules = []
    for i, tool in enumerate(fns):
        name = tool["function"]["name"]
        begin = _lark_literal(f'{{"name": {json.dumps(name)}, "{key}": ')
        rules.append(f"call_{i}: {head} {begin} args_{i} {tail}")
        rules.append(f"args_{i}: %json {json.dumps(_parameters(tool))}")
    calls = " | ".join(f"call_{i}" for i in range(len(fns)))
    repeat = choice.parallel and choice.mode == "required"
    start = f"start: call ({_lark_literal(sep)} call)*" if repeat else "start: call"
    lark = "\n".join([start, f"call: {calls}", *rules])
    return Guided("lark", lark, param="tool_choice")


def check_tools(job: TokenizeJob, parser: str) -> str | None:
    """Why these tools cannot be used with this model (None if they can)."""
    choice = job.tool_choice or ToolChoice()
    if not job.tools or choice.mode in ("auto", "none"):
        return None
    if parser == "none":
        return ("this model's chat template has no tool-call format the server knows; start the tokenizer "
                "with --tool-call-parser")
    names = [t.get("function", {}).get("name") for t in job.tools]
    if choice.mode == "function" and choice.name not in names:
        return f"tool_choice names `{choice.name}`, which is not among the tools"
    return None


def with_tool_grammar(job: TokenizeJob, parser: str, marker_tokens: bool = False) -> TokenizeJob:
    """tool_choice "required" or a named function: the answer is constrained to tool calls."""
    choice = job.tool_choice
    if not job.tools or choice is None or choice.mode not in ("required", "function"):
        return job
    params = msgspec.structs.replace(job.params, guided=tool_grammar(job.tools, choice, parser, marker_tokens))
    return msgspec.structs.replace(job, params=params)


def reasoning_window(guided: Guided, rendered: str, think: int, close: list[int]) -> Guided:
    """A response_format or tool grammar of a reasoning model applies after its thinking: from the start
    if the prompt closed the thinking, after `</think>` if the prompt opened it, and otherwise the model
    decides with its first token (`think` or the answer)."""
    tail = rendered.rstrip()
    if tail.endswith(THINK_CLOSE) or not close:
        return guided
    if tail.endswith(THINK_OPEN):
        return msgspec.structs.replace(guided, after=close)
    return msgspec.structs.replace(guided, after=close, think=think)


def template_messages(job: TokenizeJob) -> list[dict[str, Any]]:
    """The job's messages as the chat template reads them: assistant tool calls with their arguments as
    objects (templates write them with `tojson`), as vLLM passes them."""
    out = []
    for m in job.messages or []:
        msg = {k: v for k, v in msgspec.structs.asdict(m).items() if v is not None}
        if m.tool_calls:
            msg["tool_calls"] = [_call_for_template(c) for c in m.tool_calls]
        out.append(msg)
    return out


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        with contextlib.suppress(ValueError):  # text that is not JSON reaches the template as it is
            fn["arguments"] = json.loads(fn["arguments"])
    return {**call, "function": fn}
