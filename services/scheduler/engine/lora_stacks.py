"""The LoRA adapters' weights on the device and the ops that apply them (lora.py's docstring: "Weights" and
"Compute"): stacked tensors allocated once, a slot per resident adapter, and the target projections' `forward`
replaced, for the steps that carry adapter rows, by one that adds each row's delta.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from services.scheduler.engine.lora_weights import HostAdapter, LoraLayout, stack_bytes, stack_rank


@dataclass
class LoraBatch:
    """How a step's packed tokens map onto slots. Grouped: `groups` of (slot, token rows, rank), base rows
    in none. Segments: `seg_indptr` / `weight_indices` device tensors of `segments` runs of rows."""

    targets: frozenset[str]
    groups: list[tuple[int, slice | torch.Tensor, int]] = field(default_factory=list)
    seg_indptr: torch.Tensor | None = None
    weight_indices: torch.Tensor | None = None
    segments: int = 0


class LoraStacks:
    """A `[layers, slots, R, in]` A and a `[layers, slots, out, R]` B per target projection (slot 0 stays zero,
    the base model's), and the patched projections' forwards. `segment_gemm`: flashinfer's SegmentGEMMWrapper,
    or None for grouped torch matmuls."""

    def __init__(self, layout: LoraLayout, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 *, segment_gemm=None):
        self.layout = layout
        R, L, slots = stack_rank(max_rank), layout.num_layers, max_loras + 1
        self.a = {t: torch.zeros(L, slots, R, s.in_features, dtype=dtype, device=device)
                  for t, s in layout.shapes.items()}
        self.b = {t: torch.zeros(L, slots, s.out_features, R, dtype=dtype, device=device)
                  for t, s in layout.shapes.items()}
        self.nbytes = stack_bytes(layout, max_loras, max_rank, dtype)
        self.segment_gemm = segment_gemm
        self.batch: LoraBatch | None = None  # the step being run, read by the patched projections
        self._forwards = {(t, i): self._lora_forward(m, t, i) for t, ms in layout.modules.items()
                          for i, m in enumerate(ms)}

    def write(self, slot: int, host: HostAdapter) -> None:
        """Copy a read adapter into `slot`, zeros where it targets nothing (queued on the device's stream, behind
        any step in flight)."""
        for target in self.layout.shapes:
            if target in host.a:
                self.a[target][:, slot].copy_(host.a[target], non_blocking=True)
                self.b[target][:, slot].copy_(host.b[target], non_blocking=True)
            else:
                self.a[target][:, slot].zero_()
                self.b[target][:, slot].zero_()

    @contextmanager
    def applied(self, batch: LoraBatch):
        """Run the forwards inside with `batch`'s deltas added to the target projections' outputs: their
        `forward` is an instance attribute for that long (the class's otherwise, so base steps pay nothing)."""
        patched = [(m, self._forwards[(t, i)], m.__dict__.get("forward"))
                   for t in batch.targets for i, m in enumerate(self.layout.modules[t])]
        self.batch = batch
        for module, fn, _ in patched:
            module.forward = fn
        try:
            yield
        finally:
            for module, _, before in patched:
                if before is None:
                    del module.forward
                else:
                    module.forward = before
            self.batch = None

    def _lora_forward(self, module: torch.nn.Linear, target: str, layer: int):
        linear = torch.nn.functional.linear

        def forward(x: torch.Tensor) -> torch.Tensor:
            out = linear(x, module.weight, module.bias)
            batch = self.batch
            assert batch is not None
            flat_x = x.reshape(-1, x.shape[-1])
            flat_out = out.view(-1, out.shape[-1])
            a, b = self.a[target][layer], self.b[target][layer]
            if batch.seg_indptr is not None:
                gemm, n = self.segment_gemm, batch.segments
                h = gemm.run(flat_x.contiguous(), a, n, True, seg_indptr=batch.seg_indptr,
                             weight_indices=batch.weight_indices)
                flat_out += gemm.run(h, b, n, True, seg_indptr=batch.seg_indptr, weight_indices=batch.weight_indices)
                return out
            for slot, rows, rank in batch.groups:
                if not rank:
                    continue
                if isinstance(rows, slice):
                    flat_out[rows] += (flat_x[rows] @ a[slot, :rank].T) @ b[slot, :, :rank].T
                else:
                    delta = (flat_x.index_select(0, rows) @ a[slot, :rank].T) @ b[slot, :, :rank].T
                    flat_out.index_add_(0, rows, delta)
            return out

        return forward
