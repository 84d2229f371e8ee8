"""Paged attention on CUDA through flashinfer's paged prefill/decode wrappers (flashinfer-python 0.7.x).

`import flashinfer` happens only here, when the CUDA backend is built: it is an optional extra
(`pip install rsinfer[gpu]`) and a CPU-only process never loads it. One plan per step per wrapper
(host-side indptr/last_page_len avoid a device sync in plan), then one run per layer. Prefill uses
`causal=True`, which flashinfer aligns bottom-right (query i sees kv_len - q_len + i), as chunked
prefill and prefix hits need. Decode rows (one new token) go to the decode wrapper.

Untested on a GPU in this repository's CI (no GPU there); the metadata it consumes is unit-tested on CPU.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from services.scheduler.engine.attention.metadata import AttnMetadata
from services.scheduler.engine.kv_cache import KVCache

log = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 << 20
# Packages of prebuilt kernels that flashinfer uses by itself when installed at its own version
# (deploy/Dockerfile's cuda variant installs them); kernels they lack are compiled on first use.
PREBUILT_PACKAGES = ("flashinfer_jit_cache", "flashinfer_cubin")


def prebuilt_kernel_packages() -> list[str]:
    return [name for name in PREBUILT_PACKAGES if importlib.util.find_spec(name) is not None]


class FlashInferPagedAttention:
    name = "flashinfer"

    def __init__(self, kv: KVCache, num_qo_heads: int, num_kv_heads: int, head_dim: int, scaling: float,
                 dtype: torch.dtype):
        import flashinfer  # the optional GPU extra; never imported on CPU

        self.flashinfer = flashinfer
        prebuilt = prebuilt_kernel_packages()
        log.info("flashinfer %s, prebuilt kernels: %s; others compile on first use (the warm-up) into %s",
                 getattr(flashinfer, "__version__", "?"), ", ".join(prebuilt) or "none",
                 os.environ.get("FLASHINFER_WORKSPACE_BASE", "~") + "/.cache/flashinfer")
        self.kv = kv
        self.device = kv.k[0].device
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.scaling = scaling
        self.dtype = dtype
        # Zeroed, not torch.empty: flashinfer's decode wrappers document that their float workspace must be
        # zero-initialised (kernels read parts of it before writing them); the graph wrappers share it.
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        # Tensor cores pay off for decode only with wide query groups (mini-sglang uses GQA >= 4).
        self.use_tensor_cores = num_qo_heads // num_kv_heads >= 4
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores)

    def prepare(self, meta: AttnMetadata, decode_wrapper=None) -> None:
        """Plan both wrappers for this step (outside any CUDA graph; `decode_wrapper` for a replay)."""
        nd, rows = meta.num_decode, meta.num_rows
        hq, hkv, dim = self.heads
        ps = self.kv.page_size
        if nd:
            split = int(meta.kv_indptr[nd])
            (decode_wrapper or self.decode_wrapper).plan(
                meta.kv_indptr[:nd + 1], meta.kv_indices[:split], meta.kv_last_page_len[:nd],
                hq, hkv, dim, ps, sm_scale=self.scaling, q_data_type=self.dtype, kv_data_type=self.dtype)
        if rows > nd:
            qo, kvp = sub_indptr(meta.qo_indptr, nd), sub_indptr(meta.kv_indptr, nd)
            self.prefill_wrapper.plan(
                qo, kvp, meta.kv_indices[int(meta.kv_indptr[nd]):], meta.kv_last_page_len[nd:],
                hq, hkv, dim, ps, causal=True, sm_scale=self.scaling,
                q_data_type=self.dtype, kv_data_type=self.dtype)
        meta.extra["decode_wrapper"] = decode_wrapper or self.decode_wrapper

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scaling: float,
                meta: AttnMetadata) -> torch.Tensor:
        kc, vc = self.kv.k[layer], self.kv.v[layer]
        _, hkv, dim = self.heads
        kc.view(-1, hkv, dim)[meta.slot_mapping] = k
        vc.view(-1, hkv, dim)[meta.slot_mapping] = v
        q = q.contiguous()
        nd, rows = meta.num_decode, meta.num_rows
        decode = meta.extra["decode_wrapper"]
        if nd == rows:
            return decode.run(q, (kc, vc))
        if nd == 0:
            return self.prefill_wrapper.run(q, (kc, vc))
        out = torch.empty_like(q)
        out[:nd] = decode.run(q[:nd], (kc, vc))
        out[nd:] = self.prefill_wrapper.run(q[nd:], (kc, vc))
        return out


def sub_indptr(indptr: torch.Tensor, first_row: int) -> torch.Tensor:
    """The indptr of rows first_row.. as a batch of their own."""
    return indptr[first_row:] - indptr[first_row]
