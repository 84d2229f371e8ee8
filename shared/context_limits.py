"""Whether a request's prompt, max_tokens and min_tokens fit a context, in one function for the tokenizer (the
model's context) and every engine (its context, and the paged engine's KV cache too).
"""

from __future__ import annotations

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class LengthError(ValueError):
    """A request that cannot fit. `param` names the field at fault (None: the prompt, where the caller names none);
    `code` is "context_length_exceeded" when it is too long, None when a value is invalid whatever the context."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def completion_limit(prompt: int, max_tokens: int | None, min_tokens: int, context: int,
                     kv_tokens: int | None = None) -> int:
    """The completion tokens a request of `prompt` tokens may have in a context of `context` tokens (and a KV cache
    of `kv_tokens`, if given): its max_tokens, or for an omitted one (None) all that is left after the prompt.
    Raises LengthError if there is no room for a completion, or max_tokens or min_tokens does not fit."""
    if prompt >= context:
        raise LengthError(f"This model's maximum context length is {context} tokens. However, your prompt has "
                          f"{prompt} tokens.", code=CONTEXT_LENGTH_EXCEEDED)
    if kv_tokens is not None and prompt >= kv_tokens:
        raise LengthError(f"the prompt ({prompt} tokens) does not fit the KV cache of {kv_tokens} tokens with room "
                          "for a completion", code=CONTEXT_LENGTH_EXCEEDED)
    if max_tokens is None:
        return _room_for_min_tokens(prompt, min_tokens, context, kv_tokens)
    if max_tokens < 1:
        raise LengthError("max_tokens must be at least 1", "max_tokens")
    if prompt + max_tokens > context:
        raise LengthError(f"This model's maximum context length is {context} tokens. However, you requested "
                          f"{prompt + max_tokens} tokens ({prompt} in the prompt, {max_tokens} for the completion). "
                          "Please reduce the prompt or max_tokens.", "max_tokens", CONTEXT_LENGTH_EXCEEDED)
    if kv_tokens is not None and prompt + max_tokens > kv_tokens:
        raise LengthError(f"prompt plus max_tokens ({prompt + max_tokens} tokens) exceeds the KV cache of "
                          f"{kv_tokens} tokens", "max_tokens", CONTEXT_LENGTH_EXCEEDED)
    if min_tokens > max_tokens:
        raise LengthError(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")
    return max_tokens


def _room_for_min_tokens(prompt: int, min_tokens: int, context: int, kv_tokens: int | None) -> int:
    """An omitted max_tokens: what the context (and the KV cache) leave after the prompt, if min_tokens fits it."""
    if prompt + min_tokens > context:
        raise LengthError(f"This model's maximum context length is {context} tokens. However, you requested at "
                          f"least {prompt + min_tokens} tokens ({prompt} in the prompt, min_tokens {min_tokens}).",
                          "min_tokens", CONTEXT_LENGTH_EXCEEDED)
    if kv_tokens is not None and prompt + min_tokens > kv_tokens:
        raise LengthError(f"min_tokens ({min_tokens}) exceeds the {kv_tokens - prompt} completion tokens that the "
                          f"KV cache leaves after the prompt ({prompt} tokens)", "min_tokens", CONTEXT_LENGTH_EXCEEDED)
    return min(context, kv_tokens if kv_tokens is not None else context) - prompt
