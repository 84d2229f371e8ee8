"""Batched per-request sampling: logit_bias, penalties, min_tokens, grammar masks (structured outputs),
greedy, temperature, top_k, top_p, min_p, seeds.

Every row is processed on its own terms whatever else is in the batch: masks are built per row, and
a sampled token is the argmax of probs / E with E ~ Exp(1) noise drawn per row (the exponential race,
equivalent to multinomial sampling). A seeded row draws its noise from a generator seeded with
(seed, choice, completion index), so the same seed gives the same text whatever its batch companions,
across preemption, and when a peer resumes the request after a crash.

Logprobs are the log_softmax of the model's raw logits, before penalties, temperature and filtering
(what the model believes, as vLLM reports by default).

No host sync but one: what varies per row (bias entries, penalty entries, banned tokens, temperatures,
top_k/top_p/min_p, the rows that sample, the rows that want logprobs) is gathered on the host into one
int64 and one float32 block (transfer.py: pinned, copied without blocking), every edit is one vectorised
op over all rows, and what the step produced (ids, logprobs, top alternatives) reaches the host in one
transfer behind an event that `SampleOut.result()` waits on. A seeded row still costs its own generator
call (a few µs of host time, no sync): a shared counter-based stream would change every seeded text.
On CUDA with flashinfer, rows that are unseeded and have no min_p sample with its fused top-k/top-p
kernel (rejection sampling, no sort); elsewhere top-k takes `topk` candidates, and only top-p without
top-k sorts the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from services.scheduler.engine.transfer import DeviceResult, to_device
from shared.messages import SamplingParams

if TYPE_CHECKING:
    from services.scheduler.engine.grammar import SeqGrammar

_MIX1, _MIX2, _MASK63 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, (1 << 63) - 1


@dataclass(slots=True)
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


@dataclass
class _Plan:
    """What the host knows about a batch, as flat lists (one entry per edited logit, or per row)."""

    ints: dict[str, list[int]] = field(default_factory=dict)
    floats: dict[str, list[float]] = field(default_factory=dict)
    top_k_max: int = 0  # top-k/top-p candidates per row; the vocabulary size: sort it all
    modified: bool = False  # some row's logits are edited (they are copied first: logprobs are of raw ones)
    grammar: bool = False
    sampled: list[int] = field(default_factory=list)  # rows that are not greedy
    want: list[int] = field(default_factory=list)  # rows that want logprobs

    def add(self, kind: dict, name: str, values) -> None:
        kind.setdefault(name, []).extend(values)


@dataclass
class SampleOut:
    """A launched sampling step: `ids` stay on the device (the next step's inputs read them); the host
    gets them, and the logprobs, from one transfer."""

    ids: torch.Tensor  # [rows] int64, on the device
    want: list[int]  # rows that asked for logprobs
    top_n: list[int]  # their top_logprobs counts
    k: int  # top alternatives gathered per wanting row
    transfer: DeviceResult

    def result(self) -> SampleResult:
        lists = self.transfer.wait()
        ids = lists[0][:self.ids.shape[0]]
        rows = len(ids)
        lps: list[float | None] = [None] * rows
        tops: list[list[tuple[int, float]] | None] = [None] * rows
        if self.want:
            w, k = len(self.want), self.k
            top_i = lists[0][rows:]
            chosen, top_v = lists[1][:w], lists[1][w:]
            for j, i in enumerate(self.want):
                lps[i] = chosen[j]
                n = self.top_n[j]
                if n > 0:
                    tops[i] = list(zip(top_i[j * k:j * k + n], top_v[j * k:j * k + n], strict=True))
        return SampleResult(ids, lps, tops)


class Sampler:
    def __init__(self, eos_ids: set[int], device: torch.device | str = "cpu", seed: int | None = None,
                 flashinfer=None):
        self.eos_ids = sorted(eos_ids)
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self.row_generator = torch.Generator(self.device)
        # flashinfer's sampling kernels (CUDA only); None: torch alone
        self.fused = getattr(flashinfer, "sampling", None) if self.device.type == "cuda" else None

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
        return self.launch(logits, rows).result()

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleOut:
        """Queue the sampling of every row on the device; nothing here waits for it."""
        raw = logits.float()
        plan = self._plan(rows, raw.shape[-1])
        ints = _upload(plan.ints, torch.int64, raw.device)
        floats = _upload(plan.floats, torch.float32, raw.device)
        x = raw.clone() if plan.modified else raw
        self._edit(x, ints, floats)
        ints["top_k_max"] = plan.top_k_max  # type: ignore[assignment]  # a host int, not uploaded
        if plan.grammar:
            from services.scheduler.engine.grammar import apply_masks

            apply_masks(x, [r.grammar for r in rows])
        sampled = plan.sampled
        if sampled and len(sampled) == len(rows):
            ids = self._sample(x, rows, ints, floats)
        else:
            ids = x.argmax(-1)
            if sampled:
                chosen = self._sample(x.index_select(0, ints["sampled"]), [rows[i] for i in sampled], ints, floats)
                ids.index_copy_(0, ints["sampled"], chosen)
        return self._finish(raw, rows, ids, ints, plan.want)

    def _plan(self, rows: list[SampleRow], vocab: int) -> _Plan:
        plan = _Plan()
        ints, floats = plan.ints, plan.floats
        for i, r in enumerate(rows):  # one pass over the rows: this runs for every row of every step
            p = r.params
            if p.temperature > 0.0 and p.top_k != 1 and p.top_p > 0.0:  # not greedy (SamplingParams.greedy)
                plan.sampled.append(i)
            if p.logprobs or p.top_logprobs > 0:
                plan.want.append(i)
            if r.grammar is not None:
                plan.grammar = True
                plan.modified = plan.modified or r.grammar.active
            if not (p.logit_bias or p.min_tokens or p.repetition_penalty != 1.0 or p.presence_penalty
                    or p.frequency_penalty):
                continue
            plan.modified = plan.modified or _modified(r)
            if p.logit_bias:
                ids = [t for t in p.logit_bias if 0 <= t < vocab]
                plan.add(ints, "bias_row", [i] * len(ids))
                plan.add(ints, "bias_tok", ids)
                plan.add(floats, "bias_val", [p.logit_bias[t] for t in ids])
            if _penalized(p):
                self._plan_penalties(plan, i, r)
            if r.step < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_ids)
                banned = [t for t in banned if 0 <= t < vocab]
                plan.add(ints, "ban_row", [i] * len(banned))
                plan.add(ints, "ban_tok", banned)
        sampled = [(i, rows[i].params) for i in plan.sampled]
        if sampled and len(sampled) < len(rows):
            ints["sampled"] = [i for i, _ in sampled]
        if sampled:
            floats["temp"] = [p.temperature for _, p in sampled]
            if any(p.min_p > 0 for _, p in sampled):
                floats["min_p"] = [p.min_p for _, p in sampled]
            if any(0 < p.top_k < vocab for _, p in sampled) or any(p.top_p < 1.0 for _, p in sampled):
                ints["top_k"] = [p.top_k if 0 < p.top_k < vocab else vocab for _, p in sampled]
                floats["top_p"] = [p.top_p for _, p in sampled]
                top_p_alone = any(p.top_p < 1.0 and not 0 < p.top_k < vocab for _, p in sampled)
                plan.top_k_max = vocab if top_p_alone else max(k for k in ints["top_k"] if k < vocab)
        if plan.want and len(plan.want) < len(rows):
            ints["want"] = plan.want
        return plan

    @staticmethod
    def _plan_penalties(plan: _Plan, i: int, r: SampleRow) -> None:
        p, ints, floats = r.params, plan.ints, plan.floats
        if p.repetition_penalty != 1.0:  # HF/vLLM: over prompt and completion tokens
            seen = sorted(set(r.tokens))
            plan.add(ints, "rep_row", [i] * len(seen))
            plan.add(ints, "rep_tok", seen)
            plan.add(floats, "rep_pen", [p.repetition_penalty] * len(seen))
        completion = r.tokens[r.prompt_len:]
        if completion and (p.presence_penalty or p.frequency_penalty):  # OpenAI: completion only
            counts: dict[int, int] = {}
            for t in completion:
                counts[t] = counts.get(t, 0) + 1
            plan.add(ints, "pen_row", [i] * len(counts))
            plan.add(ints, "pen_tok", list(counts))
            plan.add(floats, "pen_count", [float(c) for c in counts.values()])
            plan.add(floats, "pen_freq", [p.frequency_penalty] * len(counts))
            plan.add(floats, "pen_pres", [p.presence_penalty] * len(counts))

    @staticmethod
    def _edit(x: torch.Tensor, ints: dict, floats: dict) -> None:
        """logit_bias, then repetition, frequency and presence penalties, then min_tokens bans: one
        vectorised op each over every row's entries (entries of one row never repeat a token)."""
        if "bias_row" in ints:
            x.index_put_((ints["bias_row"], ints["bias_tok"]), floats["bias_val"], accumulate=True)
        if "rep_row" in ints:
            at = (ints["rep_row"], ints["rep_tok"])
            vals, pen = x[at], floats["rep_pen"]
            x.index_put_(at, torch.where(vals > 0, vals / pen, vals * pen))
        if "pen_row" in ints:
            delta = floats["pen_freq"] * floats["pen_count"] + floats["pen_pres"]
            x.index_put_((ints["pen_row"], ints["pen_tok"]), -delta, accumulate=True)
        if "ban_row" in ints:
            x.index_put_((ints["ban_row"], ints["ban_tok"]), x.new_full((1,), float("-inf")))

    def _sample(self, x: torch.Tensor, rows: list[SampleRow], ints: dict, floats: dict) -> torch.Tensor:
        x = x / floats["temp"][:, None]
        if self.fused is not None and "min_p" not in floats and all(r.params.seed is None for r in rows):
            return self._sample_fused(x, ints, floats)
        mask = self._filter_mask(x, ints, floats)
        if mask is not None:
            x = x.masked_fill(mask, float("-inf"))
        probs = torch.softmax(x, -1)
        return (probs / self._noise(probs, rows)).argmax(-1)

    def _sample_fused(self, x: torch.Tensor, ints: dict, floats: dict) -> torch.Tensor:
        """flashinfer's kernels: sampling from softmax(x), after top-k then top-p on what top-k kept (the
        torch path's order), without sorting the vocabulary."""
        if "top_k" not in ints:
            out = self.fused.sampling_from_logits(x, deterministic=True, generator=self.generator)
        else:
            out = self.fused.top_k_top_p_sampling_from_logits(
                x, ints["top_k"].to(torch.int32), floats["top_p"], filter_apply_order="top_k_first",
                deterministic=True, generator=self.generator)
        return out.long()

    @staticmethod
    def _filter_mask(x: torch.Tensor, ints: dict, floats: dict) -> torch.Tensor | None:
        """True where top_k, top_p or min_p removes a token; per row, so rows never interact. top_k and
        top_p are computed on the candidates `topk` returns when every top-p row also has a top-k (top-p
        applies to what top-k kept); only top-p without top-k sorts the whole vocabulary."""
        vocab = x.shape[-1]
        mask = None
        if "min_p" in floats:
            probs = torch.softmax(x, -1)
            mask = probs < floats["min_p"][:, None] * probs.max(-1, keepdim=True).values
        if "top_k" not in ints:
            return mask
        top_k, top_p = ints["top_k"], floats["top_p"]
        k_max = ints["top_k_max"]
        if k_max < vocab:
            sorted_x, order = x.topk(k_max, dim=-1)
        else:
            sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(sorted_x.shape[-1], device=x.device)[None]
        drop = rank >= top_k[:, None]
        sorted_p = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), -1)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of strictly more likely tokens
        drop |= before > top_p[:, None]
        if k_max < vocab:
            # Tokens past the candidates are removed on rows with a top-k; the others (no top-k, and then
            # no top-p either, or the vocabulary would have been sorted) keep every token.
            filtered = x.new_ones(x.shape, dtype=torch.bool).scatter_(-1, order, drop)
            filtered &= (top_k < vocab)[:, None]
        else:
            filtered = torch.zeros_like(drop).scatter_(-1, order, drop)
        return filtered if mask is None else mask | filtered

    def _noise(self, probs: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                self.row_generator.manual_seed(row_seed(r.params.seed, r.index, r.step))
                noise[i].exponential_(generator=self.row_generator)
        return noise.clamp_(min=1e-30)  # a zero draw would turn a filtered token's 0/0 into NaN

    @staticmethod
    def _finish(raw: torch.Tensor, rows: list[SampleRow], ids: torch.Tensor, ints: dict, want: list[int]
                ) -> SampleOut:
        """The logprobs asked for, gathered on the device, and one transfer of everything to the host."""
        if not want:
            return SampleOut(ids, [], [], 0, DeviceResult([ids]))
        lp = torch.log_softmax(raw if len(want) == len(rows) else raw.index_select(0, ints["want"]), -1)
        chosen_ids = ids if len(want) == len(rows) else ids.index_select(0, ints["want"])
        chosen = lp.gather(-1, chosen_ids[:, None])[:, 0]
        top_n = [rows[i].params.top_logprobs for i in want]
        k = min(max(top_n), lp.shape[-1])
        if k > 0:
            top_v, top_i = lp.topk(k, -1)
            packed_i, packed_f = torch.cat([ids, top_i.reshape(-1)]), torch.cat([chosen, top_v.reshape(-1)])
        else:
            packed_i, packed_f = ids, chosen
        return SampleOut(ids, want, top_n, k, DeviceResult([packed_i, packed_f]))


def _upload(parts: dict[str, list], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Every list of the batch in one host-to-device transfer; device views by name."""
    if not parts:
        return {}
    names = list(parts)
    return dict(zip(names, to_device([parts[n] for n in names], dtype, device), strict=True))
