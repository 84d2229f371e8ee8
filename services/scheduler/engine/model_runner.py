"""Runs a transformers model on a packed batch with paged attention.

All scheduled tokens of a step form one sequence of length T (batch 1) with per-token position ids;
transformers' own decoder code runs unchanged, with attention routed to `rsinfer_paged`, and logits
are computed only at each sampling row's last token (`logits_to_keep` with explicit indices, so a
model's own logit scaling applies). This serves every decoder-only architecture whose attention goes
through transformers' AttentionInterface; others are refused at load with the reason.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from services.scheduler.engine import attention
from services.scheduler.engine.attention import AttentionBackend, ForwardContext, RowSpec, build_metadata
from services.scheduler.engine.cuda_graph import DeviceTokens
from services.scheduler.engine.tp_shard import output_vocab
from services.scheduler.engine.transfer import to_device

if TYPE_CHECKING:
    from services.scheduler.engine.lora import LoraManager
    from services.scheduler.engine.tp_group import TensorParallelGroup


class ModelRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, page_size: int):
        attention.register()
        self.model = model.eval()
        self.backend = backend
        self.page_size = page_size
        self.device = next(model.parameters()).device
        model.config._attn_implementation = attention.ATTN_NAME
        self.vocab_size = output_vocab(model)
        self.graphs = None  # DecodeGraphs, when CUDA graphs are on
        self.lora: LoraManager | None = None  # LoRA adapters' slots and ops, when --max-loras is set
        self.tp: TensorParallelGroup | None = None  # rank 0 of a tensor-parallel group: each step is broadcast

    @torch.inference_mode()
    def forward(self, rows: list[RowSpec], input_ids: list[int], sample_idx: list[int],
                device_tokens: DeviceTokens | None = None, adapters: list[int] | None = None) -> torch.Tensor:
        """Run the packed batch; return fp32 logits [len(sample_idx), vocab] of the given token indices.
        `device_tokens`: inputs that are still on the device (an overlapped step's sampled ids). `adapters`:
        each row's LoRA slot (lora.py), or None for a step of the base model alone, which runs no LoRA op.

        With CUDA graphs, the leading one-token rows replay a graph and the prompt chunks after them run as
        an eager forward of their own."""
        nd = 0
        while nd < len(rows) and rows[nd].num_new == 1:
            nd += 1
        decode_adapters = _part(adapters, 0, nd)
        if self.graphs is None or nd == 0 or not self.graphs.fits(nd, decode_adapters is not None):
            return self._eager(rows, input_ids, sample_idx, device_tokens, adapters)
        patches = device_tokens.shifted(0, nd) if device_tokens is not None else None
        decode = self.graphs.run(rows[:nd], input_ids[:nd], patches, decode_adapters)
        if nd == len(rows):
            return decode if sample_idx == list(range(nd)) else decode[self._index(sample_idx)]
        tail = [i - nd for i in sample_idx if i >= nd]
        patches = device_tokens.shifted(nd, len(input_ids)) if device_tokens is not None else None
        prefill = self._eager(rows[nd:], input_ids[nd:], tail, patches, _part(adapters, nd, len(rows)))
        # rows of cat(decode, prefill) in sample_idx order
        order, seen_tail = [], 0
        for i in sample_idx:
            if i < nd:
                order.append(i)
            else:
                order.append(nd + seen_tail)
                seen_tail += 1
        both = torch.cat([decode, prefill])
        return both if order == list(range(both.shape[0])) else both[self._index(order)]

    @torch.inference_mode()
    def forward_hidden(self, rows: list[RowSpec], input_ids: list[int], sample_idx: list[int], hidden_idx: list[int],
                       *, device_tokens: DeviceTokens | None = None, adapters: list[int] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, and the final hidden states (after the model's last norm) of the token indices `hidden_idx`
        (pooling.py); always eager (a CUDA graph keeps no hidden states)."""
        captured: list[torch.Tensor] = []

        def keep(_module, _args, out) -> None:
            captured.append(out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])

        hook = self.model.get_decoder().register_forward_hook(keep)
        try:
            logits = self._eager(rows, input_ids, sample_idx, device_tokens, adapters)
        finally:
            hook.remove()
        return logits, captured[-1][0].index_select(0, self._index(hidden_idx)).float()

    def _index(self, idx: list[int]) -> torch.Tensor:
        (t,) = to_device([idx], torch.int64, self.device)
        return t

    def _eager(self, rows: list[RowSpec], input_ids: list[int], sample_idx: list[int],
               device_tokens: DeviceTokens | None, adapters: list[int] | None = None) -> torch.Tensor:
        meta = build_metadata(rows, self.page_size, self.device)
        self.backend.prepare(meta)
        parts = [input_ids, sample_idx]
        if device_tokens is not None:
            parts += [device_tokens.positions, device_tokens.rows]
        ids, keep, *patch = to_device(parts, torch.int64, self.device)
        if device_tokens is not None:
            ids.index_copy_(0, patch[0], device_tokens.source.index_select(0, patch[1]))
        lora = contextlib.nullcontext()
        if adapters is not None and self.lora is not None:
            lora = self.lora.applied(self.lora.step_batch(adapters, meta.q_lens))
        if self.tp is None:
            with lora:
                return self._call(meta, ids, keep)
        try:  # every rank runs this forward: they learn its inputs first
            self.tp.publish(rows, ids, keep)
            logits = self._call(meta, ids, keep)
        except Exception as exc:  # a collective failed or timed out: the ranks no longer agree
            self.tp.fail(exc)
        self.tp.done()
        return logits

    @torch.inference_mode()
    def run_packed(self, rows: list[RowSpec], ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """A tensor-parallel worker rank's part of the step rank 0 broadcast (tp_worker.py)."""
        meta = build_metadata(rows, self.page_size, self.device)
        self.backend.prepare(meta)
        return self._call(meta, ids, keep)

    def _call(self, meta, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids[None], position_ids=meta.positions[None], use_cache=False,
                         logits_to_keep=keep, rsinfer_ctx=ForwardContext(self.backend, meta))
        return out.logits[0].float()


def _part(adapters: list[int] | None, lo: int, hi: int) -> list[int] | None:
    """The adapter slots of rows [lo, hi), or None where those rows are all on the base model; a list of base
    rows alone (the warm-up's) runs the LoRA ops on every part."""
    if adapters is None:
        return None
    part = adapters[lo:hi]
    return part if any(part) or not any(adapters) else None
