"""Structured outputs in the engine: grammars prepared off the step thread, one matcher per choice, and
token masks applied only to the logits rows of constrained choices.

llguidance, not xgrammar: on the demo model's vocabulary, xgrammar 0.2.8 let raw control characters and
partial UTF-8 into strings with `maxLength` (10 of 138 random walks through two schemas gave text that
`json.loads` or jsonschema rejects; llguidance 0 of 42 on the same schemas); xgrammar's per-token mask is
cheaper once compiled (~2 µs against ~20 µs), but compiling one schema against Qwen's 152k vocabulary took
~365 ms where llguidance builds its lexer lazily (<1 ms per new schema). Measured on 2 shared cores.

A new grammar is prepared in the cache's own thread (the first one of a model also loads the tokenizer and
builds the token trie: ~12 ms for the demo's 1k tokens, ~2.6 s for Qwen's 152k), keyed by (kind, spec): a
request waits in the engine's queue until its grammar is ready while the batch keeps stepping. Per step, a
constrained row costs one mask computation and one masked fill of its logits row (~25 µs at 1k tokens,
~200 µs at 152k on CPU; bench/grammar_bench.py); unconstrained rows cost nothing.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from shared.grammars import grammar_text, limits
from shared.lru import ByteLRU
from shared.messages import Guided

log = logging.getLogger(__name__)

# Prepared grammars kept (least recently used dropped), keyed by spec text: bounded by that text's bytes too (a
# spec may be as big as the API's body limit). A matcher's own memory is bounded by shared/grammars.py `limits`.
CACHE_ENTRIES, CACHE_BYTES = 256, 64 * 2**20


class GrammarError(Exception):
    """A constraint the engine could not use."""


class Prepared:
    """A grammar ready for matchers: the model's token trie and one matcher to copy. `specials`: the
    tokens llguidance treats as special (every added token, `<think>` and `<tool_call>` included);
    `budget_s`: the CPU time one choice's mask may take in a step (`apply_masks`)."""

    def __init__(self, matcher: Any, specials: list[int], budget_s: float = float("inf")):
        self.matcher = matcher
        self.specials = specials
        self.budget_s = budget_s

    def new_matcher(self) -> Any:
        return self.matcher.deep_copy()


class GrammarCache:
    """Grammars of one model's vocabulary, prepared in a background thread."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos_ids: set[int], trust_remote_code: bool = False,
                 mask_budget_ms: float = 20.0):
        self.tokenizer_path, self.vocab_size = tokenizer_path, vocab_size
        self.eos_ids, self.trust_remote_code = sorted(eos_ids), trust_remote_code
        self.budget_s = mask_budget_ms / 1000
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._prepared: ByteLRU[tuple[str, str], Future] = ByteLRU(CACHE_ENTRIES, CACHE_BYTES)
        self._tokenizer = None  # built in the executor's thread on first use
        self._specials: list[int] = []
        self.compile_ms: list[float] = []  # of the last preparations, for stats

    def get(self, guided: Guided) -> Future:
        """The prepared grammar of `guided`, now or later; the work never runs on the caller's thread."""
        key = (guided.kind, guided.spec)
        future = self._prepared.get(key)
        if future is None:
            future = self._executor.submit(self._prepare, guided)
            self._prepared.put(key, future, len(guided.spec) + len(guided.kind) + 256)
        return future

    def _prepare(self, guided: Guided) -> Prepared:
        """Compile within llguidance's limits, then compute the first masks here, off the step thread: the
        prototype's, then a copy's (what each choice pays in its first step) and the next one after the first
        admitted token. A grammar past the limits fails here, and so does one whose mask would take more than a
        step's budget: both are the client's errors, refused before the request joins the batch."""
        from llguidance import LLMatcher

        started = time.perf_counter()
        tokenizer = self._llm_tokenizer()
        field = guided.param or guided.kind
        try:
            matcher = LLMatcher(tokenizer, grammar_text(guided), log_level=0, limits=limits())
        except (ValueError, TypeError) as e:
            raise GrammarError(f"`{field}`: {e}") from None
        if matcher.is_error():
            raise GrammarError(f"`{field}`: {matcher.get_error()}")
        prepared = Prepared(matcher, self._specials, self.budget_s)
        self._first_masks(prepared, field)
        ms = (time.perf_counter() - started) * 1e3
        self.compile_ms = [*self.compile_ms[-63:], ms]
        log.info("prepared a %s grammar in %.1f ms", guided.kind, ms)
        return prepared

    def _first_masks(self, prepared: Prepared, field: str) -> None:
        words = (self.vocab_size + 31) // 32
        mask = np.empty((words,), dtype=np.int32)
        prepared.matcher.unsafe_compute_mask_ptr(mask.ctypes.data, words * 4)
        probe = prepared.new_matcher()
        for step in range(2):
            began = time.thread_time()
            probe.unsafe_compute_mask_ptr(mask.ctypes.data, words * 4)
            took = time.thread_time() - began
            if probe.is_error():
                raise GrammarError(f"`{field}`: {_first_line(probe.get_error())}")
            if took > self.budget_s:
                raise GrammarError(f"`{field}` is too expensive: a token mask took {took * 1e3:.0f} ms, more than "
                                   f"the {self.budget_s * 1e3:.0f} ms a step allows it")
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:self.vocab_size])
            token = next((int(t) for t in allowed if t not in self.eos_ids), None)
            if step or token is None or not probe.consume_token(token):
                break
        if probe.is_error():
            raise GrammarError(f"`{field}`: {_first_line(probe.get_error())}")

    def _llm_tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.tokenizer_path, trust_remote_code=self.trust_remote_code)
            eos = tok.eos_token_id if tok.eos_token_id in self.eos_ids else (self.eos_ids or [tok.eos_token_id])[0]
            self._tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=self.vocab_size, eos_token=eos)
            added = sorted(t for t in tok.get_added_vocab().values() if t < self.vocab_size)
            self._specials = [t for t in added if self._tokenizer.is_special_token(t)]
        return self._tokenizer

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _first_line(error: str) -> str:
    """llguidance's error without the parser state it appends."""
    return error.split("\n<state>")[0].strip() or error.strip()


class SeqGrammar:
    """One choice's grammar state. A reasoning model's thinking is free: with `think`, the first token
    may open it instead of starting the answer; with `after` alone the prompt opened it. From the end
    of the thinking (`after` in the completion) every token goes through the matcher."""

    def __init__(self, prepared: Prepared, after: list[int], completion: list[int], think: int = -1):
        self.prepared, self.after, self.think = prepared, list(after), think
        self.matcher = prepared.new_matcher()
        self.active = not self.after or think >= 0
        self.seen = 0  # completion tokens fed
        self.failure = ""  # why the request must fail (its mask went past the step's budget)
        for k in range(len(completion)):  # a resumed or preempted choice replays what it produced
            if not self.accept(completion[:k + 1]):
                raise GrammarError("the tokens already produced do not match the grammar")

    def fresh(self) -> SeqGrammar:
        """A state for a sibling choice forked before its first token."""
        return SeqGrammar(self.prepared, self.after, [], self.think)

    @property
    def may_open_thinking(self) -> bool:
        """The next token may be `think` besides what the grammar admits (only the first token)."""
        return self.seen == 0 and self.think >= 0

    def accept(self, completion: list[int]) -> bool:
        """Feed the completion's last token; False if the grammar does not admit it (or failed: `refusal`)."""
        if self.failure:
            return False
        self.seen += 1
        tok = completion[-1]
        if self.seen == 1 and self.think >= 0 and tok == self.think:
            self.active = False  # the model thinks first; the answer starts after `after`
            return True
        if not self.active:
            n = len(self.after)
            self.active = len(completion) >= n and completion[-n:] == self.after
            return True
        return bool(self.matcher.consume_token(tok))

    @property
    def done(self) -> bool:
        """The grammar has ended (its end-of-sequence accepted): the choice ends too, even with ignore_eos."""
        return self.active and bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""

    @property
    def refusal(self) -> str:
        """Why a token was not accepted: the client's grammar (or its params) at fault, a 400."""
        if self.failure:
            return self.failure
        if self.error:
            return f"structured output: {_first_line(self.error)}"
        return "structured output: the grammar admits no token the request allows"


def apply_masks(logits: torch.Tensor, grammars: list[SeqGrammar | None]) -> None:
    """Set to -inf, in place, every token the grammar of an active constrained row does not admit."""
    rows = [i for i, g in enumerate(grammars) if g is not None and g.active]
    if not rows:
        return
    vocab = logits.shape[-1]
    words = (vocab + 31) // 32
    bitmask = np.empty((len(rows), words), dtype=np.int32)
    for j, i in enumerate(rows):
        g = grammars[i]
        assert g is not None
        began = time.thread_time()  # CPU time: a busy machine's waits are not the grammar's
        g.matcher.unsafe_compute_mask_ptr(bitmask[j].ctypes.data, words * 4)
        took = time.thread_time() - began
        if took > g.prepared.budget_s:  # it fails now, before it costs the batch another step
            g.failure = (f"structured output: the grammar is too expensive: a token mask took {took * 1e3:.0f} ms, "
                         f"more than the {g.prepared.budget_s * 1e3:.0f} ms a step allows it")
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")[:, :vocab].view(np.bool_)
    for j, i in enumerate(rows):
        g = grammars[i]
        assert g is not None
        # llguidance's mask admits a special token whose text matches the bytes the grammar forces next
        # (`<think>` where a regex spells "<think>"), and then refuses it: only keep those it would accept.
        for t in g.prepared.specials:
            if allowed[j, t] and not g.matcher.validate_tokens([t]):
                allowed[j, t] = False
        if g.may_open_thinking and g.think < vocab:
            allowed[j, g.think] = True
    index = torch.tensor(rows, device=logits.device)
    mask = torch.from_numpy(allowed).to(logits.device, non_blocking=True)
    logits[index] = logits[index].masked_fill(~mask, float("-inf"))
