"""A tensor-parallel group: the scheduler process is rank 0 and starts, feeds and supervises ranks 1..N-1.

Rank 0 schedules, samples and owns the page allocator; before each forward it broadcasts the step's inputs (rows
with their page tables, token ids, the indices whose logits are kept, pages to clear) so every rank runs the
same forward on its shard (tp_shard.py), each rank's KV cache holding its share of the KV heads under the same
page ids. The inputs travel as int64 tensors, never as serialised Python objects: a fixed header, then one
body, then the ids (on the device, where an overlapped step patched in the previous step's sampled tokens).

One unit: rank 0 watches its workers and, when one exits, or a step's collectives fail or the step outlasts
--tp-timeout-s (a hung rank), kills the rest and exits nonzero; its held requests are taken over by a peer
scheduler as after any crash. A worker exits when rank 0 does (it watches its parent) or when a collective fails.
The wait for the next step is on a gloo group of its own with a long timeout: a scheduler may idle for hours.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from services.scheduler.engine.attention import RowSpec

log = logging.getLogger(__name__)

OP_STEP, OP_STOP = 1, 2
HEADER = 6  # op, rows, ids, kept indices, pages of all rows, pages to clear
IDLE_TIMEOUT = timedelta(days=7)  # the wait for the next step, and start-up (loading weights takes minutes)
WATCH_EVERY_S = 0.2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Groups:
    step: object  # the forward's collectives (NCCL on CUDA): --tp-timeout-s, past which a rank counts as hung
    control: object  # gloo on the CPU, long timeout: start-up, and the wait for the next step's header


def init_ranks(rank: int, world: int, port: int, device: torch.device, timeout_s: float) -> Groups:
    """Join the group (rank 0 listens on `port`; the others may take their time to start)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=IDLE_TIMEOUT)
    step = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return Groups(step, dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT))


@dataclass(frozen=True)
class Step:
    rows: list[RowSpec]
    ids: torch.Tensor
    keep: torch.Tensor
    zero: list[int]


class StepChannel:
    """Rank 0 sends each step's inputs; the other ranks receive them."""

    def __init__(self, device: torch.device, groups: Groups):
        self.device, self.control, self.step = device, groups.control, groups.step

    def send(self, rows: list[RowSpec], ids: torch.Tensor, keep: torch.Tensor, zero: list[int]) -> None:
        pages = [p for r in rows for p in r.pages]
        head = torch.tensor([OP_STEP, len(rows), ids.numel(), keep.numel(), len(pages), len(zero)], dtype=torch.int64)
        body = torch.tensor([r.start for r in rows] + [r.num_new for r in rows] + [len(r.pages) for r in rows]
                            + pages + zero, dtype=torch.int64)
        dist.broadcast(head, 0, group=self.control)
        dist.broadcast(body, 0, group=self.control)
        dist.broadcast(ids.contiguous(), 0, group=self.step)
        dist.broadcast(keep.contiguous(), 0, group=self.step)

    def stop(self) -> None:
        dist.broadcast(torch.tensor([OP_STOP, 0, 0, 0, 0, 0], dtype=torch.int64), 0, group=self.control)

    def receive(self) -> Step | None:
        """The next step's inputs, or None when rank 0 stops the group."""
        head = torch.empty(HEADER, dtype=torch.int64)
        dist.broadcast(head, 0, group=self.control)
        op, n_rows, n_ids, n_keep, n_pages, n_zero = head.tolist()
        if op == OP_STOP:
            return None
        body = torch.empty(3 * n_rows + n_pages + n_zero, dtype=torch.int64)
        dist.broadcast(body, 0, group=self.control)
        ids = torch.empty(n_ids, dtype=torch.int64, device=self.device)
        keep = torch.empty(n_keep, dtype=torch.int64, device=self.device)
        dist.broadcast(ids, 0, group=self.step)
        dist.broadcast(keep, 0, group=self.step)
        flat = body.tolist()
        starts, news, counts = flat[:n_rows], flat[n_rows:2 * n_rows], flat[2 * n_rows:3 * n_rows]
        at, rows = 3 * n_rows, []
        for start, new, count in zip(starts, news, counts, strict=True):
            rows.append(RowSpec(flat[at:at + count], start, new))
            at += count
        return Step(rows, ids, keep, flat[at:at + n_zero])


def exchange_info(control, device: torch.device, weight_bytes: int) -> list[dict]:
    """Every rank's pid, device, weight bytes and free device memory, on every rank."""
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else -1)
    mine = torch.tensor([os.getpid(), weight_bytes, free, index], dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine, group=control)
    return [{"rank": r, "pid": p[0], "device": device.type if p[3] < 0 else f"{device.type}:{p[3]}",
             "weight_bytes": p[1], "free_bytes": p[2]} for r, p in enumerate(t.tolist() for t in parts)]


def agree_pages(control, pages: int) -> int:
    """Rank 0's KV pool size (in pages) on every rank: the page ids rank 0 hands out must exist everywhere."""
    t = torch.tensor([pages], dtype=torch.int64)
    dist.broadcast(t, 0, group=control)
    return int(t.item())


class TensorParallelGroup:
    """Rank 0's side: the worker processes, the step channel and the watch that takes the group down."""

    def __init__(self, size: int, timeout_s: float, device: torch.device):
        self.size, self.timeout_s, self.device = size, timeout_s, device
        self.procs: list[subprocess.Popen] = []
        self.groups: Groups | None = None
        self.channel: StepChannel | None = None
        self.ranks: list[dict] = []
        self.kv_tokens = 0
        self.pending_zero: list[int] = []
        self._stopping = threading.Event()
        self._step_since: float | None = None  # when the step now running was published (the watch's hang check)

    @classmethod
    def start(cls, settings, model_path: str, device: torch.device) -> TensorParallelGroup:
        """Start ranks 1..N-1 (they load and shard the model themselves) and join them as rank 0."""
        group = cls(settings.tensor_parallel_size, settings.tp_timeout_s, device)
        port = free_port()
        payload = json.dumps({"settings": json.loads(settings.model_dump_json()), "model_path": model_path,
                              "world": group.size, "port": port})
        for rank in range(1, group.size):
            proc = subprocess.Popen([sys.executable, "-m", "services.scheduler.engine.tp_worker", str(rank)],
                                    stdin=subprocess.PIPE)
            proc.stdin.write(payload.encode())  # settings by pipe: `ps` shows argv, and they may hold secrets
            proc.stdin.close()
            group.procs.append(proc)
        threading.Thread(target=group._watch, name="tp-watch", daemon=True).start()
        group.groups = init_ranks(0, group.size, port, device, settings.tp_timeout_s)
        group.channel = StepChannel(device, group.groups)
        log.info("tensor parallel: %d ranks (%s), workers %s", group.size, dist.get_backend(),
                 [p.pid for p in group.procs])
        return group

    def joined(self, weight_bytes: int) -> list[dict]:
        """After sharding: learn every rank's weights and device (logged; in the heartbeat)."""
        self.ranks = exchange_info(self.groups.control, self.device, weight_bytes)
        for r in self.ranks:
            log.info("tensor parallel rank %d: pid %d on %s, %.1f MiB of weights", r["rank"], r["pid"], r["device"],
                     r["weight_bytes"] / 2**20)
        return self.ranks

    def agree_pages(self, pages: int, page_size: int) -> int:
        self.kv_tokens = (pages - 1) * page_size
        return agree_pages(self.groups.control, pages)

    def note_zero(self, pages: list[int]) -> None:
        """Pages rank 0 cleared: the other ranks clear theirs before the next step."""
        self.pending_zero.extend(pages)

    def publish(self, rows: list[RowSpec], ids: torch.Tensor, keep: torch.Tensor) -> None:
        assert self.channel is not None
        zero, self.pending_zero = self.pending_zero, []
        self._step_since = time.monotonic()
        self.channel.send(rows, ids, keep, zero)

    def done(self) -> None:
        """The step's forward returned on rank 0 (every rank took part in its collectives)."""
        self._step_since = None

    def fail(self, exc: BaseException) -> NoReturn:
        """A step's collective failed or timed out: the ranks disagree on what ran, so none may go on."""
        log.critical("tensor-parallel step failed (%s: %s); taking the group down", type(exc).__name__, exc)
        self._down(1)

    def stats(self) -> dict:
        return {"tensor_parallel_size": self.size,
                "tp_ranks": [{**{k: r[k] for k in ("rank", "pid", "device", "weight_bytes")},
                              "kv_tokens": self.kv_tokens} for r in self.ranks]}

    def stop(self) -> None:
        """Stop the workers (the scheduler is closing) and leave the group."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self.channel is not None:
            with contextlib.suppress(Exception):
                self.channel.stop()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    def _watch(self) -> None:
        """Down at once when a worker exits, or when a step outlasts --tp-timeout-s: a rank that hangs (stopped, a
        stuck kernel) may hold every other rank in a collective that no transport timeout ends (a gloo send waits
        for its receiver)."""
        while not self._stopping.wait(WATCH_EVERY_S):
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self._stopping.is_set():
                    log.critical("tensor-parallel rank %d (pid %d) exited with %s; taking the group down", rank,
                                 proc.pid, code)
                    self._down(1)
            since = self._step_since
            if since is not None and time.monotonic() - since > self.timeout_s:
                log.critical("a tensor-parallel step has not completed in %.0f s (--tp-timeout-s): a rank hangs; "
                             "taking the group down", self.timeout_s)
                self._down(1)

    def _down(self, code: int) -> NoReturn:
        self._stopping.set()
        for proc in self.procs:
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)
        logging.shutdown()
        os._exit(code)
