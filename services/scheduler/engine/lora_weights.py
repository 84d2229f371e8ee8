"""LoRA adapters on the host: where their folders come from (`AdapterSource`), the projections of a model they
may target (`LoraLayout`), and a PEFT folder read, checked and laid out as one slot of the engine's stacks
(`read_adapter`, on lora.py's loader thread). lora.py's docstring tells how the slots are used.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from shared.lora_folder import (
    LORA_TARGETS,
    TENSOR_KEY,
    WEIGHTS_FILE,
    AdapterError,
    check_target_modules,
    config_json,
    rank_and_scaling,
)

log = logging.getLogger(__name__)

RANK_ALIGN = 8  # the segment GEMM's CUTLASS kernels want 16-byte aligned rows (8 bf16/fp16 elements)
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
REMEMBERED_FAILURES = 256  # bad folders remembered (refused at add without another load), least recent dropped


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


class AdapterLoader:
    """The loader thread: fetches and reads adapters' folders off the step thread, and remembers the folders that
    cannot be served (`refusal`) so that a request for one is refused at add without another load."""

    def __init__(self, source: AdapterSource | None, layout: LoraLayout, max_rank: int, dtype: torch.dtype,
                 pin: bool):
        self.source = source
        self.layout, self.max_rank, self.dtype, self.pin = layout, max_rank, dtype, pin
        self.failed: OrderedDict[str, str] = OrderedDict()  # name -> why its folder cannot be served
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora")
        self._lock = threading.Lock()  # `failed` is written by the loader thread too

    def knows(self, name: str) -> bool:
        return self.source is not None and self.source.knows(name)

    def refusal(self, name: str) -> str | None:
        """Why adapter `name`'s folder cannot be served, if a load found that."""
        with self._lock:
            return self.failed.get(name)

    def forget_refusal(self, name: str) -> bool:
        """Forget what a load found wrong with `name` (an unload); True if it had found something."""
        with self._lock:
            return self.failed.pop(name, None) is not None

    def submit(self, name: str) -> Future:
        """Start reading adapter `name` on the loader thread: a future of its HostAdapter."""
        return self._pool.submit(self._read, name)

    def _read(self, name: str) -> HostAdapter:
        """The loader thread: fetch and read a folder; a bad one is remembered (refused at add from then on)."""
        assert self.source is not None
        folder = self.source.fetch(name)
        try:
            return read_adapter(Path(folder), self.layout, self.max_rank, self.dtype, pin=self.pin)
        except AdapterError as e:
            with self._lock:
                self.failed[name] = str(e)
                while len(self.failed) > REMEMBERED_FAILURES:
                    self.failed.popitem(last=False)
            raise

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
