"""One metadata object describes a step's packed batch to every attention backend.

Rows (one per scheduled sequence) are ordered decodes first (exactly one new token each), then
prefill/extend rows, so a backend can run the two parts with different kernels. Token t of the packed
batch belongs to row `batch_idx[t]` and is written to KV slot `slot_mapping[t]` (page * page_size +
offset). The CSR page table (kv_indptr, kv_indices, kv_last_page_len) and qo_indptr follow
flashinfer's conventions, so the CUDA backend hands them to its wrappers unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from services.scheduler.engine.transfer import to_device


@dataclass(slots=True)
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
    num_rows: int = field(init=False)  # rows (sequences) of the step, read by every backend's prepare

    def __post_init__(self) -> None:
        self.num_rows = len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])


@dataclass
class HostArrays:
    """A batch's metadata as host arrays (flashinfer's CSR conventions), built with vectorised code."""

    num_decode: int
    q_lens: list[int]
    kv_lens: list[int]
    qo_indptr: np.ndarray  # [B+1] int32
    kv_indptr: np.ndarray  # [B+1] int32, in pages
    kv_indices: np.ndarray  # [kv_indptr[-1]] int32
    kv_last_page_len: np.ndarray  # [B] int32
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    pages: list[list[int]]


def host_arrays(rows: list[RowSpec], page_size: int) -> HostArrays:
    """The metadata of a batch on the host; rows must already be ordered decodes first."""
    q_lens = [r.num_new for r in rows]
    num_decode = 0
    while num_decode < len(rows) and q_lens[num_decode] == 1:
        num_decode += 1
    if any(q == 1 for q in q_lens[num_decode:]) or any(q < 1 for q in q_lens):
        raise ValueError("rows must be ordered: one-token rows first, and every row computes a token")
    starts = np.fromiter((r.start for r in rows), np.int64, len(rows))
    q = np.asarray(q_lens, dtype=np.int64)
    kv = starts + q
    used = (kv + page_size - 1) // page_size
    have = np.fromiter((len(r.pages) for r in rows), np.int64, len(rows))
    if (used > have).any():
        i = int(np.argmax(used > have))
        raise ValueError(f"row needs {used[i]} pages for {kv[i]} tokens but has {have[i]}")
    kv_indptr = _indptr(used)
    total = int(kv_indptr[-1])
    indices = np.fromiter(chain.from_iterable(r.pages[:u] for r, u in zip(rows, used.tolist(), strict=True)),
                          np.int32, total)
    qo_indptr = _indptr(q)
    row_of = np.repeat(np.arange(len(rows)), q)  # the row of each packed token
    positions = np.arange(int(qo_indptr[-1]), dtype=np.int64) - qo_indptr[:-1][row_of] + starts[row_of]
    page = indices[kv_indptr[:-1][row_of] + positions // page_size].astype(np.int64)
    return HostArrays(num_decode, q_lens, kv.tolist(), qo_indptr, kv_indptr, indices,
                      (kv - (used - 1) * page_size).astype(np.int32), positions,
                      page * page_size + positions % page_size,
                      [r.pages[:u] for r, u in zip(rows, used.tolist(), strict=True)])


def build_metadata(rows: list[RowSpec], page_size: int, device: torch.device | str) -> AttnMetadata:
    """Build the metadata of a batch; rows must already be ordered decodes first. The device tensors
    arrive in two transfers (int32 page ids, int64 slots and positions)."""
    h = host_arrays(rows, page_size)
    device = torch.device(device)
    (kv_indices,) = to_device([h.kv_indices], torch.int32, device)
    slots, positions = to_device([h.slot_mapping, h.positions], torch.int64, device)
    return AttnMetadata(
        page_size=page_size,
        num_decode=h.num_decode,
        q_lens=h.q_lens,
        kv_lens=h.kv_lens,
        qo_indptr=torch.from_numpy(h.qo_indptr),
        kv_indptr=torch.from_numpy(h.kv_indptr),
        kv_last_page_len=torch.from_numpy(h.kv_last_page_len),
        kv_indices=kv_indices,
        slot_mapping=slots,
        positions=positions,
        pages=h.pages,
    )


def _indptr(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return out
