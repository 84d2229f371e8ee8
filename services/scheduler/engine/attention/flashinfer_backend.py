"""Paged attention on CUDA through flashinfer's paged prefill/decode wrappers (flashinfer-python 0.7.x).

`import flashinfer` happens only here, when the CUDA backend is built: it is an optional extra
(`pip install rsinfer[gpu]`) and a CPU-only process never loads it; an install that fails to import
(e.g. `apache-tvm-ffi` missing) makes the engine fall back to torch attention with a warning
(`load_flashinfer`). One plan per step per wrapper (host-side indptr/last_page_len avoid a device sync in
plan), then one run per layer. Prefill uses `causal=True`, which flashinfer aligns bottom-right (query i
sees kv_len - q_len + i), as chunked prefill and prefix hits need. Decode rows (one new token) go to the
decode wrapper.

Prefill is pinned to the fa2 kernels, as SGLang and mini-sglang do: with "auto", flashinfer 0.7.4 on SM90
picks fa3 when some row has more than 64 new tokens and fa2 otherwise, so a warm-up that prefills full
chunks leaves the first short prompt to JIT-compile fa2 mid-serving (and mini-sglang measured fa3 slower
for prefill). The float workspace is sized from the model's head counts (`workspace_bytes`).

flashinfer's `plan()` writes its schedule into a page-locked host buffer of the wrapper and copies it to
the device without blocking; with overlapped steps the next plan of the same wrapper could overwrite that
buffer before the copy ran, so each plan records an event and the next plan of that wrapper waits for it
when it is not done yet (it is done unless the host runs more than a step ahead).

Untested on a GPU in this repository's CI (no GPU there): tests/unit/engine/fake_flashinfer.py checks every
call against 0.7.x's signatures and computes attention from what plan() was given; bench/gpu_check.sh runs
the real kernels.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from typing import TYPE_CHECKING

import torch

from services.scheduler.engine.attention.metadata import AttnMetadata
from services.scheduler.engine.kv_cache import KVCache
from services.scheduler.engine.transfer import event_done, record_event, wait_event

if TYPE_CHECKING:
    from services.scheduler.engine.model_geometry import AttnGeometry

log = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 << 20  # the least float workspace (flashinfer's examples use 128 MiB)
WORKSPACE_MARGIN = 32 << 20  # the decode schedule's partial outputs and alignment, on top of prefill's
PREFILL_BACKEND = "fa2"
PREFILL_CTA_TILE_Q = 128  # the largest query tile of the fa2 prefill kernels
DEFAULT_SMS = 132  # an H100/H200, where the device cannot say (the fake flashinfer on CPU)
# Packages of prebuilt kernels that flashinfer uses by itself when installed at its own version
# (deploy/Dockerfile's cuda variant installs them); kernels they lack are compiled on first use.
PREBUILT_PACKAGES = ("flashinfer_jit_cache", "flashinfer_cubin")


def prebuilt_kernel_packages() -> list[str]:
    return [name for name in PREBUILT_PACKAGES if importlib.util.find_spec(name) is not None]


def load_flashinfer():
    """(the flashinfer module, None) or (None, why it cannot be used): not installed, or an install that
    fails to import (a missing dependency such as apache-tvm-ffi, a wheel for another CUDA)."""
    try:
        import flashinfer
    except ModuleNotFoundError as exc:
        if exc.name == "flashinfer":
            return None, "flashinfer is not installed (pip install rsinfer[gpu])"
        return None, f"flashinfer failed to import ({type(exc).__name__}: {exc})"
    except Exception as exc:  # any import failure means: use torch attention
        return None, f"flashinfer failed to import ({type(exc).__name__}: {exc})"
    return flashinfer, None


def workspace_bytes(num_qo_heads: int, num_kv_heads: int, head_dim: int, num_sms: int) -> int:
    """Float workspace for the model's heads: a split-kv prefill keeps one fp32 partial output (and its
    softmax denominator) per query row and head for up to 2 * SMs / Hkv query tiles of 128 rows (the bound
    flashinfer 0.7.0 sizes them by; 0.7.4 needs a GQA group less). 128 MiB covers Qwen3-0.6B; a model
    with 64 query and 8 KV heads needs ~140 MB for prefill alone."""
    tiles = math.ceil(2 * num_sms / num_kv_heads)
    prefill = num_qo_heads * tiles * PREFILL_CTA_TILE_Q * (head_dim + 1) * 4
    need = prefill + WORKSPACE_MARGIN
    return max(WORKSPACE_BYTES, -(-need // (1 << 20)) << 20)


def device_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SMS


class FlashInferPagedAttention:
    name = "flashinfer"

    def __init__(self, kv: KVCache, geometry: AttnGeometry, dtype: torch.dtype, flashinfer=None):
        if flashinfer is None:
            flashinfer, why = load_flashinfer()
            if flashinfer is None:
                raise RuntimeError(why)
        self.flashinfer = flashinfer
        prebuilt = prebuilt_kernel_packages()
        log.info("flashinfer %s, prebuilt kernels: %s; others compile on first use (the warm-up) into %s",
                 getattr(flashinfer, "__version__", "?"), ", ".join(prebuilt) or "none",
                 os.environ.get("FLASHINFER_WORKSPACE_BASE", "~") + "/.cache/flashinfer")
        self.kv = kv
        self.device = kv.k[0].device
        num_qo_heads, num_kv_heads, head_dim = geometry.num_qo_heads, geometry.num_kv_heads, geometry.head_dim
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.scaling = geometry.scaling
        self.dtype = dtype
        # Zeroed, not torch.empty: flashinfer's decode wrappers document that their float workspace must be
        # zero-initialised (kernels read parts of it before writing them); the graph wrappers share it.
        size = workspace_bytes(num_qo_heads, num_kv_heads, head_dim, device_sms(self.device))
        self.workspace = torch.zeros(size, dtype=torch.uint8, device=self.device)
        # Tensor cores pay off for decode only with wide query groups (mini-sglang uses GQA >= 4).
        self.use_tensor_cores = num_qo_heads // num_kv_heads >= 4
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                             backend=PREFILL_BACKEND)
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores)
        self._planned: dict[int, object] = {}  # id(wrapper) -> event after its last plan

    def plan(self, wrapper, *args, **kwargs) -> None:
        """`wrapper.plan(...)`, once the copy its previous plan queued from its page-locked buffer has run."""
        event = self._planned.get(id(wrapper))
        if not event_done(event):
            wait_event(event)
        wrapper.plan(*args, **kwargs)
        self._planned[id(wrapper)] = record_event(self.device)

    def plan_decode(self, wrapper, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor) -> None:
        hq, hkv, dim = self.heads
        self.plan(wrapper, indptr, indices, last_page_len, hq, hkv, dim, self.kv.page_size,
                  sm_scale=self.scaling, q_data_type=self.dtype, kv_data_type=self.dtype)

    def prepare(self, meta: AttnMetadata, decode_wrapper=None) -> None:
        """Plan both wrappers for this step (outside any CUDA graph; `decode_wrapper` for a replay)."""
        nd, rows = meta.num_decode, meta.num_rows
        hq, hkv, dim = self.heads
        if nd:
            split = int(meta.kv_indptr[nd])
            self.plan_decode(decode_wrapper or self.decode_wrapper, meta.kv_indptr[:nd + 1],
                             meta.kv_indices[:split], meta.kv_last_page_len[:nd])
        if rows > nd:
            qo, kvp = sub_indptr(meta.qo_indptr, nd), sub_indptr(meta.kv_indptr, nd)
            self.plan(self.prefill_wrapper,
                      qo, kvp, meta.kv_indices[int(meta.kv_indptr[nd]):], meta.kv_last_page_len[nd:],
                      hq, hkv, dim, self.kv.page_size, causal=True, sm_scale=self.scaling,
                      q_data_type=self.dtype, kv_data_type=self.dtype)
        meta.extra["decode_wrapper"] = decode_wrapper or self.decode_wrapper

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, *, scaling: float,
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
