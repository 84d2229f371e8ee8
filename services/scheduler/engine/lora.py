"""LoRA adapters in the paged engine: many resident at once, any mix of them and the base model in one step.

Weights. Every projection an adapter may target (`LORA_TARGETS`, the attention and MLP projections PEFT
adapters use) gets two stacked tensors on the device, allocated once: A `[layers, slots, R, in]` and B
`[layers, slots, out, R]`, R the largest rank (`--max-lora-rank`, padded to a multiple of 8 for the segment
GEMM's 16-byte alignment). Slot 0 is all zeros, the base model's (as page 0 is the KV cache's scratch page);
slots 1..max_loras hold adapters. An adapter of a smaller rank is zero-padded, a projection it does not target is
zero, and its scaling (lora_alpha / r, or / sqrt(r) with rsLoRA) is folded into its B once at load, so a row's
output is `base(x) + (x A^T) B^T` with no per-step scaling op.

Loading. A request that names an adapter waits in the queue (as one waits for its grammar) while a loader thread
fetches the folder (lora_weights.py `AdapterSource.fetch`: a path, or the object store's local copy) and reads,
checks and pads it on the host; the step thread then copies it into a free slot, or into the least recently used
slot no sequence is bound to. A sequence binds to its adapter's slot when it leaves that wait and stays bound,
preempted or not, until it ends, so a slot is never overwritten under a sequence that reads it (on CUDA the copy is
queued behind any step still in flight that read the old weights). When more adapters are wanted than slots are
idle, the least recently used bound slots are drained: no new sequence binds to them, and once their sequences end
they are evicted, so every adapter in use is served in turn whatever --max-loras is.

Compute (lora_stacks.py). A step whose rows are all base runs the model as it is: no LoRA op is on its path (the
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

import logging
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.scheduler.engine.base import RequestRejected
from services.scheduler.engine.lora_stacks import LoraBatch, LoraStacks
from services.scheduler.engine.lora_weights import AdapterLoader, AdapterSource, HostAdapter, LoraLayout
from services.scheduler.engine.transfer import to_device
from shared.lora_folder import AdapterError

if TYPE_CHECKING:
    from services.scheduler.engine.sequence import Seq

log = logging.getLogger(__name__)

BASE_SLOT = 0  # the zero adapter: base rows of a segment GEMM read it
MAX_NAME_CHARS = 256
SEGMENT_WORKSPACE_BYTES = 128 << 20  # flashinfer's SegmentGEMMWrapper: "the recommended size is 128 MiB"


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
    """The slots and their adapters: which adapter is where, which sequences are bound to it, what is drained
    and evicted, and each step's layout on the slots; over the weights on the device (lora_stacks.py) and the
    loader thread (lora_weights.py)."""

    def __init__(self, model: torch.nn.Module, source: AdapterSource | None, max_loras: int, max_rank: int,
                 segment_gemm=None):
        param = next(model.parameters())
        self.layout = LoraLayout.of(model)
        self.max_loras, self.max_rank = max_loras, max_rank
        self.device = param.device
        self.stacks = LoraStacks(self.layout, max_loras, max_rank, param.dtype, param.device,
                                 segment_gemm=segment_gemm)
        self.segment_gemm = segment_gemm  # flashinfer's SegmentGEMMWrapper, or None: grouped torch matmuls
        slots = max_loras + 1
        self.slots: list[_Entry | None] = [None] * slots  # slot 0 stays None: the base model's zeros
        self.entries: dict[str, _Entry] = {}
        self.last_used = [0] * slots
        self.draining: set[int] = set()
        self.pending = False  # some waiting sequence is not bound to its adapter yet
        self.loads = self.evictions = 0
        self._tick = 0
        self.loader = AdapterLoader(source, self.layout, max_rank, param.dtype, pin=param.device.type == "cuda")
        log.info("LoRA: %d slots of rank %d for %s x %d layers (%.1f MiB on %s), %s", max_loras, max_rank,
                 ", ".join(self.layout.shapes), self.layout.num_layers, self.stacks.nbytes / 2**20, self.device,
                 "flashinfer segment GEMM" if segment_gemm is not None else "grouped torch matmuls")

    # ---- admission (the step thread)

    def check(self, name: str) -> None:
        """Refuse a request for an adapter that can never be served here; start loading the others."""
        if not name or len(name) > MAX_NAME_CHARS:
            raise RequestRejected(f"a LoRA adapter name has 1 to {MAX_NAME_CHARS} characters", code="model_not_found",
                                  param="model")
        why = self.loader.refusal(name)
        if why is not None:
            raise RequestRejected(f"LoRA adapter '{name}' cannot be used: {why}", code="invalid_lora_adapter",
                                  param="model")
        if not self.loader.knows(name):
            raise RequestRejected(f"no LoRA adapter named '{name}'", code="model_not_found", param="model")
        self._want(name)
        self.pending = True

    def _want(self, name: str) -> _Entry:
        entry = self.entries.get(name)
        if entry is None:
            entry = self.entries[name] = _Entry(name)
        if entry.slot == 0 and entry.future is None:
            entry.future = self.loader.submit(name)
        return entry

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
        self.stacks.write(slot, host)
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
        known = self.loader.forget_refusal(name)
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

    def applied(self, batch: LoraBatch):
        """A context in whose forwards the target projections add `batch`'s deltas (lora_stacks.py)."""
        return self.stacks.applied(batch)

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
        self.loader.close()
