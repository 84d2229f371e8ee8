"""Build the engine the settings ask for, with the model loaded the way any checkpoint is loaded."""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from services.scheduler.engine.base import Engine
from services.scheduler.engine.eos import eos_token_ids
from shared.settings import SchedulerSettings

if TYPE_CHECKING:
    from services.scheduler.engine.lora_weights import AdapterSource

log = logging.getLogger(__name__)

CPU_KV_SHARE = 0.5  # of kv_memory_fraction x available RAM: the node's other processes need the rest
PROBE_PAGES = 2  # the GPU probe engine's pool: the scratch page (all a warm-up touches) and one more
MIN_MARGIN_BYTES = 1 << 30  # GPU memory left free whatever kv_memory_fraction says (allocator slack)


def torch_threads(requested: int) -> int:
    """Half the cores by default: the other processes of a node need the rest (2 cores, 5 processes)."""
    return requested or max(1, (os.cpu_count() or 2) // 2)


def pick_device(setting: str):
    import torch

    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU computes bf16 natively (x86 AVX512-BF16 or AMX-BF16, Arm BF16). Without it torch
    emulates bf16 matmuls: the Qwen3-0.6B shape ran 4x slower than in fp32, 91% of it in Linear.forward."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return bool(set(line.partition(":")[2].split()) & {"avx512_bf16", "amx_bf16", "bf16"})
    except OSError:
        pass
    return False


def pick_dtype(setting: str, device, config):
    """An explicit --dtype wins. `auto`: the checkpoint's dtype, where the device computes it fast: fp32
    becomes bf16 on CUDA (flashinfer needs 16-bit); on CPU fp16 becomes fp32 (CPU fp16 matmuls are slow),
    and so does bf16 unless the CPU has native bf16."""
    import torch

    if setting != "auto":
        log.info("dtype %s (--dtype)", setting)
        return getattr(torch, setting)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    chosen, why = dtype, "the checkpoint's"
    if device.type == "cuda" and dtype == torch.float32:
        chosen, why = torch.bfloat16, "flashinfer needs 16-bit on CUDA"
    elif device.type == "cpu" and dtype == torch.float16:
        chosen, why = torch.float32, "CPU fp16 matmuls are slow"
    elif device.type == "cpu" and dtype == torch.bfloat16:
        native = cpu_has_native_bf16()
        chosen = torch.bfloat16 if native else torch.float32
        why = "the CPU has native bf16" if native else "the CPU has no native bf16 (no AVX512-BF16 or AMX)"
    log.info("dtype auto: %s for a %s checkpoint on %s (%s)", _name(chosen), _name(dtype), device.type, why)
    return chosen


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kv_num_pages(settings: SchedulerSettings, bytes_per_token: int, max_context: int, reserved: int = 0) -> int:
    """Pages of the KV pool (the scratch page included) without a GPU memory profile: --max-kv-tokens,
    or on CPU a share of available RAM less `reserved` bytes (the LoRA slots')."""
    if settings.max_kv_tokens:
        tokens = settings.max_kv_tokens
    else:
        budget = int(_available_ram() * settings.kv_memory_fraction * CPU_KV_SHARE) - reserved
        if reserved and budget < bytes_per_token * settings.page_size:
            raise RuntimeError(f"no memory left for the KV cache: the LoRA slots take {reserved / 2**30:.2f} GiB "
                               "of its share; lower --max-loras or --max-lora-rank, or set --max-kv-tokens")
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


def build_engine(settings: SchedulerSettings, model_path: str, adapters: AdapterSource | None = None) -> Engine:
    """The engine the settings ask for; `adapters` names the LoRA adapters a request may ask for (paged engine,
    --max-loras > 0)."""
    if settings.engine == "synthetic":  # no weights, no torch threads: the plumbing alone
        from services.scheduler.engine.synthetic import build_synthetic_engine

        return build_synthetic_engine(settings, model_path)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(torch_threads(settings.threads))
    if settings.tensor_parallel_size > 1:
        return build_tensor_parallel(settings, model_path, adapters)
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

        engine = SimpleEngine(model, eos, settings.max_running)
    else:
        engine = build_paged_engine(settings, model, eos, adapters=adapters)
    engine.grammars = grammar_cache(settings, model_path, model, eos)
    return engine


def rank_device(setting: str, rank: int):
    """Rank r runs on GPU r (one process per device), or on the CPU."""
    device = pick_device(setting)
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return device


def load_shard(settings: SchedulerSettings, model_path: str, device, rank: int, groups):
    """The model loaded on the CPU, cut down to this rank's shard, then moved to its device (so a device never
    holds more than its share)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from services.scheduler.engine.tp_shard import shard_model

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=settings.trust_remote_code)
    dtype = pick_dtype(settings.dtype, device, config)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                                 trust_remote_code=settings.trust_remote_code)
    shard_model(model, rank, settings.tensor_parallel_size, groups.step)
    return model.to(device).eval()


def grammar_cache(settings: SchedulerSettings, model_path: str, model, eos: set[int]):
    """Structured outputs: grammars over the model's (padded) vocabulary, compiled off the step thread."""
    from services.scheduler.engine.grammar import GrammarCache
    from services.scheduler.engine.tp_shard import output_vocab

    return GrammarCache(model_path, output_vocab(model), eos, settings.trust_remote_code,
                        settings.grammar_mask_budget_ms)


def build_tensor_parallel(settings: SchedulerSettings, model_path: str, adapters: AdapterSource | None) -> Engine:
    """The paged engine as rank 0 of --tensor-parallel-size ranks (tp_group.py): the workers started, the model
    sharded on every rank, one KV pool size agreed, warmed up together."""
    if settings.engine != "paged":
        raise ValueError(f"--tensor-parallel-size needs the paged engine (got --engine {settings.engine})")
    if settings.max_loras:
        raise ValueError("--tensor-parallel-size with --max-loras is not supported: LoRA slots would have to be "
                         "split like the layers they wrap (their B by columns, their A by rows) on every rank")
    from transformers import AutoConfig

    from services.scheduler.engine.model_geometry import attention_geometry, max_context
    from services.scheduler.engine.paged import PagedEngine
    from services.scheduler.engine.tp_group import TensorParallelGroup
    from services.scheduler.engine.tp_shard import plan, weight_bytes

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=settings.trust_remote_code)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    plan(text, 0, settings.tensor_parallel_size, text.vocab_size)  # a shape that cannot split: refused before any start
    device = rank_device(settings.device, 0)
    group = TensorParallelGroup.start(settings, model_path, device)
    model = load_shard(settings, model_path, device, 0, group.groups)
    ranks = group.joined(weight_bytes(model))
    eos = eos_token_ids(model_path, model.config)
    param = next(model.parameters())
    bytes_per_token = attention_geometry(model).kv_shape(settings.page_size).bytes_per_token(param.dtype)
    free = min(r["free_bytes"] for r in ranks)
    pages = tp_kv_pages(settings, bytes_per_token, max_context(model), device, free)
    # CUDA graphs would capture the collectives' launches: not yet, each step runs eagerly
    config = replace(engine_config(settings), num_pages=group.agree_pages(pages, settings.page_size), cuda_graphs=False)
    engine = PagedEngine(model, eos, config)
    engine.join(group)  # every rank's pool has rank 0's size
    engine.warm_up()
    engine.grammars = grammar_cache(settings, model_path, model, eos)
    return engine


def build_paged_engine(settings: SchedulerSettings, model, eos: set[int], memory: DeviceMemory | None = None,
                       adapters: AdapterSource | None = None) -> Engine:
    """The paged engine, warmed up. Its KV pool is --max-kv-tokens, or on CUDA (`memory`) what a warmed-up
    probe engine leaves free (its LoRA slots, segment GEMM workspace and LoRA graphs allocated), or on CPU a
    share of RAM less the LoRA slots."""
    from services.scheduler.engine.model_geometry import attention_geometry, max_context
    from services.scheduler.engine.paged import PagedEngine

    param = next(model.parameters())
    bytes_per_token = attention_geometry(model).kv_shape(settings.page_size).bytes_per_token(param.dtype)
    config = engine_config(settings)
    if memory is None and param.device.type == "cuda":
        memory = CudaMemory(param.device)
    if settings.max_kv_tokens or memory is None:
        pages = kv_num_pages(settings, bytes_per_token, max_context(model), lora_bytes(settings, model))
    else:
        profile = probe_memory(model, eos, config, memory)
        pages = kv_pages_from_profile(profile, settings.kv_memory_fraction, bytes_per_token, config.page_size)
    engine = PagedEngine(model, eos, replace(config, num_pages=pages), adapters=adapters)
    engine.warm_up()
    return engine


def engine_config(settings: SchedulerSettings):
    """The paged engine's configuration from the settings, its pool the probe's."""
    from services.scheduler.engine.config import EngineConfig

    return EngineConfig(num_pages=PROBE_PAGES, page_size=settings.page_size, max_running=settings.max_running,
                        prefill_budget=settings.chunk_size, prefix_cache=settings.prefix_cache,
                        cuda_graphs=settings.cuda_graphs, overlap=settings.overlap, max_loras=settings.max_loras,
                        max_lora_rank=settings.max_lora_rank)


def tp_kv_pages(settings: SchedulerSettings, bytes_per_token: int, context: int, device, free_bytes: int) -> int:
    """A tensor-parallel rank's pool (bytes_per_token: one rank's share of the KV heads): --max-kv-tokens; on
    CUDA a share of the memory the least free rank has after loading its weights, with headroom for the
    activations kept (no probe warm-up: it would have to run on every rank); on CPU, a rank's share of RAM."""
    if settings.max_kv_tokens or device.type != "cuda":
        ranks = settings.model_copy(update={"kv_memory_fraction": settings.kv_memory_fraction /
                                            settings.tensor_parallel_size})
        return kv_num_pages(ranks, bytes_per_token, context)
    budget = int(free_bytes * settings.kv_memory_fraction) - 4 * MIN_MARGIN_BYTES
    if budget < bytes_per_token * settings.page_size:
        raise RuntimeError(f"no GPU memory left for the KV cache on some rank ({free_bytes / 2**30:.2f} GiB free "
                           "after loading the weights); raise --tensor-parallel-size or set --max-kv-tokens")
    return budget // bytes_per_token // settings.page_size + 1


def lora_bytes(settings: SchedulerSettings, model) -> int:
    """Bytes of the LoRA slots --max-loras and --max-lora-rank allocate (0 without adapters)."""
    if not settings.max_loras:
        return 0
    from services.scheduler.engine.lora_weights import LoraLayout, stack_bytes

    dtype = next(model.parameters()).dtype
    return stack_bytes(LoraLayout.of(model), settings.max_loras, settings.max_lora_rank, dtype)


# ---- sizing the KV pool on a GPU from what a warm-up leaves (as vLLM's profiling run does)


@dataclass(frozen=True)
class MemoryProfile:
    """What the warm-up of a probe engine showed, in bytes."""

    free_after: int  # device memory free after it (weights, workspace, CUDA graphs, probe pool allocated)
    probe_pool_bytes: int  # the probe's KV pool, free again once the probe is gone
    transient_peak: int  # peak allocation above what stays allocated: the largest batch's activations

    @property
    def left_for_kv(self) -> int:
        return self.free_after + self.probe_pool_bytes - self.transient_peak


def kv_tokens_from_profile(profile: MemoryProfile, fraction: float, bytes_per_token: int) -> int:
    """KV tokens that fit in `fraction` of the memory a warmed-up engine leaves (at least MIN_MARGIN_BYTES
    stay free); raises if not even one token does."""
    left = profile.left_for_kv
    budget = min(int(left * fraction), left - MIN_MARGIN_BYTES)
    tokens = max(budget, 0) // bytes_per_token
    if tokens < 1:
        raise RuntimeError(f"no GPU memory left for the KV cache: {left / 2**30:.2f} GiB free after the warm-up "
                           f"(weights, workspace, CUDA graphs and peak activations allocated); lower "
                           "--max-running or --chunk-size, or set --max-kv-tokens")
    return tokens


class DeviceMemory(Protocol):
    def reset_peak(self) -> None: ...

    def measure(self) -> tuple[int, int]:
        """(free bytes once cached blocks are released, peak allocated bytes since reset_peak above what is
        allocated now)."""

    def release(self) -> None:
        """Give cached blocks back to the device."""


class CudaMemory:
    def __init__(self, device):
        self.device = device

    def reset_peak(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def measure(self) -> tuple[int, int]:
        import torch

        torch.cuda.synchronize(self.device)
        transient = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(self.device)
        return free, transient

    def release(self) -> None:
        import torch

        gc.collect()  # the probe's graphs and buffers
        torch.cuda.empty_cache()


def probe_memory(model, eos: set[int], config, memory: DeviceMemory) -> MemoryProfile:
    """Build a probe engine with a tiny pool, warm it up (workspace, CUDA graphs, peak activations, kernels),
    measure what is left, and drop it."""
    from services.scheduler.engine.paged import PagedEngine

    probe = PagedEngine(model, eos, replace(config, num_pages=PROBE_PAGES))
    memory.reset_peak()
    probe.warm_up()
    free_after, transient = memory.measure()
    profile = MemoryProfile(free_after, probe.kv.nbytes, transient)
    probe.close()
    del probe
    memory.release()
    return profile


def kv_pages_from_profile(profile: MemoryProfile, fraction: float, bytes_per_token: int, page_size: int) -> int:
    """The pages of the real pool (the scratch page included) that `fraction` of what the probe left holds."""
    tokens = kv_tokens_from_profile(profile, fraction, bytes_per_token)
    log.info("KV cache: %d tokens (%.2f GiB) = %.2f of the %.2f GiB left after warm-up (peak activations "
             "%.2f GiB kept free)", tokens, tokens * bytes_per_token / 2**30, fraction,
             profile.left_for_kv / 2**30, profile.transient_peak / 2**30)
    return -(-tokens // page_size) + 1
