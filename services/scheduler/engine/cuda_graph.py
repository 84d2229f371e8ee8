"""Decode steps replayed from CUDA graphs (`--cuda-graphs`, CUDA with flashinfer only).

A decode step of a small model is hundreds of short kernels; launching them costs more than running
them. For a set of batch sizes we capture one whole decode forward (transformers' layers, our
attention, the LM head) over static buffers, with flashinfer's CUDA-graph decode wrapper. At run time
a batch is padded to the next captured size (pad rows read and write the scratch page), the wrapper
is planned outside the graph, the inputs are copied into the buffers and the graph is replayed.

Capture runs under `torch.inference_mode()`, as every eager forward does: outside it the captured
forward would record autograd state for the weights and keep its saved tensors alive in the graph's
memory pool. Any failure to capture disables graphs with a warning that names the cause, and the
engine decodes eagerly. Untested on a GPU in this repository's CI (none there).
"""

from __future__ import annotations

import bisect
import logging

import torch

from services.scheduler.engine.attention import ForwardContext, RowSpec
from services.scheduler.engine.attention.metadata import AttnMetadata, build_metadata
from services.scheduler.engine.kv_cache import SCRATCH_PAGE, KVCache

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


class DecodeGraphs:
    def __init__(self, runner, kv: KVCache, max_bs: int, max_pages_per_seq: int):
        from services.scheduler.engine.attention.flashinfer_backend import FlashInferPagedAttention

        backend = runner.backend
        dev = kv.k[0].device
        if dev.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device; the model is on {dev}")
        if not isinstance(backend, FlashInferPagedAttention):
            raise RuntimeError(f"CUDA graphs need the flashinfer attention backend, not {backend.name}")
        self.runner, self.backend, self.kv = runner, backend, kv
        self.sizes = [b for b in BATCH_SIZES if b <= max_bs] or [1]
        top = self.sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=dev)
        self.positions = torch.zeros(top, dtype=torch.long, device=dev)
        self.slots = torch.zeros(top, dtype=torch.long, device=dev)
        self.keep = torch.arange(top, dtype=torch.long, device=dev)
        self.indptr = torch.zeros(top + 1, dtype=torch.int32, device=dev)
        self.indices = torch.zeros(top * max_pages_per_seq, dtype=torch.int32, device=dev)
        self.last_len = torch.ones(top, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, object, AttnMetadata, torch.Tensor]] = {}

    @classmethod
    def capture(cls, runner, kv: KVCache, max_bs: int, max_pages_per_seq: int) -> DecodeGraphs | None:
        """Graphs for every batch size, or None (decode then runs eagerly) after a warning naming why."""
        try:
            graphs = cls(runner, kv, max_bs, max_pages_per_seq)
            with torch.inference_mode():
                graphs._capture_all()
        except Exception as exc:
            log.warning("CUDA graph capture failed, decoding eagerly: %s", failure_cause(exc), exc_info=True)
            return None
        log.info("captured decode CUDA graphs for batch sizes %s", graphs.sizes)
        return graphs

    def _capture_all(self) -> None:
        fi = self.backend.flashinfer
        pool = None
        for bs in reversed(self.sizes):
            wrapper = fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
                self.backend.workspace, self.indptr[:bs + 1], self.indices, self.last_len[:bs], "NHD",
                use_tensor_cores=self.backend.use_tensor_cores)
            meta = self._meta(bs, [RowSpec([SCRATCH_PAGE], 0, 1)] * bs)
            self.backend.prepare(meta, decode_wrapper=wrapper)
            self._run_model(bs, meta)  # warm-up, outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._run_model(bs, meta)
            pool = graph.pool()
            self.graphs[bs] = (graph, wrapper, meta, logits)

    def _meta(self, bs: int, rows: list[RowSpec]) -> AttnMetadata:
        """Metadata whose device tensors are the static buffers the graph reads."""
        meta = build_metadata(rows, self.kv.page_size, self.input_ids.device)
        meta.slot_mapping = self.slots[:bs]
        meta.positions = self.positions[:bs]
        return meta

    def _run_model(self, bs: int, meta: AttnMetadata) -> torch.Tensor:
        out = self.runner.model(input_ids=self.input_ids[None, :bs], position_ids=self.positions[None, :bs],
                                use_cache=False, logits_to_keep=self.keep[:bs],
                                rsinfer_ctx=ForwardContext(self.backend, meta))
        return out.logits[0]

    def fits(self, rows: list[RowSpec]) -> bool:
        return len(rows) <= self.sizes[-1] and all(r.num_new == 1 for r in rows)

    def run(self, rows: list[RowSpec], input_ids: list[int]) -> torch.Tensor:
        n = len(rows)
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        graph, wrapper, _meta, logits = self.graphs[bs]
        padded = rows + [RowSpec([SCRATCH_PAGE], 0, 1)] * (bs - n)
        real = build_metadata(padded, self.kv.page_size, self.input_ids.device)
        self.backend.prepare(real, decode_wrapper=wrapper)  # plan() copies into the graph's buffers
        self.input_ids[:bs].copy_(torch.tensor(input_ids + [0] * (bs - n)), non_blocking=True)
        self.positions[:bs].copy_(real.positions, non_blocking=True)
        self.slots[:bs].copy_(real.slot_mapping, non_blocking=True)
        graph.replay()
        return logits[:n].float()


def failure_cause(exc: BaseException) -> str:
    """`Type: message` of an exception and of what it was raised while handling: a capture that fails
    mid-graph reports the capture's end, while the cause is the error that interrupted it."""
    causes = []
    seen: BaseException | None = exc
    while seen is not None and len(causes) < 3:
        causes.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)
    return " <- ".join(causes)
