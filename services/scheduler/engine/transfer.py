"""Host <-> device traffic of a step: packed host blocks copied in one go, results copied back once.

A CUDA step must not wait for the device except once, for its results, and that wait should come as late
as possible (paged.py launches the next step before it). So every per-batch parameter is built on the host
into one pinned block per dtype and copied with `non_blocking=True`, and what a step produced (sampled ids,
logprobs) is copied into pinned memory with `non_blocking=True` behind an event that is waited on only when
the results are read. Pinned blocks come from torch's caching host allocator, which does not hand a block
out again before the copies that read it have run: staging memory is guarded by events without our help.

On CPU there is nothing to copy: blocks and results are used where they are. `record_event` is the one
place that creates events, so a benchmark can stand in a simulated device's clock (bench/host_bench.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_NP = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def record_event(device: torch.device):
    """An event recorded on the device's current stream, or None where work is synchronous (CPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def event_done(event) -> bool:
    return event is None or bool(event.query())


def wait_event(event) -> None:
    if event is not None:
        event.synchronize()


def host_tensor(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host tensor of `values` that `device` can copy from without blocking (pinned on CUDA)."""
    array = np.asarray(values, dtype=_NP[dtype])
    t = torch.from_numpy(array)
    return t.pin_memory() if device.type == "cuda" else t


def to_device(parts: Sequence, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Copy several host sequences to the device in one transfer; device views of each, in order."""
    sizes = [len(p) for p in parts]
    flat = np.concatenate([np.asarray(p, dtype=_NP[dtype]).reshape(-1) for p in parts]) if parts else \
        np.zeros(0, dtype=_NP[dtype])
    host = torch.from_numpy(flat)
    block = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
    return list(block.split(sizes)) if sizes else []


class DeviceResult:
    """Tensors on their way to the host: one non-blocking copy each into pinned memory and one event.
    `wait()` blocks until they are there (the step's one host sync) and returns them as lists."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.device = tensors[0].device if tensors else torch.device("cpu")
        if self.device.type == "cuda":
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(self.host, tensors, strict=True):
                h.copy_(t, non_blocking=True)
        else:
            self.host = list(tensors)
        self.event = record_event(self.device)
        self._lists: list[list] | None = None

    def ready(self) -> bool:
        return event_done(self.event)

    def wait(self) -> list[list]:
        if self._lists is None:
            wait_event(self.event)
            self._lists = [h.tolist() for h in self.host]
        return self._lists
