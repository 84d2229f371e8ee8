"""Paged attention in pure torch (the CPU backend, and the reference the CUDA backend is checked against).

Per layer: scatter the new K/V into their slots, gather each row's pages into a dense [B, kv, H, D]
tensor, and run `scaled_dot_product_attention` with an explicit mask. The mask is bottom-right
aligned: query i of a row with q_len new tokens and kv_len cached ones sees keys 0..kv_len-q_len+i.
SDPA's own `is_causal` is top-left aligned, which is wrong whenever a row already has cached tokens
(chunked prefill, prefix-cache hits, recomputed tails). Masks and gather indices are the same for
every layer, so `prepare` builds them once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from services.scheduler.engine.attention.metadata import AttnMetadata
from services.scheduler.engine.kv_cache import SCRATCH_PAGE, KVCache
from services.scheduler.engine.transfer import to_device


@dataclass
class _Part:
    """Rows [lo, hi) of the batch, gathered and masked together."""

    block_table: torch.Tensor  # [B, max_pages]
    max_kv: int
    mask: torch.Tensor  # [B, 1, Lq, max_kv] bool, True = attend
    gather_index: torch.Tensor | None = None  # [B * Hkv * max_kv] rows of the pool viewed as [-1, D]
    max_q: int = 1
    batch_idx: torch.Tensor | None = None  # [T] row of each token (prefill part)
    pos_in_q: torch.Tensor | None = None  # [T] index of each token in its row


class TorchPagedAttention:
    name = "torch"

    def __init__(self, kv: KVCache):
        self.kv = kv
        self.device = kv.k[0].device

    def prepare(self, meta: AttnMetadata) -> None:
        nd, rows = meta.num_decode, meta.num_rows
        meta.extra["decode"] = self._decode_part(meta, 0, nd) if nd else None
        meta.extra["prefill"] = self._prefill_part(meta, nd, rows) if rows > nd else None

    @staticmethod
    def _block_table(meta: AttnMetadata, lo: int, hi: int) -> np.ndarray:
        width = max(len(p) for p in meta.pages[lo:hi])
        table = np.full((hi - lo, width), SCRATCH_PAGE, dtype=np.int64)
        for i, p in enumerate(meta.pages[lo:hi]):
            table[i, :len(p)] = p
        return table

    def _gather_index(self, table: torch.Tensor, max_kv: int) -> torch.Tensor:
        """Row (slot * Hkv + head) of every [head, key] of every row, so that one index_select of
        the NHD pool yields K as [B, Hkv, kv, D] contiguous, the layout batched matmuls want without
        another copy. Keys past a row's length read stale or scratch slots; the mask hides them."""
        ps, heads = self.kv.page_size, self.kv.shape.num_kv_heads
        offsets = torch.arange(ps, device=self.device)
        slots = (table[:, :, None] * ps + offsets).view(table.shape[0], -1)[:, :max_kv]
        head = torch.arange(heads, device=self.device)
        return (slots[:, None, :] * heads + head[None, :, None]).view(-1)

    def _decode_part(self, meta: AttnMetadata, lo: int, hi: int) -> _Part:
        host = self._block_table(meta, lo, hi)
        table, kv_lens = to_device([host.reshape(-1), meta.kv_lens[lo:hi]], torch.int64, self.device)
        table = table.view(host.shape)
        max_kv = max(meta.kv_lens[lo:hi])
        mask = torch.arange(max_kv, device=self.device)[None] < kv_lens[:, None]
        return _Part(table, max_kv, mask[:, None, None], self._gather_index(table, max_kv))

    def _prefill_part(self, meta: AttnMetadata, lo: int, hi: int) -> _Part:
        q_lens, kv_lens = meta.q_lens[lo:hi], meta.kv_lens[lo:hi]
        max_q, max_kv = max(q_lens), max(kv_lens)
        q = np.asarray(q_lens, dtype=np.int64)
        batch_idx = np.repeat(np.arange(hi - lo), q)
        pos_in_q = np.arange(len(batch_idx)) - (np.cumsum(q) - q)[batch_idx]
        host = self._block_table(meta, lo, hi)
        table, ql, kl, batch_idx, pos_in_q = to_device([host.reshape(-1), q_lens, kv_lens, batch_idx, pos_in_q],
                                                       torch.int64, self.device)
        table = table.view(host.shape)
        qi = torch.arange(max_q, device=self.device)[None, :, None]
        ki = torch.arange(max_kv, device=self.device)[None, None, :]
        # bottom-right causal; padded query rows (qi >= q_len) still see key 0, so no row is all -inf
        kl, ql = kl[:, None, None], ql[:, None, None]
        mask = (ki <= kl - ql + qi) & (ki < kl)
        return _Part(table, max_kv, mask[:, None], self._gather_index(table, max_kv), max_q, batch_idx, pos_in_q)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scaling: float,
                meta: AttnMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (new tokens, after RoPE) -> attention output [T, Hq, D]."""
        kp, vp = self.kv.k[layer], self.kv.v[layer]
        heads, dim = kp.shape[-2:]
        kp.view(-1, heads, dim)[meta.slot_mapping] = k.to(kp.dtype)
        vp.view(-1, heads, dim)[meta.slot_mapping] = v.to(vp.dtype)
        decode, prefill = meta.extra["decode"], meta.extra["prefill"]
        if prefill is None:
            return self._decode(q, kp, vp, decode, scaling)
        if decode is None:
            return self._prefill(q, kp, vp, prefill, scaling)
        nd = meta.num_decode
        return torch.cat([self._decode(q[:nd], kp, vp, decode, scaling),
                          self._prefill(q[nd:], kp, vp, prefill, scaling)])

    @staticmethod
    def _gather(pool: torch.Tensor, part: _Part) -> torch.Tensor:
        """[B, Hkv, max_kv, D], contiguous (index_select is ~3x faster than advanced indexing on CPU)."""
        heads, dim = pool.shape[-2:]
        rows = part.block_table.shape[0]
        return pool.view(-1, dim).index_select(0, part.gather_index).view(rows, heads, part.max_kv, dim)

    def _decode(self, q, kp, vp, part: _Part, scaling: float) -> torch.Tensor:
        k, v = self._gather(kp, part), self._gather(vp, part)
        if q.dtype != torch.float32 and q.device.type == "cpu":
            return _decode_grouped(q, k, v, part.mask, scaling)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=part.mask, scale=scaling,
                                           enable_gqa=True)
        return o.squeeze(2)

    def _prefill(self, q, kp, vp, part: _Part, scaling: float) -> torch.Tensor:
        rows = part.block_table.shape[0]
        if rows == 1:
            padded = q.unsqueeze(0)
        else:
            padded = q.new_zeros(rows, part.max_q, *q.shape[1:])
            padded[part.batch_idx, part.pos_in_q] = q
        o = F.scaled_dot_product_attention(padded.transpose(1, 2), self._gather(kp, part),
                                           self._gather(vp, part), attn_mask=part.mask, scale=scaling,
                                           enable_gqa=True)
        o = o.transpose(1, 2)
        return o[0] if rows == 1 else o[part.batch_idx, part.pos_in_q]


def _decode_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    scaling: float) -> torch.Tensor:
    """One-token attention as two batched matmuls per KV head group, softmax in fp32.

    On CPU, SDPA with a one-token query in bf16/fp16 takes a slow path (~5x slower than this for
    Qwen3-0.6B's shapes); fp32 stays on SDPA, which is faster there.
    """
    rows, heads, dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.reshape(rows, kv_heads, heads // kv_heads, dim)  # q head h reads kv head h // group
    scores = torch.matmul(grouped, k.transpose(-1, -2)).float() * scaling
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(rows, heads, dim)
