"""LoRA adapters in the paged engine: many resident at once, any mix of them and the base model in one step.

Weights. Every projection an adapter may target (`LORA_TARGETS`, the attention and MLP projections PEFT
adapters use) gets two stacked tensors on the device, allocated once: A `[layers, slots, R, in]` and B
`[layers, slots, out, R]`, R the largest rank (`--max-lora-rank`, padded to a multiple of 8 for the segment
GEMM's 16-byte alignment). Slot 0 is all zeros, the base model's (as page 0 is the KV cache's scratch page);
slots 1..max_loras hold adapters. An adapter of a smaller rank is zero-padded, a projection it does not target is
zero, and its scaling (lora_alpha / r, or / sqrt(r) with rsLoRA) is folded into its B once at load, so a row's
output is `base(x) + (x A^T) B^T` with no per-step scaling op.

Loading. A request that names an adapter waits in the queue (as one waits for its grammar) while a loader
thread fetches the folder (`AdapterSource.fetch`: a path, or the object store's local copy) and reads, checks
and pads it on the host; the step thread then copies it into a free slot, or into the least recently used slot
no sequence is bound to. A sequence binds to its adapter's slot when it leaves that wait and stays bound,
preempted or not, until it ends, so a slot is never overwritten under a sequence that reads it (on CUDA the
copy is queued behind any step still in flight that read the old weights). When more adapters are wanted than
slots are idle, the least recently used bound slots are drained: no new sequence binds to them, and once their
sequences end they are evicted, so every adapter in use is served in turn whatever --max-loras is.

Compute. A step whose rows are all base runs the model as it is: nothing of this module is on its path (the
projections' `forward` is replaced only for the steps that carry adapter rows, and CUDA graphs are captured
twice, with and without the LoRA ops, when adapters are on). A LoRA step adds each row's delta to the target
projections' outputs: on CPU (and on CUDA without flashinfer) grouped matmuls, one pair per adapter present
in the step over the tokens of its rows; on CUDA with flashinfer, two of its segment GEMMs per projection
(one segment per run of rows of one slot, base rows on the zero slot), whose slot indices and segment
bounds are device tensors, so decode graphs replay them from static buffers.

Adapter names are identities: one name means one set of weights for the engine's life (its prefix-cache
pages are named after it, shared/pages.py `adapter_root`). A folder whose weights change must come under a
new name (e.g. `name@version` in a registry).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from services.scheduler.engine.base import RequestRejected
from services.scheduler.engine.transfer import to_device
from shared.lora_folder import (
    LORA_TARGETS,
    TENSOR_KEY,
    WEIGHTS_FILE,
    AdapterError,
    check_target_modules,
    config_json,
    rank_and_scaling,
)

if TYPE_CHECKING:
    from services.scheduler.engine.sequence import Seq

log = logging.getLogger(__name__)

BASE_SLOT = 0  # the zero adapter: base rows of a segment GEMM read it
MAX_NAME_CHARS = 256
RANK_ALIGN = 8  # the segment GEMM's CUTLASS kernels want 16-byte aligned rows (8 bf16/fp16 elements)
SEGMENT_WORKSPACE_BYTES = 128 << 20  # flashinfer's SegmentGEMMWrapper: "the recommended size is 128 MiB"
REMEMBERED_FAILURES = 256  # bad folders remembered (refused at add without another load), least recent dropped
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class AdapterSource(Protocol):
    """Where adapters come from, by name. `knows` is called on the step thread (cheap: a registry lookup);
    `fetch` on the loader thread and may block (a download): it returns a local PEFT folder
    (adapter_config.json + adapter_model.safetensors), raises KeyError for a name it no longer knows and
    anything else for a failure worth retrying later (storage unreachable)."""

    def knows(self, name: str) -> bool: ...

    def fetch(self, name: str) -> Path: ...


class AdapterFolders:
    """An AdapterSource over fixed local folders (`--lora-modules name=path`, tests)."""

    def __init__(self, folders: Mapping[str, str | Path]):
        self.folders = {name: Path(path) for name, path in folders.items()}

    def knows(self, name: str) -> bool:
        return name in self.folders

    def fetch(self, name: str) -> Path:
        return self.folders[name]


class StoredAdapters:
    """An AdapterSource over the object store (shared/storage.py): `prefixes` maps a name to its folder's prefix
    (e.g. "adapters/sql"; a live mapping a registry may update). `fetch` runs `ObjectStore.fetch_folder` on `loop`
    (the worker's event loop) and waits for it on the loader thread, at most `timeout_s`."""

    def __init__(self, store, loop: asyncio.AbstractEventLoop, prefixes: Mapping[str, str], timeout_s: float = 600.0):
        self.store, self.loop, self.prefixes, self.timeout_s = store, loop, prefixes, timeout_s

    def knows(self, name: str) -> bool:
        return name in self.prefixes

    def fetch(self, name: str) -> Path:
        prefix = self.prefixes[name]
        return asyncio.run_coroutine_threadsafe(self.store.fetch_folder(prefix), self.loop).result(self.timeout_s)


# ---- the model's projections


@dataclass(frozen=True)
class TargetShape:
    in_features: int
    out_features: int


@dataclass
class LoraLayout:
    """The projections of a model that adapters may target: per target name its shape and its module in
    each layer, and the module names PEFT's keys use."""

    num_layers: int
    shapes: dict[str, TargetShape]
    modules: dict[str, list[torch.nn.Linear]]
    by_name: dict[str, tuple[str, int]]  # "model.layers.3.self_attn.q_proj" -> ("q_proj", 3)

    @classmethod
    def of(cls, model: torch.nn.Module) -> LoraLayout:
        found: dict[str, dict[int, tuple[str, torch.nn.Linear]]] = {}
        for qualified, module in model.named_modules():
            parts = qualified.split(".")
            layer = next((int(p) for p in parts if p.isdigit()), None)
            if parts[-1] in LORA_TARGETS and isinstance(module, torch.nn.Linear) and layer is not None:
                found.setdefault(parts[-1], {})[layer] = (qualified, module)
        num_layers = max((max(per) + 1 for per in found.values()), default=0)
        shapes, modules, by_name = {}, {}, {}
        for target in LORA_TARGETS:
            per = found.get(target, {})
            dims = {(m.in_features, m.out_features) for _, m in per.values()}
            if len(per) != num_layers or len(dims) != 1:  # not in every layer alike: it cannot be stacked
                if per:
                    log.warning("LoRA: %s is not in every layer with one shape; adapters cannot target it", target)
                continue
            (fan_in, fan_out), = dims
            shapes[target] = TargetShape(fan_in, fan_out)
            modules[target] = [per[i][1] for i in range(num_layers)]
            by_name.update({per[i][0]: (target, i) for i in range(num_layers)})
        if not shapes:
            raise ValueError(f"{type(model).__name__} has none of the projections LoRA adapters target "
                             f"({', '.join(LORA_TARGETS)})")
        return cls(num_layers, shapes, modules, by_name)


def stack_rank(max_rank: int) -> int:
    return -(-max_rank // RANK_ALIGN) * RANK_ALIGN


def stack_bytes(layout: LoraLayout, max_loras: int, max_rank: int, dtype: torch.dtype) -> int:
    """Device bytes of the stacked weights of `max_loras` slots (and the zero slot) at rank `max_rank`."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_slot = sum(s.in_features + s.out_features for s in layout.shapes.values()) * stack_rank(max_rank)
    return layout.num_layers * (max_loras + 1) * per_slot * elem


# ---- reading a folder (the loader thread)


@dataclass
class HostAdapter:
    """An adapter read, checked and laid out as one slot of the stacks, on the host."""

    rank: int
    scaling: float
    a: dict[str, torch.Tensor]  # target -> [layers, R, in]
    b: dict[str, torch.Tensor]  # target -> [layers, out, R], scaling folded in

    @property
    def targets(self) -> frozenset[str]:
        return frozenset(self.a)


def read_config(folder: Path, max_rank: int) -> tuple[dict, int, float]:
    """adapter_config.json checked (shared/lora_folder.py): (the config, its rank, its scaling)."""
    config = config_json(folder)
    rank, scaling = rank_and_scaling(config, max_rank)
    return config, rank, scaling


def _tensor_keys(handle, layout: LoraLayout, rank: int) -> dict[tuple[str, int], dict[str, str]]:
    """(target, layer) -> {"A": key, "B": key}, with every key's shape and dtype checked (data not read)."""
    pairs: dict[tuple[str, int], dict[str, str]] = {}
    for key in handle.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
        m = TENSOR_KEY.match(key)
        if m is None:
            raise AdapterError(f"tensor {key!r} is not a LoRA A/B weight of a projection (embeddings, heads and "
                               "biases are not served)")
        where = layout.by_name.get(m["module"])
        if where is None:
            raise AdapterError(f"tensor {key!r} targets {m['module']}, which is not a projection of this model "
                               f"adapters may target ({', '.join(layout.shapes)})")
        piece = handle.get_slice(key)
        dtype = piece.get_dtype()
        if dtype not in _DTYPES:
            raise AdapterError(f"tensor {key!r} is {dtype}; weights must be F32, F16 or BF16")
        shape = tuple(piece.get_shape())
        s = layout.shapes[where[0]]
        want = (rank, s.in_features) if m["ab"] == "A" else (s.out_features, rank)
        if shape != want:
            raise AdapterError(f"tensor {key!r} has shape {list(shape)}, expected {list(want)} (rank {rank})")
        pairs.setdefault(where, {})[m["ab"]] = key
    if not pairs:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
    half = [f"{t} of layer {i}" for (t, i), ab in pairs.items() if len(ab) != 2]
    if half:
        raise AdapterError(f"lora_A without lora_B (or the reverse) for {', '.join(half[:4])}")
    return pairs


def read_adapter(folder: Path, layout: LoraLayout, max_rank: int, dtype: torch.dtype, pin: bool = False
                 ) -> HostAdapter:
    """Read and check a PEFT folder against the model's layout and lay it out as one slot; AdapterError
    if it cannot be served. Shapes and dtypes are checked from the safetensors header before any data is read."""
    from safetensors import SafetensorError, safe_open

    config, rank, scaling = read_config(folder, max_rank)
    check_target_modules(config, layout.shapes)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise AdapterError(f"{WEIGHTS_FILE} is missing (only safetensors weights are served)")
    R, L = stack_rank(max_rank), layout.num_layers
    a: dict[str, torch.Tensor] = {}
    b: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(weights), framework="pt") as handle:
            pairs = _tensor_keys(handle, layout, rank)
            for (target, layer), ab in pairs.items():
                s = layout.shapes[target]
                if target not in a:
                    a[target] = torch.zeros(L, R, s.in_features, dtype=torch.float32)
                    b[target] = torch.zeros(L, s.out_features, R, dtype=torch.float32)
                wa, wb = handle.get_tensor(ab["A"]).float(), handle.get_tensor(ab["B"]).float()
                if not (torch.isfinite(wa).all() and torch.isfinite(wb).all()):
                    raise AdapterError(f"the weights of {target} in layer {layer} are not all finite")
                a[target][layer, :rank] = wa
                b[target][layer, :, :rank] = wb * scaling
    except SafetensorError as e:
        raise AdapterError(f"{WEIGHTS_FILE} cannot be read: {e}") from None
    for table in (a, b):
        for target, t in table.items():
            t = t.to(dtype)
            table[target] = t.pin_memory() if pin else t
    return HostAdapter(rank, scaling, a, b)


# ---- one step's rows on the adapters


@dataclass
class LoraBatch:
    """How a step's packed tokens map onto slots. Grouped: `groups` of (slot, token rows, rank), base rows
    in none. Segments: `seg_indptr` / `weight_indices` device tensors of `segments` runs of rows."""

    targets: frozenset[str]
    groups: list[tuple[int, slice | torch.Tensor, int]] = field(default_factory=list)
    seg_indptr: torch.Tensor | None = None
    weight_indices: torch.Tensor | None = None
    segments: int = 0


@dataclass
class _Entry:
    """One adapter the engine knows of now: loading (future), resident (slot), or both gone."""

    name: str
    future: Future | None = None  # of a HostAdapter, while it is read and until it is placed
    slot: int = 0
    targets: frozenset[str] = frozenset()
    rank: int = 0
    retired: bool = False  # unloaded while sequences were bound to it: no new ones bind


class LoraManager:
    """The stacked weights, the slots and their adapters, the loader thread, and the per-step LoRA ops."""

    def __init__(self, model: torch.nn.Module, source: AdapterSource | None, max_loras: int, max_rank: int,
                 segment_gemm=None):
        param = next(model.parameters())
        self.layout = LoraLayout.of(model)
        self.source = source
        self.max_loras, self.max_rank = max_loras, max_rank
        self.dtype, self.device = param.dtype, param.device
        R, L, slots = stack_rank(max_rank), self.layout.num_layers, max_loras + 1
        self.a = {t: torch.zeros(L, slots, R, s.in_features, dtype=self.dtype, device=self.device)
                  for t, s in self.layout.shapes.items()}
        self.b = {t: torch.zeros(L, slots, s.out_features, R, dtype=self.dtype, device=self.device)
                  for t, s in self.layout.shapes.items()}
        self.nbytes = stack_bytes(self.layout, max_loras, max_rank, self.dtype)
        self.segment_gemm = segment_gemm  # flashinfer's SegmentGEMMWrapper, or None: grouped torch matmuls
        self.slots: list[_Entry | None] = [None] * slots  # slot 0 stays None: the base model's zeros
        self.entries: dict[str, _Entry] = {}
        self.failed: OrderedDict[str, str] = OrderedDict()  # name -> why its folder cannot be served
        self.last_used = [0] * slots
        self.draining: set[int] = set()
        self.pending = False  # some waiting sequence is not bound to its adapter yet
        self.loads = self.evictions = 0
        self._tick = 0
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="lora")
        self._lock = threading.Lock()  # `failed` is written by the loader thread too
        self.batch: LoraBatch | None = None  # the step being run, read by the patched projections
        self._forwards = {(t, i): self._lora_forward(m, t, i) for t, ms in self.layout.modules.items()
                          for i, m in enumerate(ms)}
        log.info("LoRA: %d slots of rank %d for %s x %d layers (%.1f MiB on %s), %s", max_loras, max_rank,
                 ", ".join(self.layout.shapes), L, self.nbytes / 2**20, self.device,
                 "flashinfer segment GEMM" if segment_gemm is not None else "grouped torch matmuls")

    # ---- admission (the step thread)

    def check(self, name: str) -> None:
        """Refuse a request for an adapter that can never be served here; start loading the others."""
        if not name or len(name) > MAX_NAME_CHARS:
            raise RequestRejected(f"a LoRA adapter name has 1 to {MAX_NAME_CHARS} characters", code="model_not_found",
                                  param="model")
        with self._lock:
            why = self.failed.get(name)
        if why is not None:
            raise RequestRejected(f"LoRA adapter '{name}' cannot be used: {why}", code="invalid_lora_adapter",
                                  param="model")
        if self.source is None or not self.source.knows(name):
            raise RequestRejected(f"no LoRA adapter named '{name}'", code="model_not_found", param="model")
        self._want(name)
        self.pending = True

    def _want(self, name: str) -> _Entry:
        entry = self.entries.get(name)
        if entry is None:
            entry = self.entries[name] = _Entry(name)
        if entry.slot == 0 and entry.future is None:
            entry.future = self._loader.submit(self._read, name)
        return entry

    def _read(self, name: str) -> HostAdapter:
        """The loader thread: fetch and read a folder; a bad one is remembered (refused at add from then on)."""
        assert self.source is not None
        folder = self.source.fetch(name)
        try:
            return read_adapter(Path(folder), self.layout, self.max_rank, self.dtype, pin=self.device.type == "cuda")
        except AdapterError as e:
            with self._lock:
                self.failed[name] = str(e)
                while len(self.failed) > REMEMBERED_FAILURES:
                    self.failed.popitem(last=False)
            raise

    def loading(self) -> list[Future]:
        return [e.future for e in self.entries.values() if e.future is not None and not e.future.done()]

    # ---- slots (the step thread, between steps)

    def prepare(self, waiting: Iterable[Seq], running: Iterable[Seq]) -> list[tuple[Seq, str, int]]:
        """Bind waiting sequences to their adapters' slots, place adapters that finished loading (evicting
        idle ones, draining busy ones when none is idle), and return the sequences whose adapter failed, with why and
        the HTTP status it maps to."""
        if not self.pending:
            return []
        waiting = list(waiting)
        wanting: dict[str, list[Seq]] = {}
        failed: list[tuple[Seq, str, int]] = []
        for seq in waiting:
            name = seq.req.adapter
            if name is None or seq.adapter_slot:
                continue
            entry = self._want(name)
            if entry.slot and entry.slot not in self.draining:
                self._bind(seq, entry)
            elif entry.future is not None and entry.future.done() and entry.future.exception() is not None:
                failed.append((seq, *self._failure(entry)))
            else:
                wanting.setdefault(name, []).append(seq)
        for seq, _, _ in failed:
            self.entries.pop(seq.req.adapter, None)  # type: ignore[arg-type]
        if wanting:
            self._place(wanting, waiting, running)
        else:
            self.draining.clear()
        self._forget(wanting)
        self.pending = any(not s.adapter_slot for seqs in wanting.values() for s in seqs)
        return failed

    def _failure(self, entry: _Entry) -> tuple[str, int]:
        """Why a load failed, and its status: 400 a folder that cannot be served, 404 a name no longer known (an
        unload), 500 anything else (storage unreachable: a later request loads it again)."""
        exc = entry.future.exception()  # type: ignore[union-attr]
        if isinstance(exc, AdapterError):
            return f"LoRA adapter '{entry.name}' cannot be used: {exc}", 400
        if isinstance(exc, KeyError):
            return f"no LoRA adapter named '{entry.name}'", 404
        log.warning("LoRA adapter %r failed to load: %s: %s", entry.name, type(exc).__name__, exc)
        return f"LoRA adapter '{entry.name}' could not be loaded: {type(exc).__name__}: {exc}", 500

    def _bind(self, seq: Seq, entry: _Entry) -> None:
        seq.adapter_slot = entry.slot
        self.last_used[entry.slot] = self._tick

    def _place(self, wanting: dict[str, list[Seq]], waiting: list[Seq], running: Iterable[Seq]) -> None:
        pinned = {s.adapter_slot for s in waiting if s.adapter_slot}
        pinned.update(s.adapter_slot for s in running if s.adapter_slot)
        without = [self.entries[name] for name in wanting if self.entries[name].slot == 0]
        for entry in without:
            # a load that failed since `prepare` looked at it is failed by the next `prepare`, never placed
            if entry.future is None or not entry.future.done() or entry.future.exception() is not None:
                continue
            slot = self._free_slot(pinned)
            if slot is None:
                break
            self._load(entry, slot)
            pinned.add(slot)
            for seq in wanting[entry.name]:
                self._bind(seq, entry)
        self._drain(sum(1 for e in without if e.slot == 0), pinned)

    def _drain(self, need: int, pinned: set[int]) -> None:
        """Adapters still without a slot (`need`, loaded or loading) get one from the idle slots, then from busy
        ones drained for them (no new sequence binds to those until they are evicted), least recently used first;
        drains beyond what is needed end, so a drained slot takes requests again once nothing waits for it."""
        free = sum(1 for s in range(1, len(self.slots)) if s not in pinned and s not in self.draining)
        wanted = max(0, need - free)
        kept = sorted(self.draining, key=lambda s: (s in pinned, self.last_used[s]))[:wanted]  # idle ones first
        busy = sorted((s for s in pinned if s not in kept), key=self.last_used.__getitem__)
        self.draining = set(kept) | set(busy[:wanted - len(kept)])

    def _free_slot(self, pinned: set[int]) -> int | None:
        """An empty slot, else the least recently used one no sequence is bound to (an unloaded one first)."""
        for slot in range(1, len(self.slots)):
            if self.slots[slot] is None:
                return slot
        idle = [s for s in range(1, len(self.slots)) if s not in pinned]
        return min(idle, key=lambda s: (not self.slots[s].retired, self.last_used[s])) if idle else None  # type: ignore[union-attr]

    def _load(self, entry: _Entry, slot: int) -> None:
        """Copy a read adapter into `slot` (queued on the device's stream, behind any step in flight)."""
        host: HostAdapter = entry.future.result()  # type: ignore[union-attr]
        old = self.slots[slot]
        if old is not None:
            old.slot = 0
            if self.entries.get(old.name) is old:
                del self.entries[old.name]
            self.evictions += 1
            log.info("LoRA: evicted %r from slot %d", old.name, slot)
        for target in self.layout.shapes:
            if target in host.a:
                self.a[target][:, slot].copy_(host.a[target], non_blocking=True)
                self.b[target][:, slot].copy_(host.b[target], non_blocking=True)
            else:
                self.a[target][:, slot].zero_()
                self.b[target][:, slot].zero_()
        entry.future, entry.slot, entry.targets, entry.rank = None, slot, host.targets, host.rank
        self.slots[slot] = entry
        self.draining.discard(slot)
        self.loads += 1
        log.info("LoRA: loaded %r (rank %d, %s) into slot %d", entry.name, host.rank, ", ".join(sorted(host.targets)),
                 slot)

    def _forget(self, wanting: dict[str, list[Seq]]) -> None:
        """Drop what nobody waits for and no slot holds (its requests were aborted)."""
        for name in [n for n, e in self.entries.items() if e.slot == 0 and n not in wanting]:
            entry = self.entries.pop(name)
            if entry.future is not None:
                entry.future.cancel()

    def evict(self, name: str) -> bool:
        """Forget adapter `name` (an unload): its slot takes no new sequence and is the first to be reused once
        no sequence is bound to it; a request naming it again loads it anew. A bad-folder verdict is forgotten
        too. Its prefix-cache pages stay until evicted (a name is one set of weights: see the module docstring).
        True if it was known."""
        with self._lock:
            known = self.failed.pop(name, None) is not None
        entry = self.entries.pop(name, None)
        if entry is None:
            return known
        if entry.future is not None:
            entry.future.cancel()
        entry.retired = True
        return True

    # ---- per step

    def step_batch(self, slots: list[int], q_lens: list[int]) -> LoraBatch:
        """The LoRA layout of a step whose rows (in order) are on `slots` and compute `q_lens` tokens each;
        with every row on the base (the warm-up) it runs every target's ops, on the zero slot."""
        self._tick += 1
        runs: list[tuple[int, int, int]] = []  # (slot, first token, end), adjacent rows of one slot merged
        pos = 0
        for slot, q in zip(slots, q_lens, strict=True):
            if runs and runs[-1][0] == slot:
                runs[-1] = (slot, runs[-1][1], pos + q)
            else:
                runs.append((slot, pos, pos + q))
            pos += q
        present = {s for s, _, _ in runs if s}
        for s in present:
            self.last_used[s] = self._tick
        targets = frozenset().union(*(self.slots[s].targets for s in present))  # type: ignore[union-attr]
        if not present:
            targets = frozenset(self.layout.shapes)
        if self.segment_gemm is not None:
            indptr = [0] + [end for _, _, end in runs]
            seg, idx = to_device([indptr, [s for s, _, _ in runs]], torch.int64, self.device)
            return LoraBatch(targets, seg_indptr=seg, weight_indices=idx, segments=len(runs))
        return LoraBatch(targets, groups=self._groups(runs))

    def _groups(self, runs: list[tuple[int, int, int]]) -> list:
        """(slot, token rows, rank) per adapter of the step: a slice where its tokens are contiguous, else an
        index tensor (all of them in one transfer)."""
        spans: dict[int, list[tuple[int, int]]] = {}
        for slot, lo, hi in runs:
            if slot:
                spans.setdefault(slot, []).append((lo, hi))
        scattered = [s for s in spans if len(spans[s]) > 1]
        index = to_device([[t for lo, hi in spans[s] for t in range(lo, hi)] for s in scattered], torch.int64,
                          self.device)
        rows: dict[int, slice | torch.Tensor] = dict(zip(scattered, index, strict=True))
        groups = []
        for slot in spans:
            entry = self.slots[slot]
            rank = entry.rank if entry is not None else 0
            groups.append((slot, rows.get(slot, slice(*spans[slot][0])), rank))
        return groups

    @contextmanager
    def applied(self, batch: LoraBatch):
        """Run the forwards inside with `batch`'s deltas added to the target projections' outputs: their
        `forward` is an instance attribute for that long (the class's otherwise, so base steps pay nothing)."""
        patched = [(m, self._forwards[(t, i)], m.__dict__.get("forward"))
                   for t in batch.targets for i, m in enumerate(self.layout.modules[t])]
        self.batch = batch
        for module, fn, _ in patched:
            module.forward = fn
        try:
            yield
        finally:
            for module, _, before in patched:
                if before is None:
                    del module.forward
                else:
                    module.forward = before
            self.batch = None

    def _lora_forward(self, module: torch.nn.Linear, target: str, layer: int):
        linear = torch.nn.functional.linear

        def forward(x: torch.Tensor) -> torch.Tensor:
            out = linear(x, module.weight, module.bias)
            batch = self.batch
            assert batch is not None
            flat_x = x.reshape(-1, x.shape[-1])
            flat_out = out.view(-1, out.shape[-1])
            a, b = self.a[target][layer], self.b[target][layer]
            if batch.seg_indptr is not None:
                gemm, n = self.segment_gemm, batch.segments
                h = gemm.run(flat_x.contiguous(), a, n, True, seg_indptr=batch.seg_indptr,
                             weight_indices=batch.weight_indices)
                flat_out += gemm.run(h, b, n, True, seg_indptr=batch.seg_indptr, weight_indices=batch.weight_indices)
                return out
            for slot, rows, rank in batch.groups:
                if not rank:
                    continue
                if isinstance(rows, slice):
                    flat_out[rows] += (flat_x[rows] @ a[slot, :rank].T) @ b[slot, :, :rank].T
                else:
                    delta = (flat_x.index_select(0, rows) @ a[slot, :rank].T) @ b[slot, :, :rank].T
                    flat_out.index_add_(0, rows, delta)
            return out

        return forward

    # ---- reporting

    def resident(self) -> list[str]:
        """Names of the adapters in slots that new requests can use now."""
        return [e.name for e in self.slots if e is not None and not e.retired]

    def stats(self) -> dict:
        names = self.resident()
        return {"lora_slots": self.max_loras, "lora_resident": len(names),
                "lora_loads": self.loads, "lora_evictions": self.evictions, "lora_loading": len(self.loading()),
                "lora_adapters": names}

    def close(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)
