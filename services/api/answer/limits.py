"""What one request may ask of an API process and of the broker, checked at the HTTP edge before anything is
queued: each limit is a setting of shared/settings.py ApiSettings, and a request past one gets a 400 in
OpenAI's shape naming the field and the limit (the body and the head are bounded as they arrive, by
services/api/edge/app.py `Guard` and services/api/edge/http.py).

- nesting: the body's objects and lists nest at most `max_json_depth` deep (deeper ones crash encoders and
  templates further on);
- what the request record keeps for its TTL: OpenAI's limits on `user`, `safety_identifier` and `metadata`
  (`prompt_cache_key` as `user`);
- free text that travels with the job but is not the prompt: stop strings (UTF-8 bytes, each and together),
  `stop_token_ids`, `logit_bias`, a structured-output constraint, `tools`, `chat_template_kwargs`. Prompts and
  messages are bounded by the body limit and by the model's context: text of more bytes than the context's
  tokens can stand for is refused here (`fits_context`), before it is queued; the tokenizer refuses the rest;
- fan-out (services/api/answer/schemas/submission.py `Budget`): sequences (prompts x choices), completion tokens,
  logprob entries.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from services.api.answer.schemas.submission import Budget
from services.api.errors import ApiError
from shared.messages import ChatMessage, SamplingParams, TokenizeJob
from shared.settings import ApiSettings

VERBATIM_ROLES = ("user", "system", "tool")  # chat templates render these messages' text as it is (trimmed)


def fits_context(messages: list[ChatMessage] | None, prompt: str | None, model_info: dict, param: str) -> None:
    """A 400 for text that cannot fit the model's context, whatever it tokenizes to: a token stands for at most
    `max_token_bytes` bytes (the tokenizer's bound, in its model_info), and a prompt holds at least its text and
    the text of the messages a template renders as they are. Refused before anything of it is queued or stored,
    so a client cannot make Redis hold megabytes the tokenizer will refuse."""
    per_token, context = model_info.get("max_token_bytes"), model_info.get("max_model_len")
    if not per_token or not context:
        return
    most = per_token * context
    if prompt is not None and len(prompt) * 4 <= most and not messages:  # a character is at most 4 bytes
        return
    size = len(prompt.encode()) if prompt is not None else 0
    size += sum(len(m.content.strip().encode()) for m in messages or () if m.role in VERBATIM_ROLES)
    if size > most:
        raise ApiError(400, f"This model's maximum context length is {context} tokens; a prompt of {size} bytes of "
                       f"text cannot fit it (a token of this model stands for at most {per_token} bytes)",
                       param=param, code="context_length_exceeded")


def jobs_fit_context(jobs: list[TokenizeJob], model_info: dict, prompts_param: str) -> None:
    """`fits_context` for each job of a request (its messages, or its prompt)."""
    for job in jobs:
        fits_context(job.messages, job.prompt, model_info, "messages" if job.messages else prompts_param)


def too_large(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="request_too_large")


BRACKETS = bytes.maketrans(b"{}", b"[]")
NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def depth_over(raw: bytes, limit: int) -> bool:
    """Whether the objects and lists of valid JSON text nest deeper than `limit` (a container at the top is
    level 1). On the text, at C speed: a body of millions of token ids is not walked element by element, and
    a deep one not recursed into. Strings go first (escaped backslashes and quotes, then every other piece
    between quotes), then every byte but brackets."""
    outside = b"".join(raw.replace(b"\\\\", b"").replace(b'\\"', b"").split(b'"')[::2])
    brackets = outside.translate(BRACKETS, NOT_BRACKETS)
    if len(brackets) > 1 << 16:
        return _deepest(brackets) > limit
    for _ in range(limit):  # each pass takes away the innermost pairs: at most `limit` small scans
        if not brackets:
            return False
        brackets = brackets.replace(b"[]", b"")
    return bool(brackets)


def _deepest(brackets: bytes, chunk: int = 1 << 20) -> int:
    """The deepest level of balanced brackets, as the running sum of +1 per `[` and -1 per `]`; in chunks, so
    a 16 MiB body costs a few MB and tens of milliseconds (passes as above would cost seconds there)."""
    import numpy as np  # only for large bodies: the API process need not load it otherwise

    deepest, level = 0, 0
    for at in range(0, len(brackets), chunk):
        steps = 92 - np.frombuffer(brackets, np.uint8, min(chunk, len(brackets) - at), at).astype(np.int32)
        running = np.cumsum(steps) + level
        deepest, level = max(deepest, int(running.max())), int(running[-1])
    return deepest


def value_depth_over(value: Any, limit: int) -> bool:
    try:
        return depth_over(orjson.dumps(value), limit)
    except TypeError:  # orjson writes at most 255 levels
        return True


def compact_len(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def omitted_max_tokens(default: int | None, context: int | None) -> int:
    """What a request without max_tokens may generate: the model's default (its tokenizer's default_max_tokens,
    services/tokenizer/encode.py) within its context, else its context; 0 when neither is known."""
    default, context = int(default or 0), int(context or 0)
    return min(default, context) if default and context else default or context


class Limits:
    def __init__(self, settings: ApiSettings):
        self.s = settings

    # -- the body ---------------------------------------------------------------------------------------
    def nesting(self, raw: bytes, body: dict) -> None:
        """`raw`: the body's text; `body`: what it parsed to (an object), whose field is named if too deep."""
        limit = self.s.max_json_depth
        if not depth_over(raw, limit):
            return
        key = next((k for k, v in body.items() if value_depth_over(v, limit - 1)), None)
        raise ApiError(400, f"`{key}` nests objects and lists more than {limit} deep (--max-json-depth)",
                       param=key, code="nesting_too_deep")

    # -- what the request record keeps ------------------------------------------------------------------
    def record_fields(self, user: str | None, safety_identifier: str | None = None,
                      metadata: dict[str, str] | None = None, prompt_cache_key: str | None = None) -> None:
        s = self.s
        for name, value in (("user", user), ("safety_identifier", safety_identifier),
                            ("prompt_cache_key", prompt_cache_key)):
            if value is not None and len(value) > s.max_user_chars:
                raise too_large(name, f"`{name}` is {len(value)} characters; at most {s.max_user_chars} "
                                "(--max-user-chars)")
        if not metadata:
            return
        if len(metadata) > s.max_metadata_pairs:
            raise too_large("metadata", f"`metadata` has {len(metadata)} pairs; at most {s.max_metadata_pairs} "
                            "(--max-metadata-pairs)")
        for key, value in metadata.items():
            if len(key) > s.max_metadata_key_chars:
                raise too_large("metadata", f"a `metadata` key is {len(key)} characters; at most "
                                f"{s.max_metadata_key_chars} (--max-metadata-key-chars)")
            if len(value) > s.max_metadata_value_chars:
                raise too_large("metadata", f"`metadata.{key[:64]}` is {len(value)} characters; at most "
                                f"{s.max_metadata_value_chars} (--max-metadata-value-chars)")

    # -- what travels with the job besides the prompt ---------------------------------------------------
    def sampling(self, params: SamplingParams, prefix: str = "") -> None:
        """Stop strings, stop token ids, logit bias and the structured-output constraint; `prefix` is where the
        fields sit in the request (`sampling_params.` in /generate)."""
        s = self.s
        sizes = [len(stop.encode()) for stop in params.stop]
        if sizes and max(sizes) > s.max_stop_bytes:
            raise too_large(f"{prefix}stop", f"a stop string is {max(sizes)} bytes (UTF-8); at most "
                            f"{s.max_stop_bytes} (--max-stop-bytes)")
        if sum(sizes) > s.max_stop_total_bytes:
            raise too_large(f"{prefix}stop", f"the stop strings are {sum(sizes)} bytes (UTF-8) together; at "
                            f"most {s.max_stop_total_bytes} (--max-stop-total-bytes)")
        if len(params.stop_token_ids) > s.max_stop_token_ids:
            raise too_large(f"{prefix}stop_token_ids", f"{len(params.stop_token_ids)} stop_token_ids; at most "
                            f"{s.max_stop_token_ids} (--max-stop-token-ids)")
        if len(params.logit_bias) > s.max_logit_bias:
            raise too_large(f"{prefix}logit_bias", f"{len(params.logit_bias)} logit_bias entries; at most "
                            f"{s.max_logit_bias} (--max-logit-bias)")
        guided = params.guided
        if guided is not None and len(guided.spec.encode()) > s.max_constraint_bytes:
            name = guided.param or "constraint"
            raise too_large(f"{prefix}{name}", f"`{name}` is {len(guided.spec.encode())} bytes (schemas as compact "
                            f"JSON); at most {s.max_constraint_bytes} (--max-constraint-bytes)")

    def response_items(self, items: int) -> None:
        """A response's conversation: its input and that of its previous_response_id."""
        if items > self.s.max_response_items:
            raise too_large("input", f"the conversation has {items} items (with previous_response_id's); at most "
                            f"{self.s.max_response_items} (--max-response-items)")

    def chat_fields(self, tools: list[dict] | None, chat_template_kwargs: dict | None) -> None:
        s = self.s
        if tools:
            if len(tools) > s.max_tools:
                raise too_large("tools", f"{len(tools)} tools; at most {s.max_tools} (--max-tools)")
            size = compact_len(tools)
            if size > s.max_tools_bytes:
                raise too_large("tools", f"`tools` is {size} bytes as compact JSON; at most {s.max_tools_bytes} "
                                "(--max-tools-bytes)")
        if chat_template_kwargs:
            size = compact_len(chat_template_kwargs)
            if size > s.max_template_kwargs_bytes:
                raise too_large("chat_template_kwargs", f"`chat_template_kwargs` is {size} bytes as compact JSON; "
                                f"at most {s.max_template_kwargs_bytes} (--max-template-kwargs-bytes)")

    # -- fan-out ----------------------------------------------------------------------------------------
    def fan_out(self, b: Budget, context: int | None, default: int | None = None) -> None:
        """`default`: the model's budget for a request without max_tokens (its tokenizer's default_max_tokens)."""
        s = self.s
        sequences = b.prompts * b.choices
        if sequences > s.max_request_sequences:
            param = b.choices_param if b.choices > 1 else b.prompts_param
            raise too_large(param, f"this request runs {sequences} sequences ({b.prompts} prompts x {b.choices} "
                            f"choices); at most {s.max_request_sequences} (--max-request-sequences)")
        if b.max_tokens is not None:
            per, why = (min(b.max_tokens, context) if context else b.max_tokens), ""
        elif default or context:
            per = omitted_max_tokens(default, context)
            why = f", the model's {'default' if default else 'context'}, as `{b.tokens_param}` is not given"
        else:
            per, why = s.max_request_tokens, (f", the whole budget, as `{b.tokens_param}` is not given and the "
                                              "model's context is not known yet")
        tokens = sequences * per
        if tokens > s.max_request_tokens:
            raise too_large(b.tokens_param, f"this request may generate {tokens} tokens ({sequences} sequences x "
                            f"{per}{why}); at most {s.max_request_tokens} per request (--max-request-tokens): "
                            f"give a smaller `{b.tokens_param}` or fewer choices")
        if b.logprobs is None:
            return
        echoed = b.choices * sum(min(p, context) if context else p for p in b.echo_prompt_tokens)
        entries = (tokens + echoed) * (1 + b.logprobs)
        if entries > s.max_request_logprobs:
            raise too_large(b.logprobs_param, f"this request may return {entries} logprob entries ({tokens} tokens"
                            f"{f' and {echoed} echoed prompt tokens' if echoed else ''} x (1 + {b.logprobs} top "
                            f"logprobs)); at most {s.max_request_logprobs} per request (--max-request-logprobs)")
