"""Launching one step of the paged engine: the scheduled batch's packed forward and its sampling, queued on the
device with nothing waiting for it (paged.py's docstring tells how steps overlap; resolve.py reads the results).

The sequences that sample get their token appended as UNRESOLVED; a row whose input is the token of the step
still in flight reads it on the device (cuda_graph.py `DeviceTokens`). Prefill-only requests (pooling.py) end
here, their results on their way to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.scheduler.engine.attention import RowSpec
from services.scheduler.engine.cuda_graph import DeviceTokens
from services.scheduler.engine.model_runner import ModelRunner
from services.scheduler.engine.pooling import add_pooled, hidden_rows, split_pooled
from services.scheduler.engine.sampling import SampleOut, Sampler, SampleRow
from services.scheduler.engine.scheduler import BatchScheduler, Scheduled
from services.scheduler.engine.sequence import UNRESOLVED, Seq
from services.scheduler.engine.transfer import DeviceResult, to_device


@dataclass
class InFlight:
    """A launched step: the sequences it samples for, in the sampler's row order, where each one's token
    goes, and the epoch each had (a preemption since withdraws the token)."""

    seqs: list[Seq]
    token_index: list[int]
    epochs: list[int]
    out: SampleOut | None  # None: no sequence samples (the step only ended prefill-only requests)
    deferred: list[Seq]  # sequences whose pages are named once the previous step's tokens are known
    pooled: list[Seq]  # prefill-only requests the step ended (pooling.py), their results in `pooled_out`
    pooled_out: DeviceResult | None = None

    def results(self) -> list[DeviceResult]:
        return [r for r in (self.out.transfer if self.out is not None else None, self.pooled_out) if r is not None]


class StepLauncher:
    """Queues a batch's forward and sampling on the device. `adapters_on`: the engine has LoRA slots (a step
    whose rows are all on the base model still runs without the LoRA ops)."""

    def __init__(self, scheduler: BatchScheduler, runner: ModelRunner, sampler: Sampler, max_context: int,
                 adapters_on: bool):
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.max_context = max_context
        self.adapters_on = adapters_on

    def launch(self, batch: list[Scheduled], previous: InFlight | None) -> InFlight:
        """Queue the batch's forward and sampling on the device and append each sampling sequence's token
        as UNRESOLVED; nothing here waits for the device. `previous`: the step still in flight."""
        # the sequences that sample (before _forward records the batch as computed)
        sampling = [sc.seq for sc in batch if sc.seq.num_computed + sc.num_new == len(sc.seq.tokens)]
        logits, deferred = self._forward(batch, previous)
        pooled: list[Seq] = []
        pooled_out = None
        if any(s.pooling is not None for s in sampling):
            sampling, logits, pooled, pooled_out = split_pooled(sampling, logits)
        self._end_pooled(pooled)
        if not sampling:
            return InFlight([], [], [], None, deferred, pooled, pooled_out)
        seqs, logit_rows = self._fork(sampling)
        rows = [SampleRow(s.req.params, s.index, len(s.tokens) - s.prompt_len, s.tokens, s.prompt_len, s.grammar)
                for s in seqs]
        epochs = [s.epoch for s in seqs]
        if len(logit_rows) != logits.shape[0]:
            (index,) = to_device([logit_rows], torch.int64, logits.device)
            logits = logits.index_select(0, index)
        out = self.sampler.launch(logits, rows)
        at, context = [], self.max_context
        for k, seq in enumerate(seqs):
            tokens = seq.tokens
            tokens.append(UNRESOLVED)
            seq.unresolved += 1
            seq.pending_row = k
            n = len(tokens)
            seq.final = n - seq.prompt_len >= seq.max_tokens or n >= context
            at.append(n - 1)
        return InFlight(seqs, at, epochs, out, deferred, pooled, pooled_out)

    def _fork(self, sampling: list[Seq]) -> tuple[list[Seq], list[int]]:
        """The sequences that sample and the logits row of each: n > 1, the siblings sample from their parent's
        logits."""
        if not any(seq.forks for seq in sampling):
            return sampling, list(range(len(sampling)))
        seqs, logit_rows = [], []
        for j, seq in enumerate(sampling):
            group = [seq]
            if seq.forks:
                group += self.scheduler.fork(seq, seq.forks)
                seq.forks = 0
            seqs.extend(group)
            logit_rows.extend([j] * len(group))
        return seqs, logit_rows

    def _end_pooled(self, pooled: list[Seq]) -> None:
        """The prefill-only sequences' pages go back once their forward is launched (the device runs the steps in
        order, so a later step that takes a page writes it after this one has read it); nothing in between takes
        a page."""
        for seq in pooled:
            seq.pool_sum = None
            self.scheduler.finish(seq)

    def _forward(self, batch: list[Scheduled], previous: InFlight | None) -> tuple[torch.Tensor, list[Seq]]:
        """Logits of the sampling rows, and the sequences whose new pages cannot be named yet; a sequence
        that scores its prompt also gets the logits of each prompt position it computes (they score the next
        prompt token)."""
        rows, ids, sample_idx, scored = [], [], [], []
        patch_pos, patch_rows = [], []
        deferred, pooled = [], []  # pooled: (row, its first packed index) of the prefill-only rows
        for sc in batch:
            seq, n = sc.seq, sc.num_new
            c, tokens = seq.num_computed, seq.tokens
            rows.append(RowSpec(seq.pages, c, n))
            first = len(ids)
            if seq.pooling is not None:
                pooled.append((sc, first))
            if n == 1:
                ids.append(tokens[c])
            else:
                ids.extend(tokens[c:c + n])
            ends = c + n == len(tokens)
            if seq.unresolved:
                deferred.append(seq)
                if ends:
                    assert seq.unresolved == 1 and ids[-1] == UNRESOLVED and previous is not None
                    patch_pos.append(len(ids) - 1)  # read on the device from the step in flight
                    patch_rows.append(seq.pending_row)
                    ids[-1] = 0
            if ends:  # it samples
                sample_idx.append(len(ids) - 1)
            if seq.req.params.prompt_logprobs is not None and seq.scores_prompt:
                positions = range(seq.num_computed, min(seq.num_computed + sc.num_new, seq.prompt_len - 1))
                scored.append((seq, [first + p - seq.num_computed for p in positions], positions))
        extra = [i for _, idx, _ in scored for i in idx]
        pending = DeviceTokens(patch_pos, patch_rows, previous.out.ids) if patch_pos else None
        logits = self._run_model(rows, ids, sample_idx + extra, pending, batch=batch, pooled=pooled)
        if scored:
            score_prompts(scored, logits[len(sample_idx):])
        self.scheduler.computed(batch)
        return logits[:len(sample_idx)], deferred

    def _run_model(self, rows: list[RowSpec], ids: list[int], keep: list[int], pending: DeviceTokens | None, *,
                   batch: list[Scheduled], pooled: list[tuple[Scheduled, int]]) -> torch.Tensor:
        """The packed forward's logits at `keep`; the embeddings among the rows (`pooled`) add the hidden states
        they pool to their sequences, on the device."""
        adapters = None  # the rows' adapter slots, when some row has one (a base-only step runs the model as is)
        if self.adapters_on and any(sc.seq.adapter_slot for sc in batch):
            adapters = [sc.seq.adapter_slot for sc in batch]
        hidden_idx, spans = hidden_rows(pooled) if pooled else ([], [])
        if not hidden_idx:
            return self.runner.forward(rows, ids, keep, pending, adapters)
        logits, hidden = self.runner.forward_hidden(rows, ids, keep, hidden_idx, device_tokens=pending,
                                                     adapters=adapters)
        add_pooled(spans, hidden)
        return logits


def score_prompts(scored: list, logits: torch.Tensor) -> None:
    """Each scored prompt position's logprob of the next prompt token and its top alternatives (`prompt_logprobs`)."""
    lp = torch.log_softmax(logits, -1)
    at = 0
    for seq, idx, positions in scored:
        rows = lp[at:at + len(idx)]
        at += len(idx)
        k = min(seq.req.params.prompt_logprobs or 0, rows.shape[-1])
        nxt = torch.tensor([seq.tokens[p + 1] for p in positions], device=rows.device, dtype=torch.long)
        chosen = rows.gather(-1, nxt[:, None])[:, 0].tolist()
        tops = rows.topk(k, -1) if k else None
        for j, p in enumerate(positions):  # by position: a preempted prefill scores the same again
            top = list(zip(tops.indices[j].tolist(), tops.values[j].tolist(), strict=True)) if tops else []
            seq.scores[p] = (chosen[j], top)
