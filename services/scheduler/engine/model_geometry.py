"""What the paged engine reads of a model before it runs it: its attention shape (refusing the architectures it
cannot run, with the reason) and its context length. Its own module so that the attention backends, which
need the shape, do not import the runner that imports them (model_runner.py -> cuda_graph.py ->
attention/flashinfer_backend.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
