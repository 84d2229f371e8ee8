"""Warm-up: run every batch shape the engine will use once, before the scheduler reports ready.

On CUDA the first forward of a shape is the expensive one: flashinfer compiles its kernels on first use
(minutes, unless a prebuilt kernel package or a kept kernel cache has them), its workspace and cuBLAS's
are set up, and the largest batch shows the peak activation memory the KV pool must leave room for.
The factory runs the warm-up while the engine is built, so the worker's heartbeat (what the chart's
startup and liveness probes read) appears only once it is over: no first request waits on a compile,
and no liveness probe kills a pod mid-compile.

With LoRA adapters on, every shape runs a second time with the LoRA ops (every row on the zero slot), so their
kernels (flashinfer's segment GEMM) compile and their intermediates count in the peak too.

Every warm-up row reads and writes only the scratch page, which is cleared afterwards, and the sampler's
generator is restored: the pool, the prefix cache, the counters and seeded sampling are as they were.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.scheduler.engine.attention import RowSpec
from services.scheduler.engine.kv_cache import SCRATCH_PAGE, KVCache, pages_for
from services.scheduler.engine.sampling import Sampler, SampleRow
from shared.messages import SamplingParams

if TYPE_CHECKING:
    from services.scheduler.engine.config import EngineConfig
    from services.scheduler.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)

# Every filter on, so the sampler's largest intermediates (a sort over the vocabulary per row) are part of
# the measured peak; seeded, so the rows draw from their own generator.
WARM_UP_SAMPLING = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, seed=0,
                                  logprobs=True, top_logprobs=5)
# Then the paths that flashinfer's sampling kernels serve on CUDA (unseeded, no min_p: from logits, and with
# top-k/top-p), which are compiled on first use as its attention kernels are, and greedy.
WARM_UP_MORE = (SamplingParams(max_tokens=1, temperature=1.0),
                SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9, top_k=50),
                SamplingParams(max_tokens=1, temperature=0.0))


@dataclass(frozen=True)
class WarmUpBatch:
    decodes: int  # rows with one new token
    prefill: int  # tokens of one prompt row after them (0: none)


def warm_up_batches(config: EngineConfig, on_cuda: bool, graph_sizes: Sequence[int],
                    max_context: int) -> list[WarmUpBatch]:
    """The batch shapes a warm-up runs.

    CUDA: every captured graph size and the largest eager decode batch, a prefill chunk alone, and the
    largest step there is (every other running sequence decoding while one prefills a full chunk).
    CPU has nothing to compile: one small mixed batch checks the model runs.
    """
    chunk = config.prefill_budget if config.chunked_prefill else max_context
    chunk = min(max(chunk, 2), max_context)  # a one-token row would be a decode row
    if not on_cuda:
        return [WarmUpBatch(1, min(chunk, config.page_size + 1))]
    batches = [WarmUpBatch(bs, 0) for bs in sorted({*graph_sizes, config.max_running})]
    batches.append(WarmUpBatch(0, chunk))
    if config.max_running > 1:
        batches.append(WarmUpBatch(config.max_running - 1, chunk))
    return batches


def run_warm_up(runner: ModelRunner, sampler: Sampler, kv: KVCache, config: EngineConfig, max_context: int) -> float:
    """Run the warm-up batches on the engine's runner and sampler; return the seconds it took. Every shape runs
    where kernels are compiled on first use: on CUDA, and wherever flashinfer attention serves (its fake on CPU,
    in tests)."""
    start = time.perf_counter()
    on_cuda = kv.k[0].device.type == "cuda"
    compiles = on_cuda or runner.backend.name == "flashinfer"
    graphs = runner.graphs
    batches = warm_up_batches(config, compiles, graphs.sizes if graphs else (), max_context)
    generator = sampler.generator
    state = generator.get_state()
    try:
        for batch in batches:
            _run_batch(runner, sampler, config.page_size, batch)
    finally:
        generator.set_state(state)
        kv.zero_pages([SCRATCH_PAGE])  # the torch backend needs it finite; warm-up wrote into it
    if on_cuda:
        torch.cuda.synchronize(kv.k[0].device)
    elapsed = time.perf_counter() - start
    log.info("warm-up: %d batch shapes (decode rows, prefill tokens) %s in %.1fs", len(batches),
             [(b.decodes, b.prefill) for b in batches], elapsed)
    return elapsed


def _run_batch(runner: ModelRunner, sampler: Sampler, ps: int, batch: WarmUpBatch) -> None:
    rows = [RowSpec([SCRATCH_PAGE], 0, 1) for _ in range(batch.decodes)]
    sample_idx = list(range(batch.decodes))
    if batch.prefill:
        rows.append(RowSpec([SCRATCH_PAGE] * pages_for(batch.prefill, ps), 0, batch.prefill))
        sample_idx.append(batch.decodes + batch.prefill - 1)
    ids = [0] * (batch.decodes + batch.prefill)
    logits = runner.forward(rows, ids, sample_idx)
    if runner.lora is not None:  # the engine's adapters (config.py `make_lora`)
        runner.forward(rows, ids, sample_idx, adapters=[0] * len(rows))
    for params in (WARM_UP_SAMPLING, *WARM_UP_MORE):
        sampler(logits, [SampleRow(params, 0, 0, [0], 1) for _ in sample_idx])
