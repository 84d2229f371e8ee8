"""Structured-output constraints as llguidance grammars: built here for every stage (the tokenizer checks
them, the engine compiles them; services/scheduler/engine/grammar.py says why llguidance)."""

from __future__ import annotations

import functools
import threading
from typing import Any

from shared.lru import ByteLRU
from shared.messages import Guided

# Compact JSON (no free whitespace between tokens): what OpenAI returns, and a model that has not learnt
# JSON cannot pad its answer with whitespace until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(guided: Guided) -> str:
    """The llguidance grammar of a constraint; raises ValueError for one that cannot even be read."""
    from llguidance import LLMatcher, grammar_from

    kind, spec = guided.kind, guided.spec
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)  # type: ignore
    if kind in ("regex", "lark", "choice"):
        return grammar_from(kind, spec)  # type: ignore[arg-type]
    if kind == "ebnf":  # GBNF (llama.cpp, SGLang's `ebnf`) or Lark
        return grammar_from("ebnf", spec)
    raise ValueError(f"unknown constraint kind {kind!r}")


# llguidance's lexer and parser budgets (its defaults allow 250k lexer states and 1M initial fuel: a 15-byte
# regex, `(a{1000}){1000}`, then took 1-5 s for its first mask). With these the same regex fails within
# ~0.2 s, as an error of the grammar, and no schema or grammar of the test suite or bench/grammar_bench.py
# comes near them. The same limits everywhere, so a grammar the tokenizer lets through the engine compiles.
LEXER_STATES, INITIAL_LEXER_FUEL, STEP_LEXER_FUEL = 20_000, 200_000, 50_000
# The tokenizer's cache of checks, keyed by spec text: bounded by that text's bytes too (a spec may be as big as
# the API's body limit).
CHECK_CACHE_ENTRIES, CHECK_CACHE_BYTES = 1024, 32 * 2**20
PROBE_TOKENS = 2  # tokens the tokenizer's check walks through the grammar after its first mask


def limits() -> Any:
    from llguidance import LLParserLimits

    return LLParserLimits(max_lexer_states=LEXER_STATES, initial_lexer_fuel=INITIAL_LEXER_FUEL,
                          step_lexer_fuel=STEP_LEXER_FUEL)


def check(guided: Guided) -> str | None:
    """Why this constraint cannot be used (None if it can). Cheap enough for the tokenizer stage, which calls
    it to refuse a bad schema, regex or grammar with a 400 before queueing: it compiles the grammar within
    `limits()` and walks its first masks over a vocabulary of the 256 bytes (a lexer that explodes does so
    whatever the vocabulary), so a grammar bomb is refused here rather than on an engine's step thread."""
    key = (guided.kind, guided.spec)
    with _lock:
        if key in _checked:
            return _checked.get(key)
    problem = _check(guided.kind, guided.spec)
    with _lock:
        _checked.put(key, problem, len(guided.spec) + len(guided.kind) + 64)
    return problem


def checked(guided: Guided) -> bool:
    """Whether `check` has the answer for this constraint already (a new one may take ~0.2 s of CPU)."""
    with _lock:
        return (guided.kind, guided.spec) in _checked


_lock = threading.Lock()  # checks run in worker threads (services/tokenizer/encode.py)
_checked: ByteLRU[tuple[str, str], str | None] = ByteLRU(CHECK_CACHE_ENTRIES, CHECK_CACHE_BYTES)


def _check(kind: str, spec: str) -> str | None:
    from llguidance import LLMatcher

    try:
        text = grammar_text(Guided(kind, spec))
        error = LLMatcher.validate_grammar(text, limits=limits())
    except (ValueError, TypeError) as e:
        return str(e)
    return error.strip() or _probe(text)


def _probe(text: str) -> str | None:
    """Compute the first masks of the grammar over a vocabulary of the 256 bytes, taking the first byte each
    admits: a grammar past the limits fails here. One that names special tokens (a tool call's `<tool_call>`)
    is not probed: this vocabulary has none of them."""
    import numpy as np
    from llguidance import LLMatcher

    matcher = LLMatcher(_byte_tokenizer(), text, log_level=0, limits=limits())
    if matcher.is_error():
        error = matcher.get_error()
        return None if "unknown special token" in error else _first_line(error)
    mask = np.empty(((BYTE_VOCAB + 31) // 32,), dtype=np.int32)
    for _ in range(PROBE_TOKENS):
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:BYTE_VOCAB - 1])
        if matcher.is_error() or not len(allowed) or not matcher.consume_token(int(allowed[0])):
            break
    return _first_line(matcher.get_error()) if matcher.is_error() else None


def _first_line(error: str) -> str:
    """llguidance's error without the parser state dump it appends."""
    return error.split("\n<state>")[0].split("\n")[0].strip() or error.strip()


BYTE_VOCAB = 257  # the 256 bytes and an end-of-sequence token


@functools.cache
def _byte_tokenizer() -> Any:
    from llguidance import LLTokenizer, TokenizerWrapper

    class Bytes:
        def __init__(self) -> None:
            self.eos_token_id, self.bos_token_id = BYTE_VOCAB - 1, None
            self.tokens = [bytes([i]) for i in range(256)] + [b"</s>"]
            self.special_token_ids = [BYTE_VOCAB - 1]

        def __call__(self, text: bytes) -> list[int]:
            return list(text)

    return LLTokenizer(TokenizerWrapper(Bytes()))
