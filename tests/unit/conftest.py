"""What the unit tests of several stages share: tokenizers that take seconds to build, built once per process."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def qwen_tok():
    """The real Qwen vocabulary (~150k tokens) as shared/demo_model.py gives the qwen3-0.6b shape: its markup tokens
    and ChatML template. Read-only: ~2.5 s of CPU to convert, so made once."""
    from shared.demo_model import CHATML_TEMPLATE, MARKUP_TOKENS, _qwen_tokenizer

    tok = _qwen_tokenizer()
    tok.add_tokens(MARKUP_TOKENS)
    tok.chat_template = CHATML_TEMPLATE
    return tok
