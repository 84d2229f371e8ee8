"""Decode steps replayed from CUDA graphs (on by default on CUDA with flashinfer: `--cuda-graphs`).

A decode step of a small model is hundreds of short kernels (1,609 aten ops for the Qwen3-0.6B layer
structure); launching them costs more than running them. For a set of batch sizes we capture one whole
decode forward (transformers' layers, our attention, the LM head) over static buffers, with flashinfer's
CUDA-graph decode wrapper. At run time the decode rows of a step are padded to the next captured size (pad
rows read and write the scratch page), the step's inputs are copied into the static buffers in two
transfers (int64: input ids, positions, slots and the device-side token patches; int32: the page table),
and the graph is replayed. A mixed step replays its decode rows and runs its prompt chunks as a separate
eager forward (model_runner.py), so steady arrivals do not make every decode eager.

Cheap replays: flashinfer's CUDA-core decode schedule (`DecodePlan` in its scheduler.cuh) depends on the
pages per row (indptr) and nothing else that changes between steps; kernels read the page ids and last page
lengths from the static buffers. So a replay whose indptr equals the one its size was last planned with
does not call `plan()` again (at batch 1 that is 15 steps of 16 at 16-token pages). Tensor-core decode
(GQA >= 4) plans with kv lengths and is planned every replay.

Every captured size writes its logits into one shared fp32 buffer [largest size, vocab] inside its graph
(the graphs never run concurrently), instead of each keeping its own output (~317 MB at 256 sizes' worth
of a 151,936 vocabulary in bf16).

LoRA adapters (lora.py): with adapters on and flashinfer's segment GEMM there, every size is captured a second time
with the LoRA ops, which read each row's slot from a static buffer (one segment per row, bounds fixed at capture)
filled with the other int64 inputs; a decode batch with an adapter row replays that graph, a base-only one the
graph without them. The two graphs of a size share their decode wrapper and its plan. Without the segment GEMM,
decode batches with adapter rows run eagerly.

Capture runs under `torch.inference_mode()`, as every eager forward does: outside it the captured
forward would record autograd state for the weights and keep its saved tensors alive in the graph's
memory pool. Any failure to capture disables graphs with a warning that names the cause, and the
engine decodes eagerly. `GraphApi` is how graphs are made; tests stand a re-running fake in on CPU.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from services.scheduler.engine.attention import ForwardContext, RowSpec
from services.scheduler.engine.attention.metadata import AttnMetadata, build_metadata
from services.scheduler.engine.kv_cache import SCRATCH_PAGE, KVCache
from services.scheduler.engine.lora_stacks import LoraBatch
from services.scheduler.engine.transfer import host_tensor

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


@dataclass
class DeviceTokens:
    """Input tokens still on the device: packed position `positions[i]` reads `source[rows[i]]` (the ids
    the previous, overlapped step sampled)."""

    positions: list[int]
    rows: list[int]
    source: torch.Tensor

    def shifted(self, lo: int, hi: int) -> DeviceTokens | None:
        """The patches of packed positions [lo, hi), relative to lo; None if there are none."""
        if lo == 0 and self.positions and self.positions[-1] < hi:  # positions increase: all of them
            return self
        picked = [(p - lo, r) for p, r in zip(self.positions, self.rows, strict=True) if lo <= p < hi]
        if not picked:
            return None
        return DeviceTokens([p for p, _ in picked], [r for _, r in picked], self.source)


class GraphApi:
    """CUDA graphs through torch: capture a function into a graph sharing one memory pool, replay it."""

    def check(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device; the model is on {device}")

    def capture(self, fn: Callable[[], None], pool):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        return graph, graph.pool()

    def replay(self, graph) -> None:
        graph.replay()

    def synchronize(self) -> None:
        torch.cuda.synchronize()


class DecodeGraphs:
    api: GraphApi = GraphApi()  # tests replace it on CPU

    def __init__(self, runner, kv: KVCache, max_bs: int, max_pages_per_seq: int):
        from services.scheduler.engine.attention.flashinfer_backend import FlashInferPagedAttention

        backend = runner.backend
        dev = kv.k[0].device
        self.api.check(dev)
        if not isinstance(backend, FlashInferPagedAttention):
            raise RuntimeError(f"CUDA graphs need the flashinfer attention backend, not {backend.name}")
        self.runner, self.backend, self.kv = runner, backend, kv
        self.sizes = [b for b in BATCH_SIZES if b <= max_bs] or [1]
        self.top = top = self.sizes[-1]
        self.max_pages = top * max_pages_per_seq
        # int64: input ids | positions | slots | patch positions | patch source rows | LoRA slots
        self.longs = torch.zeros(6 * top, dtype=torch.long, device=dev)
        (self.input_ids, self.positions, self.slots, self.patch_pos, self.patch_src,
         self.lora_slots) = self.longs.split(top)
        lora = runner.lora
        self.lora = lora if lora is not None and lora.segment_gemm is not None else None
        if lora is not None and self.lora is None:
            log.info("LoRA decode steps run eagerly: graphs replay their ops through flashinfer's segment GEMM, "
                     "which this engine does not use")
        self.lora_bounds = torch.arange(top + 1, dtype=torch.long, device=dev)  # a segment per row
        # int32: indptr | last page lengths | page ids
        self.ints = torch.zeros(2 * top + 1 + self.max_pages, dtype=torch.int32, device=dev)
        self.indptr = self.ints[:top + 1]
        self.last_len = self.ints[top + 1:2 * top + 1]
        self.indices = self.ints[2 * top + 1:]
        self.keep = torch.arange(top, dtype=torch.long, device=dev)
        self.logits = torch.zeros(top, runner.vocab_size, dtype=torch.float32, device=dev)
        self.graphs: dict[int, tuple[object, object, AttnMetadata]] = {}
        self.lora_graphs: dict[int, object] = {}  # batch size -> its graph with the LoRA ops
        self._planned: dict[int, bytes] = {}  # batch size -> the indptr its wrapper was last planned with
        self.plans = self.replays = self.lora_replays = 0

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
            self.api.synchronize()
            graph, pool = self.api.capture(lambda bs=bs, meta=meta: self._run_model(bs, meta), pool)
            self.graphs[bs] = (graph, wrapper, meta)
            if self.lora is not None:
                self._run_model(bs, meta, lora=True)
                self.api.synchronize()
                self.lora_graphs[bs], pool = self.api.capture(
                    lambda bs=bs, meta=meta: self._run_model(bs, meta, lora=True), pool)
            self._planned.pop(bs, None)  # capture rows are not a real batch: plan the first replay

    def _meta(self, bs: int, rows: list[RowSpec]) -> AttnMetadata:
        """Metadata whose device tensors are the static buffers the graph reads."""
        meta = build_metadata(rows, self.kv.page_size, self.input_ids.device)
        meta.slot_mapping = self.slots[:bs]
        meta.positions = self.positions[:bs]
        return meta

    def _run_model(self, bs: int, meta: AttnMetadata, lora: bool = False) -> None:
        applied = contextlib.nullcontext()
        if lora:
            assert self.lora is not None
            batch = LoraBatch(frozenset(self.lora.layout.shapes), seg_indptr=self.lora_bounds[:bs + 1],
                              weight_indices=self.lora_slots[:bs], segments=bs)
            applied = self.lora.applied(batch)
        with applied:
            out = self.runner.model(input_ids=self.input_ids[None, :bs], position_ids=self.positions[None, :bs],
                                    use_cache=False, logits_to_keep=self.keep[:bs],
                                    rsinfer_ctx=ForwardContext(self.backend, meta))
        self.logits[:bs].copy_(out.logits[0])  # one buffer for every size; fp32 for the sampler

    def fits(self, num_rows: int, lora: bool = False) -> bool:
        """Whether `num_rows` decode rows replay a graph (`lora`: some row has an adapter)."""
        return num_rows <= self.top and (not lora or self.lora is not None)

    def run(self, rows: list[RowSpec], input_ids: list[int], device_tokens: DeviceTokens | None = None,
            adapters: list[int] | None = None) -> torch.Tensor:
        """Replay the graph of the decode rows' padded size (with the LoRA ops when `adapters`, each row's
        slot, is given); fp32 logits [len(rows), vocab], a view of the shared buffer valid until the next
        replay is queued."""
        n = len(rows)
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        graph, wrapper, _meta = self.graphs[bs]
        if adapters is not None:
            graph = self.lora_graphs[bs]
            self.lora_replays += 1
        top, ps = self.top, self.kv.page_size
        positions, slots, last, indptr, indices = decode_table(rows, ps)
        total = len(indices) + (bs - n)  # a pad row reads the scratch page
        if total > self.max_pages:
            raise RuntimeError(f"decode batch reads {total} pages; the graph buffers hold {self.max_pages}")
        longs = np.zeros(6 * top, dtype=np.int64)  # pad rows: position 0, slot 0 (the scratch page's), base
        longs[:n] = input_ids
        longs[top:top + n] = positions
        longs[2 * top:2 * top + n] = slots
        if adapters is not None:
            longs[5 * top:5 * top + n] = adapters
        identity = False
        if device_tokens is not None:
            p, src = device_tokens.positions, device_tokens.rows
            # the steady state: every row reads the row it had in the step in flight
            identity = len(p) == n == device_tokens.source.shape[0] and p[-1] == n - 1 and src == p
            if not identity:
                longs[3 * top:3 * top + len(p)] = p
                longs[4 * top:4 * top + len(p)] = src
        ints = np.empty(2 * top + 1 + total, dtype=np.int32)
        ints[:n + 1] = indptr
        ints[n + 1:top + 1] = np.arange(len(indices) + 1, len(indices) + top - n + 1)
        ints[top + 1:top + 1 + n] = last
        ints[top + 1 + n:2 * top + 1] = 1
        ints[2 * top + 1:2 * top + 1 + len(indices)] = indices
        ints[2 * top + 1 + len(indices):] = SCRATCH_PAGE
        dev = self.longs.device
        self.longs.copy_(host_tensor(longs, torch.int64, dev), non_blocking=True)
        self.ints[:len(ints)].copy_(host_tensor(ints, torch.int32, dev), non_blocking=True)
        if identity:
            self.input_ids[:n].copy_(device_tokens.source)
        elif device_tokens is not None:
            k = len(device_tokens.positions)
            src = device_tokens.source.index_select(0, self.patch_src[:k])
            self.input_ids.index_copy_(0, self.patch_pos[:k], src)
        kv_indptr = ints[:bs + 1]
        key = kv_indptr.tobytes()
        if self.backend.use_tensor_cores or self._planned.get(bs) != key:
            # The buffers already hold this batch's page table: plan() copies them onto themselves.
            self.backend.plan_decode(wrapper, torch.from_numpy(kv_indptr.copy()), self.indices[:total],
                                     torch.from_numpy(ints[top + 1:top + 1 + bs].copy()))
            self._planned[bs] = key
            self.plans += 1
        self.replays += 1
        self.api.replay(graph)
        return self.logits[:n]


def decode_table(rows: list[RowSpec], page_size: int):
    """(positions, slots, last page lengths, indptr, page ids) of one-token rows, as lists: a Python loop is
    cheaper than numpy's per-call overhead at small batches, and no slower than the general builder at 256."""
    positions, slots, last, indptr, indices = [], [], [], [0], []
    for r in rows:
        start, pages = r.start, r.pages
        page, offset = divmod(start, page_size)
        positions.append(start)
        slots.append(pages[page] * page_size + offset)
        last.append(offset + 1)
        indices += pages[:page + 1]
        indptr.append(len(indices))
    return positions, slots, last, indptr, indices


def failure_cause(exc: BaseException) -> str:
    """`Type: message` of an exception and of what it was raised while handling: a capture that fails
    mid-graph reports the capture's end, while the cause is the error that interrupted it."""
    causes = []
    seen: BaseException | None = exc
    while seen is not None and len(causes) < 3:
        causes.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)
    return " <- ".join(causes)
