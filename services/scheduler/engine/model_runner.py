"""Runs a transformers model on a packed batch with paged attention.

All scheduled tokens of a step form one sequence of length T (batch 1) with per-token position ids;
transformers' own decoder code runs unchanged, with attention routed to `rsinfer_paged`, and logits
are computed only at each sampling row's last token (`logits_to_keep` with explicit indices, so a
model's own logit scaling applies). This serves every decoder-only architecture whose attention goes
through transformers' AttentionInterface; others are refused at load with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.scheduler.engine import attention
from services.scheduler.engine.attention import AttentionBackend, ForwardContext, RowSpec, build_metadata
from services.scheduler.engine.kv_cache import KVShape


class UnsupportedModel(RuntimeError):
    """The checkpoint's architecture cannot run on the paged engine."""


@dataclass(frozen=True)
class AttnGeometry:
    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float

    def kv_shape(self, page_size: int) -> KVShape:
        return KVShape(self.num_layers, self.num_kv_heads, self.head_dim, page_size)


def attention_geometry(model: torch.nn.Module) -> AttnGeometry:
    """Check that the model can run paged and read its attention shape; raise UnsupportedModel if not."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModel(f"{name} is an encoder-decoder model; the paged engine runs decoder-only models")
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModel(f"{name} does not route attention through transformers' AttentionInterface; "
                               "use --engine simple")
    layer_types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or getattr(cfg, "use_sliding_window", False):
        raise UnsupportedModel(f"{name} has {sorted(layer_types)} layers; the paged engine supports only "
                               "full causal attention (no sliding-window, chunked or linear attention)")
    layers = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)
              and hasattr(m, "scaling")]
    if not layers:
        raise UnsupportedModel(f"{name}: no attention modules with a layer index were found")
    if len({float(m.scaling) for m in layers}) != 1:
        raise UnsupportedModel(f"{name}: attention layers use different scales")
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return AttnGeometry(cfg.num_hidden_layers, heads, kv_heads, head_dim, float(layers[0].scaling))


def max_context(model: torch.nn.Module) -> int:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(cfg, "max_position_embeddings", 0) or 2048)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, page_size: int):
        attention.register()
        self.model = model.eval()
        self.backend = backend
        self.page_size = page_size
        self.device = next(model.parameters()).device
        model.config._attn_implementation = attention.ATTN_NAME
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.graphs = None  # DecodeGraphs, when CUDA graphs are on

    @torch.inference_mode()
    def forward(self, rows: list[RowSpec], input_ids: list[int], sample_idx: list[int]) -> torch.Tensor:
        """Run the packed batch; return fp32 logits [len(sample_idx), vocab] of the given token indices."""
        if self.graphs is not None and len(sample_idx) == len(rows) and self.graphs.fits(rows):
            return self.graphs.run(rows, input_ids)
        meta = build_metadata(rows, self.page_size, self.device)
        self.backend.prepare(meta)
        ids = torch.tensor(input_ids, dtype=torch.long).to(self.device, non_blocking=True)
        keep = torch.tensor(sample_idx, dtype=torch.long).to(self.device, non_blocking=True)
        out = self.model(input_ids=ids[None], position_ids=meta.positions[None], use_cache=False,
                         logits_to_keep=keep, rsinfer_ctx=ForwardContext(self.backend, meta))
        return out.logits[0].float()
