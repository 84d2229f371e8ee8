"""A synthetic engine: the Engine interface with no model, to measure the plumbing alone (`--engine synthetic`).

Each step sleeps `--step-ms` (the scheduler runs steps in a thread, as a GPU step would block it) and
yields one token per running sequence. Tokens are pseudo-random ids of the model's tokenizer, a pure
function of (request uid, choice, completion index), so a run is reproducible, a peer resuming a request
produces the same tokens, and a client can check what it received. It honours max_tokens (an omitted one
is what the context leaves), min_tokens, stop_token_ids, n, aborts, logprobs (made up but well formed)
and --max-running; EOS is never produced unless `eos_every` asks for it, so lengths are deterministic.
It reads only the checkpoint's config and tokenizer: no weights, so it starts in a second.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.scheduler.engine.base import (
    EngineRequest,
    RequestRejected,
    StepOutput,
    allowed_completion,
    refuse_prefill_only,
)

log = logging.getLogger(__name__)

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
TOP_LOGPROB_GAP = 1.0  # between consecutive made-up top logprobs, so their probabilities sum below 1


def mix64(x: int) -> int:
    """splitmix64's finalizer: a cheap, well-spread 64-bit hash of an integer."""
    x &= M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def sequence_seed(uid: str, index: int) -> int:
    """The seed of one choice's token stream: stable across processes (unlike hash())."""
    return int.from_bytes(hashlib.blake2b(f"{uid}/{index}".encode(), digest_size=8).digest(), "little")


def token_hash(seed: int, position: int) -> int:
    return mix64(seed + (position + 1) * GOLDEN)


@dataclass(eq=False)
class _Seq:
    req: EngineRequest
    index: int
    seed: int
    produced: int  # completion tokens so far (those resumed after a crash included)
    max_tokens: int
    last: int | None = None  # the last token produced (or resumed)

    @property
    def uid(self) -> str:
        return self.req.uid


@dataclass(frozen=True)
class SyntheticVocab:
    """The tokens a synthetic engine emits and takes: `ids`, those it draws from (the tokenizer's, less special
    ones); `size`, the bound of valid input ids (default: past the largest of `ids`); `eos_every`: 0 never
    emits EOS, k emits one of `eos_ids` at about 1 in k positions."""

    ids: Sequence[int]
    size: int | None = None
    eos_ids: frozenset[int] = field(default_factory=frozenset)
    eos_every: int = 0

    def __post_init__(self) -> None:
        if not self.ids:
            raise ValueError("the synthetic engine needs a non-empty vocabulary")
        if self.eos_every and not self.eos_ids:
            raise ValueError("eos_every needs eos_ids")


class SyntheticEngine:
    def __init__(self, vocab: SyntheticVocab, max_context: int, max_running: int = 64, step_s: float = 0.02,
                 sleep: Callable[[float], None] = time.sleep):
        self.vocab = list(vocab.ids)
        self.vocab_size = vocab.size or max(self.vocab) + 1
        self.max_context = max_context
        self.max_running = max_running
        self.step_s = step_s
        self.eos_ids = set(vocab.eos_ids)
        self.eos_id = min(self.eos_ids) if self.eos_ids else None
        self.eos_every = vocab.eos_every
        self.sleep = sleep
        self.running: list[_Seq] = []
        self.waiting: deque[_Seq] = deque()
        self.steps = 0
        self._pending: list[StepOutput] = []  # outputs due without a step (resumed requests already done)
        self._room = self._free_room()

    # ---- the tokens

    def token(self, seed: int, position: int) -> int:
        """Completion token `position` of the stream with this seed."""
        h = token_hash(seed, position)
        if self.eos_every and (h >> 40) % self.eos_every == 0:
            return self.eos_id  # type: ignore[return-value]
        return self.vocab[h % len(self.vocab)]

    def expected_ids(self, uid: str, index: int, count: int) -> list[int]:
        """The first `count` tokens choice `index` of request `uid` gets (before any stop)."""
        seed = sequence_seed(uid, index)
        return [self.token(seed, i) for i in range(count)]

    def _logprobs(self, seed: int, position: int, tok: int, top: int) -> tuple[float, list[tuple[int, float]]]:
        """A made-up logprob for the chosen token (the most likely one: the output is what greedy would
        pick) and `top` alternatives below it with distinct ids."""
        h = token_hash(seed ^ 0x5BD1E995, position)
        chosen = -0.7 - (h & 0xFF) / 1000  # about 1/2: with the others below, they sum to < 1
        alternatives = [(tok, chosen)]
        seen, k = {tok}, 0
        while len(alternatives) < min(top, len(self.vocab)):
            other = self.vocab[mix64(h + k) % len(self.vocab)]
            k += 1
            if other not in seen:
                seen.add(other)
                alternatives.append((other, chosen - TOP_LOGPROB_GAP * len(alternatives)))
        return chosen, alternatives[:top]

    # ---- Engine interface

    def add(self, req: EngineRequest) -> int:
        p = req.params
        if p.pooling is not None:
            raise refuse_prefill_only("synthetic")
        max_tokens = self._validate(req)
        if req.adapter is not None:
            raise RequestRejected(f"no LoRA adapter named '{req.adapter}' (this engine serves none; the paged engine "
                                  "does, with --max-loras)", code="model_not_found", param="model")
        resumed = [list(o) for o in req.output_ids]
        for i in range(p.n):
            prior = resumed[i] if i < len(resumed) else []
            seq = _Seq(req, i, sequence_seed(req.uid, i), len(prior), max_tokens, prior[-1] if prior else None)
            done = self._finish_reason(seq) if prior else None
            if done:
                self._pending.append(StepOutput(req.uid, len(prior), [], i, done))
            else:
                self.waiting.append(seq)
        self._room = self._free_room()
        return max_tokens

    def _validate(self, req: EngineRequest) -> int:
        """Refuse what can never be served (as the paged engine does); return max_tokens, an omitted one
        resolved to what the context leaves after the prompt."""
        p, prompt = req.params, req.input_ids
        if not prompt:
            raise RequestRejected("the prompt is empty: at least one input token is needed")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise RequestRejected(f"input token ids must be in [0, {self.vocab_size})")
        if p.n < 1:
            raise RequestRejected("n must be at least 1")
        if p.guided is not None:  # its tokens are random: it cannot follow a grammar, so it must not pretend to
            raise RequestRejected("the synthetic engine cannot constrain output (structured outputs, required "
                                  "tools)", param="response_format")
        if p.prompt_logprobs is not None:
            raise RequestRejected("the synthetic engine does not score prompts (echo with logprobs)",
                                  param="logprobs")
        return allowed_completion(len(prompt), p, self.max_context)

    def abort(self, uid: str, index: int | None = None) -> bool:
        before = len(self.running) + len(self.waiting) + len(self._pending)

        def ours(uid_: str, index_: int) -> bool:
            return uid_ == uid and index in (None, index_)

        self.running = [s for s in self.running if not ours(s.uid, s.index)]
        self.waiting = deque(s for s in self.waiting if not ours(s.uid, s.index))
        self._pending = [o for o in self._pending if not ours(o.uid, o.index)]
        self._room = self._free_room()
        return len(self.running) + len(self.waiting) + len(self._pending) != before

    def room(self) -> int:
        """New requests to pull now, as published by whoever last changed the queues: the scheduler asks from
        its event loop while a step runs in its thread (services/scheduler/engine/paged.py `_room`)."""
        return self._room

    def _free_room(self) -> int:
        """None while some wait, else the free running slots."""
        if self.waiting:
            return 0
        return max(0, self.max_running - len(self.running))

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._pending)

    def stats(self) -> dict:
        held = sum(len(s.req.input_ids) + s.produced for s in self.running)
        return {
            "engine": "synthetic",
            "dtype": None,  # no weights
            "step_ms": self.step_s * 1000,
            "running": len({s.uid for s in self.running}),
            "waiting": len({s.uid for s in self.waiting}),
            "running_sequences": len(self.running),
            # what a KV cache would hold, against max_running full contexts: the usage gauge stays meaningful
            "kv_used_tokens": held,
            "kv_total_tokens": self.max_running * self.max_context,
            "steps": self.steps,
        }

    prefix_page_size = 0  # no prefix cache: nothing to publish for routing

    def prefix_changes(self) -> tuple[list[bytes], list[bytes]]:
        return [], []

    def prefix_digests(self) -> list[bytes]:
        return []

    def resident_adapters(self) -> list[str]:
        return []

    def close(self) -> None:
        self.running.clear()
        self.waiting.clear()
        self._pending.clear()
        self._room = self._free_room()

    # ---- the step

    def step(self) -> list[StepOutput]:
        """One token per running sequence, then sleep what is left of the step's time."""
        started = time.perf_counter()
        outputs, self._pending = self._pending, []
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.popleft())
        if not self.running:
            self._room = self._free_room()
            return outputs
        self.steps += 1
        still = []
        for seq in self.running:
            outputs.append(self._advance(seq))
            if outputs[-1].finish_reason is None:
                still.append(seq)
        self.running = still
        self._room = self._free_room()  # what a read during the rest of the step may take
        self.sleep(max(0.0, self.step_s - (time.perf_counter() - started)))
        return outputs

    def _advance(self, seq: _Seq) -> StepOutput:
        p = seq.req.params
        start = seq.produced
        tok = self.token(seq.seed, start)
        seq.produced += 1
        seq.last = tok
        finish = self._finish_reason(seq)
        if not (p.logprobs or p.top_logprobs > 0):
            return StepOutput(seq.uid, start, [tok], seq.index, finish)
        lp, top = self._logprobs(seq.seed, start, tok, p.top_logprobs)
        return StepOutput(seq.uid, start, [tok], seq.index, finish, [lp], [top] if p.top_logprobs > 0 else None)

    def _finish_reason(self, seq: _Seq) -> str | None:
        p, tok = seq.req.params, seq.last
        if seq.produced >= p.min_tokens and (
                (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids):
            return "stop"
        if seq.produced >= seq.max_tokens:
            return "length"
        return None


def synthetic_vocab(tokenizer, config_vocab_size: int, eos_ids: set[int]) -> list[int]:
    """Ids the synthetic engine draws from: the tokenizer's base vocabulary, less special and EOS ids (a
    special token would end a request or vanish from the text, making lengths depend on the draw)."""
    excluded = set(tokenizer.all_special_ids) | set(eos_ids)
    size = min(tokenizer.vocab_size, config_vocab_size)
    return [i for i in range(size) if i not in excluded]


def build_synthetic_engine(settings, model_path: str) -> SyntheticEngine:
    """From the checkpoint's config and tokenizer only; its weights are never read."""
    from transformers import AutoConfig

    from services.scheduler.engine.eos import eos_token_ids
    from shared.models import context_length, load_tokenizer

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=settings.trust_remote_code)
    text_config = getattr(config, "text_config", None) or config
    tokenizer = load_tokenizer(model_path, settings.trust_remote_code)
    eos = eos_token_ids(model_path, config)
    vocab = synthetic_vocab(tokenizer, text_config.vocab_size, eos)
    engine = SyntheticEngine(SyntheticVocab(vocab, text_config.vocab_size, frozenset(eos)),
                             context_length(model_path, settings.trust_remote_code), max_running=settings.max_running,
                             step_s=settings.step_ms / 1000)
    log.info("engine=synthetic step=%.1fms max_running=%d vocab=%d ids context=%d model=%s", settings.step_ms,
             settings.max_running, len(vocab), engine.max_context, model_path)
    return engine
