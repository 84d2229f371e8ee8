"""A fake `flashinfer` for CPU tests: every call is checked against 0.7.x's signatures (flashinfer_signatures.py)
and the conventions the engine relies on, and attention is computed in torch from exactly what `plan()` was
given, so the engine's flashinfer path (and CUDA-graph replay, with `StandInGraphs`) can be compared with
its torch path token for token.

What is checked, as flashinfer 0.7.4's source does or documents it: NHD layout; plan() outside any graph
capture; indptr and last_page_len int32 host tensors, page ids int32; q/kv data types given (plan defaults
to float16) and equal to what run() gets; keywords only after page_size; causal prefill; a CUDA-graph
wrapper planned with its fixed batch size, and replayed only with buffers holding what its plan was for
(its CUDA-core schedule depends on indptr; with tensor cores also on the kv lengths); the segment GEMM (LoRA) takes
fp16/bf16 only (its CUTLASS kernels dispatch on those), a 2-D contiguous x, 3-D contiguous weights of x's dtype,
int64 segment bounds and weight indices on x's device with one index per segment, and is allowed inside a graph
capture (it has no plan). Prefill "auto" picks
fa3 on SM90 when some row has more than 64 new tokens, else fa2 (0.7.4's `_determine_auto_backend`); every
(kind, backend) pair planned is recorded with the phase it was first planned in, as a first JIT compile.
"""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from services.scheduler.engine.cuda_graph import GraphApi
from tests.unit.engine.flashinfer_signatures import bind

__version__ = "0.7.4+fake"


@dataclass
class Record:
    """What the fake saw: plans per kind, kernels first used ("compiled") per phase, run counts."""

    phase: str = "serve"
    sm: int = 90
    capturing: bool = False
    compiled: dict[tuple, str] = field(default_factory=dict)  # (kind, backend, ...) -> phase of first use
    plans: int = 0
    runs: int = 0

    def used(self, key: tuple) -> None:
        self.compiled.setdefault(key, self.phase)


RECORD = Record()


def reset(sm: int = 90) -> Record:
    global RECORD
    RECORD = Record(sm=sm)
    return RECORD


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(f"fake flashinfer: {message}")


def _check_csr(indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor, page_size: int) -> None:
    _check(indptr.device.type == "cpu" and indptr.dtype == torch.int32, "indptr must be a host int32 tensor")
    _check(last.device.type == "cpu" and last.dtype == torch.int32, "last_page_len must be a host int32 tensor")
    _check(indices.dtype == torch.int32, "page indices must be int32")
    _check(len(indptr) == len(last) + 1 and int(indptr[0]) == 0, "indptr is [batch + 1] from 0")
    _check(bool((indptr[1:] >= indptr[:-1]).all()), "indptr must not decrease")
    _check(len(indices) >= int(indptr[-1]), "fewer page ids than indptr says")
    _check(bool(((last >= 1) & (last <= page_size)).all()), "last_page_len must be in 1..page_size")


def _check_dtypes(kw: dict) -> None:
    _check("q_data_type" in kw, "q_data_type must be given (plan's default is float16)")
    _check(kw.get("kv_data_type", kw["q_data_type"]) == kw["q_data_type"], "q and kv data types differ")


def _check_cache(paged_kv_cache, heads: tuple[int, int, int], page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check(isinstance(paged_kv_cache, tuple) and len(paged_kv_cache) == 2, "paged_kv_cache must be (k, v)")
    k, v = paged_kv_cache
    _, hkv, dim = heads
    _check(k.shape == v.shape and k.dim() == 4 and tuple(k.shape[1:]) == (page_size, hkv, dim),
           f"NHD pages are [pages, {page_size}, {hkv}, {dim}], got {tuple(k.shape)}")
    return k, v


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Lq, Hq, D] over k/v [L, Hkv, D], bottom-right causal (query i sees keys <= L - Lq + i)."""
    lq, hq, _ = q.shape
    group = hq // k.shape[1]
    kk = k.float().repeat_interleave(group, dim=1)
    vv = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale
    seen = torch.arange(k.shape[0])[None, :] <= (k.shape[0] - lq + torch.arange(lq))[:, None]
    probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, vv).to(q.dtype)


@dataclass
class _Plan:
    qo_indptr: list[int]
    kv_indptr: list[int]
    indices: list[int]
    last: list[int]
    heads: tuple[int, int, int]
    page_size: int
    scale: float
    q_dtype: torch.dtype


def _run_paged(plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    hq, hkv, dim = plan.heads
    _check(q.dim() == 3 and tuple(q.shape[1:]) == (hq, dim), f"q must be [tokens, {hq}, {dim}]")
    _check(q.shape[0] == plan.qo_indptr[-1], f"q has {q.shape[0]} rows, the plan {plan.qo_indptr[-1]}")
    _check(q.dtype == plan.q_dtype, f"q is {q.dtype}, planned {plan.q_dtype}")
    _check(q.is_contiguous(), "q must be contiguous")
    out = torch.empty_like(q)
    ps = plan.page_size
    for b in range(len(plan.last)):
        pages = plan.indices[plan.kv_indptr[b]:plan.kv_indptr[b + 1]]
        kv_len = (len(pages) - 1) * ps + plan.last[b]
        kb = k[pages].reshape(-1, hkv, dim)[:kv_len]
        vb = v[pages].reshape(-1, hkv, dim)[:kv_len]
        lo, hi = plan.qo_indptr[b], plan.qo_indptr[b + 1]
        out[lo:hi] = _attend(q[lo:hi], kb, vb, plan.scale)
    return out


class BatchDecodeWithPagedKVCacheWrapper:
    _name = "BatchDecodeWithPagedKVCacheWrapper"

    def __init__(self, *args, **kwargs):
        bind(f"{self._name}.__init__", self, *args, **kwargs)
        sig = _bound(f"{self._name}.__init__", self, *args, **kwargs)
        _check(sig["kv_layout"] == "NHD", "the engine's pages are NHD")
        self.workspace = sig.get("float_workspace_buffer", sig.get("workspace_buffer"))
        _check(self.workspace.dtype == torch.uint8, "the float workspace is a uint8 buffer")
        self.use_tensor_cores = sig["use_tensor_cores"]
        self.graph = sig.get("use_cuda_graph", False)
        self.plan_: _Plan | None = None
        self.backend = sig.get("backend", "auto")

    def plan(self, *args, **kwargs) -> None:
        bind("BatchDecodeWithPagedKVCacheWrapper.plan", self, *args, **kwargs)  # the graph wrapper inherits it
        _check(len(args) == 7, "decode plan options after page_size go by keyword (positional is deprecated)")
        bind("BatchDecodeWithPagedKVCacheWrapper._plan_impl", self, *args, **kwargs)
        _check(not RECORD.capturing, "plan() inside a CUDA graph capture")
        indptr, indices, last, hq, hkv, dim, ps = args
        _check_csr(indptr, indices, last, ps)
        _check_dtypes(kwargs)
        RECORD.plans += 1
        RECORD.used(("decode", "fa2", self.use_tensor_cores, kwargs["q_data_type"], dim))
        self._store(indptr, indices, last)
        self.plan_ = _Plan(list(range(len(last) + 1)), indptr.tolist(), indices.tolist(), last.tolist(),
                           (hq, hkv, dim), ps, kwargs.get("sm_scale") or dim ** -0.5, kwargs["q_data_type"])

    def _store(self, indptr, indices, last) -> None:
        pass  # a non-graph wrapper copies what it was given into buffers of its own (the plan snapshot)

    def run(self, *args, **kwargs) -> torch.Tensor:
        bind("BatchDecodeWithPagedKVCacheWrapper.run", self, *args, **kwargs)
        _check(self.plan_ is not None, "run() before plan()")
        q, paged_kv_cache = args[:2]
        k, v = _check_cache(paged_kv_cache, self.plan_.heads, self.plan_.page_size)
        RECORD.runs += 1
        return _run_paged(self._current_plan(), q, k, v)

    def _current_plan(self) -> _Plan:
        return self.plan_


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    """Kernels read the page table from the buffers given at construction, at replay time; the schedule
    plan() computed must still fit them."""

    _name = "CUDAGraphBatchDecodeWithPagedKVCacheWrapper"

    def __init__(self, *args, **kwargs):
        bind(f"{self._name}.__init__", self, *args, **kwargs)
        sig = _bound(f"{self._name}.__init__", self, *args, **kwargs)
        _check(sig["kv_layout"] == "NHD", "the engine's pages are NHD")
        self.workspace = sig["workspace_buffer"]
        self.use_tensor_cores = sig["use_tensor_cores"]
        self.indptr_buf, self.indices_buf = sig["indptr_buffer"], sig["indices_buffer"]
        self.last_buf = sig["last_page_len_buffer"]
        for buf in (self.indptr_buf, self.indices_buf, self.last_buf):
            _check(buf.dtype == torch.int32, "graph buffers are int32")
        self.batch_size = len(self.last_buf)
        self.graph = True
        self.plan_ = None
        self.planned_indptr: list[int] = []
        self.planned_last: list[int] = []

    def _store(self, indptr, indices, last) -> None:
        _check(len(last) == self.batch_size, f"a graph wrapper's batch size is fixed at {self.batch_size}")
        _check(len(indices) <= len(self.indices_buf), "more page ids than the graph's buffer holds")
        self.indptr_buf.copy_(indptr)
        self.last_buf.copy_(last)
        self.indices_buf[:len(indices)].copy_(indices)
        self.planned_indptr, self.planned_last = indptr.tolist(), last.tolist()

    def _current_plan(self) -> _Plan:
        indptr = self.indptr_buf.tolist()
        last = self.last_buf.tolist()
        _check(indptr == self.planned_indptr, "replayed with pages per row its plan() was not made for")
        if self.use_tensor_cores:
            _check(last == self.planned_last, "tensor-core decode replayed with kv lengths it was not planned for")
        return _Plan(self.plan_.qo_indptr, indptr, self.indices_buf[:indptr[-1]].tolist(), last,
                     self.plan_.heads, self.plan_.page_size, self.plan_.scale, self.plan_.q_dtype)


class BatchPrefillWithPagedKVCacheWrapper:
    _name = "BatchPrefillWithPagedKVCacheWrapper"

    def __init__(self, *args, **kwargs):
        bind(f"{self._name}.__init__", self, *args, **kwargs)
        sig = _bound(f"{self._name}.__init__", self, *args, **kwargs)
        _check(sig["kv_layout"] == "NHD", "the engine's pages are NHD")
        _check(sig["float_workspace_buffer"].dtype == torch.uint8, "the float workspace is a uint8 buffer")
        self.workspace = sig["float_workspace_buffer"]
        self.requested = sig["backend"]
        self.plan_: _Plan | None = None

    def plan(self, *args, **kwargs) -> None:
        bind(f"{self._name}.plan", self, *args, **kwargs)
        _check(len(args) == 8, "prefill plan options after page_size go by keyword")
        _check(not RECORD.capturing, "plan() inside a CUDA graph capture")
        qo, indptr, indices, last, hq, hkv, dim, ps = args
        _check(qo.device.type == "cpu" and qo.dtype == torch.int32, "qo_indptr must be a host int32 tensor")
        _check_csr(indptr, indices, last, ps)
        _check_dtypes(kwargs)
        _check(kwargs.get("causal") is True, "prefill must be causal (bottom-right aligned)")
        q_lens = (qo[1:] - qo[:-1]).tolist()
        backend = self.requested
        if backend == "auto":  # 0.7.4 on SM90: fa3, unless no row has more than 64 new tokens
            backend = "fa3" if RECORD.sm == 90 and max(q_lens) > 64 else "fa2"
        RECORD.plans += 1
        RECORD.used(("prefill", backend, kwargs["q_data_type"], dim))
        self.plan_ = _Plan(qo.tolist(), indptr.tolist(), indices.tolist(), last.tolist(), (hq, hkv, dim), ps,
                           kwargs.get("sm_scale") or dim ** -0.5, kwargs["q_data_type"])

    def run(self, *args, **kwargs) -> torch.Tensor:
        bind(f"{self._name}.run", self, *args, **kwargs)
        _check(self.plan_ is not None, "run() before plan()")
        q, paged_kv_cache = args[:2]
        k, v = _check_cache(paged_kv_cache, self.plan_.heads, self.plan_.page_size)
        RECORD.runs += 1
        return _run_paged(self.plan_, q, k, v)


class SegmentGEMMWrapper:
    """y[seg] = x[seg] @ W[weight_indices[seg]]^T per segment (weight_column_major: W is [n, d_out, d_in]),
    accumulated in fp32 and written in x's dtype, as the CUTLASS grouped GEMM does."""

    def __init__(self, *args, **kwargs):
        bind("SegmentGEMMWrapper.__init__", self, *args, **kwargs)
        sig = _bound("SegmentGEMMWrapper.__init__", self, *args, **kwargs)
        _check(isinstance(sig["float_workspace_buffer"], torch.Tensor), "the float workspace is a tensor")
        _check(sig["backend"] in ("auto", "sm80", "sm90"), f"unknown segment GEMM backend {sig['backend']!r}")
        self.backend = sig["backend"]
        self.runs = 0

    def run(self, *args, **kwargs) -> torch.Tensor:
        bind("SegmentGEMMWrapper.run", self, *args, **kwargs)
        sig = _bound("SegmentGEMMWrapper.run", self, *args, **kwargs)
        x, w, n, column_major = sig["x"], sig["weights"], sig["batch_size"], sig["weight_column_major"]
        indptr, index = sig["seg_indptr"], sig["weight_indices"]
        _check(x.dtype in (torch.float16, torch.bfloat16), f"segment GEMM kernels take fp16/bf16, not {x.dtype}")
        _check(w.dtype == x.dtype, f"weights are {w.dtype}, x is {x.dtype}")
        _check(x.dim() == 2 and x.is_contiguous(), "x must be a contiguous [tokens, d_in] tensor")
        _check(w.dim() == 3 and w.is_contiguous(), "weights must be a contiguous [n, rows, cols] tensor")
        _check(isinstance(n, int) and n >= 1, "batch_size is the number of segments, a host int")
        _check(indptr is not None and sig["seg_lens"] is None, "the engine passes seg_indptr")
        for name, t, size in (("seg_indptr", indptr, n + 1), ("weight_indices", index, n)):
            _check(isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.device == x.device,
                   f"{name} must be an int64 tensor on x's device")
            _check(t.dim() == 1 and t.numel() == size, f"{name} has {size} entries for {n} segments")
        d_out, d_in = (w.shape[1], w.shape[2]) if column_major else (w.shape[2], w.shape[1])
        _check(x.shape[1] == d_in, f"x has {x.shape[1]} columns, the weights take {d_in}")
        bounds, which = indptr.tolist(), index.tolist()
        _check(bounds[0] == 0 and bounds[-1] == x.shape[0] and bounds == sorted(bounds),
               f"seg_indptr {bounds} does not cover the {x.shape[0]} rows of x")
        _check(all(0 <= i < w.shape[0] for i in which), f"weight_indices {which} out of [0, {w.shape[0]})")
        out = sig["out"]
        if out is None:
            out = torch.zeros(x.shape[0], d_out, dtype=x.dtype, device=x.device)
        _check(tuple(out.shape) == (x.shape[0], d_out), "out has the wrong shape")
        backend = self.backend if self.backend != "auto" else ("sm90" if RECORD.sm == 90 else "sm80")
        RECORD.used(("segment_gemm", backend, x.dtype))
        RECORD.runs += 1
        self.runs += 1
        for k in range(n):
            lo, hi = bounds[k], bounds[k + 1]
            weight = w[which[k]].float()
            out[lo:hi] = (x[lo:hi].float() @ (weight.T if column_major else weight)).to(out.dtype)
        return out


gemm = types.SimpleNamespace(SegmentGEMMWrapper=SegmentGEMMWrapper)


def _bound(name: str, *args, **kwargs) -> dict:
    from tests.unit.engine.flashinfer_signatures import signature

    bound = signature("0.7.4", name).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _sampling_from_logits(*args, **kwargs) -> torch.Tensor:
    bind("sampling.sampling_from_logits", *args, **kwargs)
    RECORD.used(("sampling", "sampling_from_logits"))
    logits = args[0]
    probs = logits.float().softmax(-1)
    return torch.multinomial(probs, 1, generator=kwargs.get("generator"))[:, 0].int()


def _top_k_top_p_sampling_from_logits(*args, **kwargs) -> torch.Tensor:
    bind("sampling.top_k_top_p_sampling_from_logits", *args, **kwargs)
    RECORD.used(("sampling", "top_k_top_p_sampling_from_logits"))
    logits, top_k, top_p = args[:3]
    _check(kwargs.get("filter_apply_order", "top_k_first") == "top_k_first", "the engine applies top-k first")
    x = logits.float()
    vocab = x.shape[-1]
    sorted_x, order = x.sort(-1, descending=True)
    rank = torch.arange(vocab)[None]
    drop = rank >= torch.as_tensor(top_k).reshape(-1, 1)
    p = sorted_x.masked_fill(drop, float("-inf")).softmax(-1)
    drop |= (p.cumsum(-1) - p) > torch.as_tensor(top_p).reshape(-1, 1)
    keep = torch.zeros_like(drop).scatter(-1, order, ~drop)
    probs = x.masked_fill(~keep, float("-inf")).softmax(-1)
    return torch.multinomial(probs, 1, generator=kwargs.get("generator"))[:, 0].int()


sampling = types.SimpleNamespace(sampling_from_logits=_sampling_from_logits,
                                 top_k_top_p_sampling_from_logits=_top_k_top_p_sampling_from_logits)


def module() -> types.ModuleType:
    """This fake as the `flashinfer` module."""
    return sys.modules[__name__]


class StandInGraphs(GraphApi):
    """CUDA graphs on CPU: capture runs the function once (plan() inside it fails) and keeps it; a replay runs
    it again over the static buffers as they are then. `on_replay`, when set, runs the replay (an op counter
    pauses itself there and counts a replay as the one launch it is on a GPU)."""

    on_replay = None

    def check(self, device: torch.device) -> None:
        pass

    def capture(self, fn, pool):
        RECORD.capturing = True
        try:
            fn()
        finally:
            RECORD.capturing = False
        return fn, pool

    def replay(self, graph) -> None:
        if self.on_replay is not None:
            self.on_replay(graph)
        else:
            graph()

    def synchronize(self) -> None:
        pass


@contextmanager
def installed(monkeypatch, graphs: bool = True, sm: int = 90):
    """The fake as `flashinfer`, and (with `graphs`) CUDA graphs stood in on CPU."""
    from services.scheduler.engine.cuda_graph import DecodeGraphs

    record = reset(sm)
    monkeypatch.setitem(sys.modules, "flashinfer", module())
    if graphs:
        monkeypatch.setattr(DecodeGraphs, "api", StandInGraphs())
    yield record
