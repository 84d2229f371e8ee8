"""Structured-output constraints as llguidance grammars: built here for every stage (the tokenizer checks
them, the engine compiles them; services/scheduler/engine/grammar.py says why llguidance)."""

from __future__ import annotations

import functools

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


def check(guided: Guided) -> str | None:
    """Why this constraint cannot be used (None if it can). Needs no vocabulary, so it is cheap: the
    tokenizer stage calls it to refuse a bad schema, regex or grammar with a 400 before queueing."""
    return _check(guided.kind, guided.spec)


@functools.lru_cache(maxsize=1024)
def _check(kind: str, spec: str) -> str | None:
    from llguidance import LLMatcher

    try:
        error = LLMatcher.validate_grammar(grammar_text(Guided(kind, spec)))
    except (ValueError, TypeError) as e:
        return str(e)
    return error.strip() or None
