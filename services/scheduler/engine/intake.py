"""The paged engine's way in: a request checked against what the engine can ever serve and queued, and the
waiting sequences readied for a step (their grammar compiled, their LoRA adapter in a slot).

A request whose grammar is compiling or whose adapter is loading waits in the queue (sequence.py `ready`); an
idle step waits a little for either instead of spinning.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

from services.scheduler.engine.base import EngineRequest, RequestRejected, StepOutput, allowed_completion
from services.scheduler.engine.grammar import GrammarCache, GrammarError, SeqGrammar
from services.scheduler.engine.kv_cache import PagePool
from services.scheduler.engine.lora import LoraManager
from services.scheduler.engine.pooling import check_pooling
from services.scheduler.engine.resolve import StepResolver, guided_param
from services.scheduler.engine.scheduler import BatchScheduler
from services.scheduler.engine.sequence import Seq
from shared.messages import SamplingParams

GRAMMAR_WAIT_S = 0.02  # an idle step waits this long for a compiling grammar instead of spinning


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against: the model's and the KV pool's sizes."""

    vocab_size: int
    hidden_size: int  # what an embedding has (pooling.py)
    truncation: list[int] | bool  # the dimensions an embedding may be truncated to (pooling.py `truncatable`)
    max_context: int
    page_size: int


class RequestIntake:
    """Checks and queues requests; readies the waiting ones. `grammars` is set by the factory (structured
    outputs), None where the engine has none."""

    def __init__(self, scheduler: BatchScheduler, pool: PagePool, limits: ModelLimits, lora: LoraManager | None,
                 resolver: StepResolver):
        self.scheduler = scheduler
        self.pool = pool
        self.limits = limits
        self.lora = lora
        self.resolver = resolver
        self.grammars: GrammarCache | None = None

    def add(self, req: EngineRequest) -> tuple[int, list[StepOutput]]:
        """Queue a request: its max_tokens (an omitted one resolved), and the outputs of the resumed choices that
        had already ended; raise RequestRejected if it can never be served."""
        p = req.params
        prompt = list(req.input_ids)
        max_tokens = self._validate(req, prompt)
        if req.adapter is not None:
            if self.lora is None:
                raise RequestRejected(f"no LoRA adapter named '{req.adapter}' (this engine serves none: "
                                      "--max-loras is 0)", code="model_not_found", param="model")
            self.lora.check(req.adapter)  # refuses unknown and bad adapters; starts loading the others
        compiling = self._compile(p) if p.guided is not None else None
        if not any(req.output_ids):  # fresh: one sequence prefills the prompt and forks the rest at its first sample
            seq = Seq(req, 0, prompt, len(prompt), max_tokens, forks=p.n - 1, compiling=compiling)
            self.scheduler.waiting.append(seq)
            return max_tokens, []
        ended = []
        for i in range(p.n):
            prior = list(req.output_ids[i]) if i < len(req.output_ids) else []
            seq = Seq(req, i, prompt + prior, len(prompt), max_tokens, compiling=compiling)
            done = self.resolver.finish_reason(seq, prior[-1], seq.completion_len, len(seq.tokens)) if prior else None
            if done:
                ended.append(StepOutput(req.uid, len(prior), [], i, done))
            else:
                self.scheduler.waiting.append(seq)
        return max_tokens, ended

    def _compile(self, p: SamplingParams) -> Future:
        """Start (or find) the compile of the request's grammar; it waits in the queue until it is ready."""
        assert p.guided is not None
        if self.grammars is None:
            raise RequestRejected("structured outputs are not available on this engine", param=p.guided.param)
        return self.grammars.get(p.guided)

    def _validate(self, req: EngineRequest, prompt: list[int]) -> int:
        """Refuse what can never be served; return max_tokens, resolving an omitted one."""
        p, limits = req.params, self.limits
        if not prompt:
            raise RequestRejected("the prompt is empty: at least one input token is needed")
        vocab = limits.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise RequestRejected(f"input token ids must be in [0, {vocab})")
        if p.n < 1:
            raise RequestRejected("n must be at least 1")
        if p.pooling is not None:
            if p.n != 1:
                raise RequestRejected("a prefill-only request has one choice", param="n")
            check_pooling(p.pooling, vocab, limits.hidden_size, limits.truncation)
        max_tokens = allowed_completion(len(prompt), p, limits.max_context, self.pool.usable * limits.page_size)
        return max_tokens if p.max_tokens is not None else self._default_max_tokens(p, len(prompt))

    def _default_max_tokens(self, p: SamplingParams, prompt_len: int) -> int:
        """An omitted max_tokens: up to the context, as far as the KV pool can ever hold the request. That
        is all n choices side by side (they share the prompt's full pages) where they fit, else one
        choice alone (the others wait their turn, preempted); never less than min_tokens (which
        `allowed_completion` checked fits one choice alone)."""
        ps, usable = self.limits.page_size, self.pool.usable
        context_left = self.limits.max_context - prompt_len
        alone = usable * ps - prompt_len
        shared = prompt_len // ps
        together = (shared + (usable - shared) // p.n) * ps - prompt_len
        return max(p.min_tokens, min(context_left, together if together >= 1 else alone))

    # ---- the waiting sequences, before each step

    def prepare_grammars(self) -> list[StepOutput]:
        """Give each waiting sequence whose grammar just compiled its matcher (replaying the tokens it
        already has, after a preemption or a crash); fail the requests whose grammar did not compile."""
        failed: dict[str, str] = {}
        for seq in self.scheduler.waiting:
            if seq.grammar is not None or seq.compiling is None or not seq.compiling.done():
                continue
            try:
                guided = seq.req.params.guided
                assert guided is not None
                seq.grammar = SeqGrammar(seq.compiling.result(), guided.after, seq.tokens[seq.prompt_len:],
                                         guided.think)
            except (GrammarError, RuntimeError, ValueError) as e:
                failed.setdefault(seq.uid, f"structured output: {e}")
        outputs = []
        for uid, error in failed.items():
            seqs = [s for s in self.scheduler.waiting if s.uid == uid][:1]
            outputs += self.resolver.fail(seqs, error, 400, guided_param(seqs))
        return outputs

    def prepare_adapters(self) -> list[StepOutput]:
        """Bind waiting sequences to their loaded adapters (lora.py); fail the requests whose adapter failed."""
        if self.lora is None:
            return []
        outputs = []
        for seq, error, status in self.lora.prepare(self.scheduler.waiting, self.scheduler.running):
            if not seq.ended:
                outputs += self.resolver.fail([seq], error, status, "model" if status < 500 else None)
        return outputs

    def wait_for_grammars(self) -> None:
        """Nothing to run: wait a little for a grammar compiling or an adapter loading instead of spinning."""
        compiling = {s.compiling for s in self.scheduler.waiting
                     if not s.ready and s.compiling is not None and not s.compiling.done()}
        if self.lora is not None:
            compiling.update(self.lora.loading())
        if compiling:
            wait_futures(compiling, timeout=GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED)  # type: ignore[arg-type]
