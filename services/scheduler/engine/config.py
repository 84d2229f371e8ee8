"""The paged engine's configuration, and the parts it picks from it: the attention backend and the LoRA ops.

flashinfer is imported only inside `make_backend`, when a CUDA engine asks for it (attention/flashinfer_backend.py
says why), so a CPU-only process never loads it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.scheduler.engine.attention import AttentionBackend
from services.scheduler.engine.kv_cache import KVCache
from services.scheduler.engine.lora import SEGMENT_WORKSPACE_BYTES, LoraManager
from services.scheduler.engine.lora_weights import AdapterSource
from services.scheduler.engine.model_geometry import attention_geometry

log = logging.getLogger(__name__)

FLASHINFER_HEAD_DIMS = (64, 128, 256)  # what its prebuilt and JIT kernels are instantiated for


@dataclass(frozen=True)
class EngineConfig:
    num_pages: int  # KV pool size in pages, the scratch page included
    page_size: int = 16
    max_running: int = 64  # most sequences in the running batch
    prefill_budget: int = 512  # most prompt tokens computed per step
    chunked_prefill: bool = True
    prefix_cache: bool = True
    backend: str = "auto"  # "auto" | "torch" | "flashinfer"
    cuda_graphs: bool | None = None  # None: on CUDA with flashinfer attention
    overlap: bool | None = None  # launch the next step before reading this one's results; None: on CUDA
    shuffle_pages: int | None = None  # tests: hand out pages in a random order
    seed: int | None = None  # of the generator of unseeded sampling
    max_loras: int = 0  # LoRA adapters resident at once (lora.py); 0: none, a request naming one is refused
    max_lora_rank: int = 16
    lora_backend: str = "auto"  # "auto" | "torch" (grouped matmuls) | "flashinfer" (segment GEMM)


def make_lora(config: EngineConfig, model: torch.nn.Module, backend: AttentionBackend,
              source: AdapterSource | None) -> LoraManager | None:
    """The adapters' slots and ops, when --max-loras asks for any: flashinfer's segment GEMM where flashinfer
    serves the attention in 16 bits (it has no fp32 kernels), grouped torch matmuls elsewhere."""
    if not config.max_loras:
        return None
    param = next(model.parameters())
    module = getattr(backend, "flashinfer", None)
    segment = None
    if config.lora_backend not in ("auto", "torch", "flashinfer"):
        raise ValueError(f"unknown lora_backend {config.lora_backend!r}")
    if config.lora_backend != "torch" and module is not None and param.dtype in (torch.float16, torch.bfloat16):
        workspace = torch.zeros(SEGMENT_WORKSPACE_BYTES, dtype=torch.uint8, device=param.device)
        segment = module.gemm.SegmentGEMMWrapper(workspace)
    elif config.lora_backend == "flashinfer":
        raise ValueError("lora_backend flashinfer needs flashinfer attention in float16 or bfloat16")
    return LoraManager(model, source, config.max_loras, config.max_lora_rank, segment_gemm=segment)


def make_backend(name: str, kv: KVCache, model: torch.nn.Module, dtype: torch.dtype) -> AttentionBackend:
    """flashinfer on CUDA where it can serve the model, torch elsewhere: "auto" falls back to torch, with a
    warning naming why, for fp32 (flashinfer has no fp32 paged kernels), a head size it does not build, and
    an install that is missing or fails to import."""
    from services.scheduler.engine.attention.flashinfer_backend import FlashInferPagedAttention, load_flashinfer

    device = kv.k[0].device
    g = attention_geometry(model)
    module = None
    if name == "auto":
        name = "torch"
        if device.type != "cuda":
            pass
        elif dtype not in (torch.float16, torch.bfloat16):
            log.warning("flashinfer has no %s paged attention kernels; using torch attention on CUDA (slower; "
                        "--dtype bfloat16 uses flashinfer)", str(dtype).removeprefix("torch."))
        elif g.head_dim not in FLASHINFER_HEAD_DIMS:
            log.warning("head_dim %d is not one flashinfer builds; using torch attention on CUDA", g.head_dim)
        else:
            module, why = load_flashinfer()
            if module is None:
                log.warning("%s; using torch attention on CUDA", why)
            else:
                name = "flashinfer"
    if name == "flashinfer":
        return FlashInferPagedAttention(kv, g, dtype, flashinfer=module)
    from services.scheduler.engine.attention.torch_backend import TorchPagedAttention

    return TorchPagedAttention(kv)
