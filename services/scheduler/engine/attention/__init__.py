"""Attention backends behind one metadata object, plugged into transformers' `AttentionInterface`.

transformers' decoder layers compute q/k/v and RoPE themselves and then call the attention function
registered under `config._attn_implementation` with the per-layer module. We register `rsinfer_paged`,
which hands the new tokens to the step's backend (flashinfer on CUDA, torch on CPU) through the
`rsinfer_ctx` keyword the model forward passes down to every layer. A custom name has no mask
function in transformers, so no causal mask is built: the backend masks itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from services.scheduler.engine.attention.metadata import AttnMetadata, RowSpec, build_metadata

ATTN_NAME = "rsinfer_paged"

__all__ = ["ATTN_NAME", "AttentionBackend", "AttnMetadata", "ForwardContext", "RowSpec", "build_metadata",
           "paged_attention", "register"]


class AttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttnMetadata) -> None: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, *, scaling: float,
                meta: AttnMetadata) -> torch.Tensor: ...


@dataclass
class ForwardContext:
    backend: AttentionBackend
    meta: AttnMetadata


class UnsupportedAttention(RuntimeError):
    pass


def paged_attention(  # noqa: PLR0913 - the signature transformers' AttentionInterface calls
        module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
        *, scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
        rsinfer_ctx: ForwardContext | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] of the packed batch -> ([1, T, Hq, D], None)."""
    if rsinfer_ctx is None:
        raise UnsupportedAttention("rsinfer_paged attention called without the engine's context")
    if sliding_window is not None:
        raise UnsupportedAttention("sliding-window attention layers are not supported by the paged engine")
    if kwargs.get("softcap") or kwargs.get("s_aux") is not None:
        raise UnsupportedAttention("attention logit soft-capping / sinks are not supported by the paged engine")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = rsinfer_ctx.backend.forward(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                      module.layer_idx, scaling=scaling, meta=rsinfer_ctx.meta)
    return out.unsqueeze(0), None


_registered = False


def register() -> None:
    """Register `rsinfer_paged` with transformers once per process."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_NAME, paged_attention)
        _registered = True
