"""Batched per-request sampling: logit_bias, penalties, min_tokens, grammar masks (structured outputs),
greedy, temperature, top_k, top_p, min_p, seeds.

Every row is processed on its own terms whatever else is in the batch: masks are built per row, and
a sampled token is the argmax of probs / E with E ~ Exp(1) noise drawn per row (the exponential race,
equivalent to multinomial sampling). A seeded row draws its noise from a generator seeded with
(seed, choice, completion index), so the same seed gives the same text whatever its batch companions,
across preemption, and when a peer resumes the request after a crash.

Logprobs are the log_softmax of the model's raw logits, before penalties, temperature and filtering
(what the model believes, as vLLM reports by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shared.messages import SamplingParams

if TYPE_CHECKING:
    from services.scheduler.engine.grammar import SeqGrammar

_MIX1, _MIX2, _MASK63 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, (1 << 63) - 1


@dataclass
class SampleRow:
    params: SamplingParams
    index: int  # choice
    step: int  # completion index of the token being sampled
    tokens: list[int]  # prompt + completion so far
    prompt_len: int
    grammar: SeqGrammar | None = None  # structured outputs: only admitted tokens may be sampled


@dataclass
class SampleResult:
    ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


def row_seed(seed: int, index: int, step: int) -> int:
    return (seed * _MIX1 + index * _MIX2 + step) & _MASK63


def _penalized(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _modified(r: SampleRow) -> bool:
    """Whether anything changes this row's logits before sampling (they are then copied first, since
    logprobs report the model's raw logits)."""
    return _penalized(r.params) or r.step < r.params.min_tokens or bool(r.params.logit_bias) or (
        r.grammar is not None and r.grammar.active)


class Sampler:
    def __init__(self, eos_ids: set[int], device: torch.device | str = "cpu", seed: int | None = None):
        self.eos_ids = sorted(eos_ids)
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self.row_generator = torch.Generator(self.device)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
        raw = logits.float()
        x = raw.clone() if any(_modified(r) for r in rows) else raw
        self._apply_logit_bias(x, rows)
        self._apply_penalties(x, rows)
        self._apply_min_tokens(x, rows)
        if any(r.grammar is not None for r in rows):
            from services.scheduler.engine.grammar import apply_masks

            apply_masks(x, [r.grammar for r in rows])
        ids = x.argmax(-1)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            ids[sampled] = self._sample(x[sampled], [rows[i] for i in sampled])
        out = ids.tolist()
        lps, tops = self._logprobs(raw, rows, out)
        return SampleResult(out, lps, tops)

    @staticmethod
    def _apply_logit_bias(x: torch.Tensor, rows: list[SampleRow]) -> None:
        for i, r in enumerate(rows):
            bias = r.params.logit_bias
            if bias:
                ids = [t for t in bias if 0 <= t < x.shape[-1]]
                x[i, ids] += torch.tensor([bias[t] for t in ids], dtype=x.dtype, device=x.device)

    def _apply_penalties(self, x: torch.Tensor, rows: list[SampleRow]) -> None:
        for i, r in enumerate(rows):
            p = r.params
            if not _penalized(p):
                continue
            if p.repetition_penalty != 1.0:  # HF/vLLM: over prompt and completion tokens
                seen = torch.tensor(sorted(set(r.tokens)), dtype=torch.long, device=x.device)
                vals = x[i, seen]
                x[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            completion = r.tokens[r.prompt_len:]
            if completion and (p.presence_penalty or p.frequency_penalty):  # OpenAI: completion only
                counts = torch.bincount(torch.tensor(completion, device=x.device), minlength=x.shape[-1])
                counts = counts[: x.shape[-1]].to(x.dtype)
                x[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)

    def _apply_min_tokens(self, x: torch.Tensor, rows: list[SampleRow]) -> None:
        for i, r in enumerate(rows):
            if r.step < r.params.min_tokens:
                banned = list(r.params.stop_token_ids) + ([] if r.params.ignore_eos else self.eos_ids)
                banned = [t for t in banned if 0 <= t < x.shape[-1]]
                if banned:
                    x[i, banned] = float("-inf")

    def _sample(self, x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in rows], device=x.device)
        x = x / temps[:, None]
        x = x.masked_fill(self._filter_mask(x, rows), float("-inf"))
        probs = torch.softmax(x, -1)
        return (probs / self._noise(probs, rows)).argmax(-1)

    def _filter_mask(self, x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """True where top_k, top_p or min_p removes a token; built per row so rows never interact."""
        vocab = x.shape[-1]
        mask = torch.zeros_like(x, dtype=torch.bool)
        min_p = torch.tensor([r.params.min_p for r in rows], device=x.device)
        if bool((min_p > 0).any()):
            probs = torch.softmax(x, -1)
            mask |= probs < min_p[:, None] * probs.max(-1, keepdim=True).values
        top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
            rank = torch.arange(vocab, device=x.device)[None]
            drop = rank >= torch.tensor(top_k, device=x.device)[:, None]
            sorted_p = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), -1)
            before = sorted_p.cumsum(-1) - sorted_p  # mass of strictly more likely tokens
            drop |= before > torch.tensor(top_p, device=x.device)[:, None]
            mask |= torch.zeros_like(drop).scatter(-1, order, drop)
        return mask

    def _noise(self, probs: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                self.row_generator.manual_seed(row_seed(r.params.seed, r.index, r.step))
                noise[i].exponential_(generator=self.row_generator)
        return noise.clamp_(min=1e-30)  # a zero draw would turn a filtered token's 0/0 into NaN

    @staticmethod
    def _logprobs(raw: torch.Tensor, rows: list[SampleRow], ids: list[int]):
        lps: list[float | None] = [None] * len(rows)
        tops: list[list[tuple[int, float]] | None] = [None] * len(rows)
        want = [i for i, r in enumerate(rows) if r.params.logprobs or r.params.top_logprobs > 0]
        if not want:
            return lps, tops
        lp = torch.log_softmax(raw[want], -1)
        chosen = lp.gather(-1, torch.tensor([ids[i] for i in want], device=lp.device)[:, None])[:, 0].tolist()
        k = min(max(rows[i].params.top_logprobs for i in want), lp.shape[-1])
        top_v, top_i = lp.topk(k, -1) if k > 0 else (None, None)
        for j, i in enumerate(want):
            lps[i] = chosen[j]
            n = rows[i].params.top_logprobs
            if n > 0:
                tops[i] = list(zip(top_i[j, :n].tolist(), top_v[j, :n].tolist(), strict=True))
        return lps, tops
