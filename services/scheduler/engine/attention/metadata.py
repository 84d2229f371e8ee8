"""One metadata object describes a step's packed batch to every attention backend.

Rows (one per scheduled sequence) are ordered decodes first (exactly one new token each), then
prefill/extend rows, so a backend can run the two parts with different kernels. Token t of the packed
batch belongs to row `batch_idx[t]` and is written to KV slot `slot_mapping[t]` (page * page_size +
offset). The CSR page table (kv_indptr, kv_indices, kv_last_page_len) and qo_indptr follow
flashinfer's conventions, so the CUDA backend hands them to its wrappers unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RowSpec:
    """One scheduled sequence: its page table, tokens already in KV, and tokens computed now."""

    pages: list[int]
    start: int  # tokens already in the cache (positions 0..start-1)
    num_new: int

    @property
    def kv_len(self) -> int:
        return self.start + self.num_new


@dataclass
class AttnMetadata:
    page_size: int
    num_decode: int  # leading rows with one new token each; they are also the leading tokens
    q_lens: list[int]
    kv_lens: list[int]
    # host (CPU, int32) tensors, as flashinfer's plan() wants them
    qo_indptr: torch.Tensor  # [B+1]
    kv_indptr: torch.Tensor  # [B+1] in pages
    kv_last_page_len: torch.Tensor  # [B], 1..page_size
    # device tensors
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32 page ids
    slot_mapping: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    pages: list[list[int]] = field(repr=False, default_factory=list)
    extra: dict = field(default_factory=dict)  # what a backend prepares once per step

    @property
    def num_rows(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])


def build_metadata(rows: list[RowSpec], page_size: int, device: torch.device | str) -> AttnMetadata:
    """Build the metadata of a batch; rows must already be ordered decodes first."""
    num_decode = 0
    while num_decode < len(rows) and rows[num_decode].num_new == 1:
        num_decode += 1
    if any(r.num_new == 1 for r in rows[num_decode:]) or any(r.num_new < 1 for r in rows):
        raise ValueError("rows must be ordered: one-token rows first, and every row computes a token")
    q_lens = [r.num_new for r in rows]
    kv_lens = [r.kv_len for r in rows]
    pages_used = [-(-n // page_size) for n in kv_lens]
    slots: list[int] = []
    positions: list[int] = []
    indices: list[int] = []
    for r, used in zip(rows, pages_used, strict=True):
        if used > len(r.pages):
            raise ValueError(f"row needs {used} pages for {r.kv_len} tokens but has {len(r.pages)}")
        for pos in range(r.start, r.kv_len):
            slots.append(r.pages[pos // page_size] * page_size + pos % page_size)
        positions.extend(range(r.start, r.kv_len))
        indices.extend(r.pages[:used])
    last = [n - (u - 1) * page_size for n, u in zip(kv_lens, pages_used, strict=True)]
    return AttnMetadata(
        page_size=page_size,
        num_decode=num_decode,
        q_lens=q_lens,
        kv_lens=kv_lens,
        qo_indptr=_indptr(q_lens),
        kv_indptr=_indptr(pages_used),
        kv_last_page_len=torch.tensor(last, dtype=torch.int32),
        kv_indices=torch.tensor(indices, dtype=torch.int32).to(device, non_blocking=True),
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True),
        positions=torch.tensor(positions, dtype=torch.int64).to(device, non_blocking=True),
        pages=[r.pages[:u] for r, u in zip(rows, pages_used, strict=True)],
    )


def _indptr(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out
