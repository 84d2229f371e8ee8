"""The one check of prompt, max_tokens and min_tokens against a context (and a KV cache): shared/context_limits.py."""

from __future__ import annotations

import pytest

from shared.context_limits import CONTEXT_LENGTH_EXCEEDED, LengthError, completion_limit


@pytest.mark.parametrize(("args", "param", "code", "words"), [
    ((64, None, 0, 64), None, CONTEXT_LENGTH_EXCEEDED, "your prompt has 64 tokens"),
    ((10, None, 0, 64, 10), None, CONTEXT_LENGTH_EXCEEDED, "does not fit the KV cache of 10 tokens"),
    ((10, None, 55, 64), "min_tokens", CONTEXT_LENGTH_EXCEEDED, "at least 65 tokens"),
    ((10, None, 31, 64, 40), "min_tokens", CONTEXT_LENGTH_EXCEEDED, "the 30 completion tokens that the KV cache"),
    ((10, 0, 0, 64), "max_tokens", None, "at least 1"),
    ((10, 55, 0, 64), "max_tokens", CONTEXT_LENGTH_EXCEEDED, "you requested 65 tokens"),
    ((10, 31, 0, 64, 40), "max_tokens", CONTEXT_LENGTH_EXCEEDED, "exceeds the KV cache of 40 tokens"),
    ((10, 4, 5, 64), "min_tokens", None, "min_tokens (5) must not exceed max_tokens (4)"),
])
def test_what_cannot_fit_is_refused_naming_its_field(args, param, code, words):
    with pytest.raises(LengthError) as e:
        completion_limit(*args)
    assert (e.value.param, e.value.code) == (param, code) and words in str(e.value)


def test_an_omitted_max_tokens_is_what_the_context_and_the_kv_cache_leave():
    assert completion_limit(10, None, 0, 64) == 54
    assert completion_limit(10, None, 30, 64, 40) == 30
    assert completion_limit(10, None, 0, 64, 1000) == 54
    assert completion_limit(10, 54, 54, 64) == 54 and completion_limit(10, 30, 0, 64, 40) == 30
