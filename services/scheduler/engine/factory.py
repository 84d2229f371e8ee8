"""Build the engine the settings ask for, with the model loaded the way any checkpoint is loaded."""

from __future__ import annotations

import logging
import os

from services.scheduler.engine.base import Engine
from shared.settings import SchedulerSettings

log = logging.getLogger(__name__)

CPU_KV_SHARE = 0.5  # of kv_memory_fraction x available RAM: the node's other processes need the rest


def torch_threads(requested: int) -> int:
    """Half the cores by default: the other processes of a node need the rest (2 cores, 5 processes)."""
    return requested or max(1, (os.cpu_count() or 2) // 2)


def eos_token_ids(model_path: str, config) -> set[int]:
    from transformers import GenerationConfig

    ids: set[int] = set()
    for source in (config, _generation_config(GenerationConfig, model_path)):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(eos)
    return ids


def _generation_config(cls, path: str):
    try:
        return cls.from_pretrained(path)
    except (OSError, ValueError):
        return None


def pick_device(setting: str):
    import torch

    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def pick_dtype(setting: str, device, config):
    """The checkpoint's dtype unless told; fp32 becomes bf16 on CUDA (flashinfer needs 16-bit) and
    fp16 becomes fp32 on CPU (CPU fp16 matmuls are slow)."""
    import torch

    if setting != "auto":
        return getattr(torch, setting)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if device.type == "cuda" and dtype == torch.float32:
        return torch.bfloat16
    if device.type == "cpu" and dtype == torch.float16:
        return torch.float32
    return dtype


def kv_num_pages(settings: SchedulerSettings, bytes_per_token: int, device, max_context: int) -> int:
    """Pages of the KV pool (the scratch page included): --max-kv-tokens, or a share of free memory."""
    import torch

    if settings.max_kv_tokens:
        tokens = settings.max_kv_tokens
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)  # after the weights are loaded
        tokens = int(free * settings.kv_memory_fraction) // bytes_per_token
    else:
        budget = int(_available_ram() * settings.kv_memory_fraction * CPU_KV_SHARE)
        tokens = min(budget // bytes_per_token, settings.max_running * max_context)
    return -(-tokens // settings.page_size) + 1


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def build_engine(settings: SchedulerSettings, model_path: str) -> Engine:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(torch_threads(settings.threads))
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=settings.trust_remote_code)
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device, config)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                                 trust_remote_code=settings.trust_remote_code).to(device)
    eos = eos_token_ids(model_path, model.config)
    log.info("engine=%s device=%s dtype=%s threads=%d model=%s", settings.engine, device, dtype,
             torch.get_num_threads(), model_path)
    if settings.engine == "simple":
        from services.scheduler.engine.simple import SimpleEngine

        return SimpleEngine(model, eos, settings.max_running)
    return build_paged_engine(settings, model, eos)


def build_paged_engine(settings: SchedulerSettings, model, eos: set[int]) -> Engine:
    from services.scheduler.engine.model_runner import attention_geometry, max_context
    from services.scheduler.engine.paged import EngineConfig, PagedEngine

    param = next(model.parameters())
    shape = attention_geometry(model).kv_shape(settings.page_size)
    pages = kv_num_pages(settings, shape.bytes_per_token(param.dtype), param.device, max_context(model))
    config = EngineConfig(num_pages=pages, page_size=settings.page_size, max_running=settings.max_running,
                          prefill_budget=settings.chunk_size, prefix_cache=settings.prefix_cache,
                          cuda_graphs=settings.cuda_graphs)
    return PagedEngine(model, eos, config)
