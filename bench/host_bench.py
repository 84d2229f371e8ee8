"""Host time per decode step, and how busy it would keep a GPU: the engine's real Python (scheduling, metadata,
plan, input copies, graph replay, sampler, outputs) on CPU, with kernels whose cost is a fixed time on a
simulated device stream.

    .venv/bin/python bench/host_bench.py --label after                       # this checkout
    .venv/bin/python bench/host_bench.py --label before --code /tmp/before   # another checkout's engine

A thread stands in for the GPU: a CUDA-graph replay queues `--gpu-ms` of work on it (0.25 ms at batch 1 and
6 ms at batch 256 by default, about an H200's decode step of Qwen3-0.6B at ~1k tokens of context, linear
in between), and the engine's wait for a step's results waits for that stream (the older engine's
`ids.tolist()` is modelled as a wait for the stream to drain after the sampler, where it blocks on a GPU).
Everything else runs for real on CPU: the sampler's ops on a 32-token vocabulary (their dispatch costs
about what a kernel launch does; their arithmetic, which a GPU does, is kept negligible), flashinfer
replaced by a minimal fake whose plan() does the buffer copies 0.7.4's does and nothing else (the real
plan's own Python and C++ cost is not measured here; the figures report plans per step). The model's
forward never runs in a measured step: it is the replay.

Per batch size it reports host ms per step (median over steps of wall time minus time blocked on the stream,
and of the thread's CPU time likewise: the first counts time the OS gave to other processes), wall ms per
step, and the share of wall time during which the stream was busy, from the median of --repeat runs, and
writes bench/results/host-bench.json (one entry per label, so before and after accumulate). Not a test:
timings depend on the machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", default="after", help="key of this run in the results file")
    ap.add_argument("--code", default=str(ROOT), help="checkout whose engine to measure")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--gpu-ms", default="1:0.25,256:6.0", help="batch:ms points, linear in between")
    ap.add_argument("--steps", type=int, default=60, help="measured decode steps per batch size")
    ap.add_argument("--repeat", type=int, default=3, help="runs per batch size; the run of median host time is kept")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--mode", default="temperature", choices=["greedy", "temperature"],
                    help="sampling of every request (temperature 1.0 is the API's default)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "host-bench.json"))
    return ap.parse_args()


class Stream:
    """A simulated device stream, in wall-clock time: work queued at time t starts when the stream is free
    (or at t) and takes its fixed time; an event completes when the work queued before it has. No thread
    runs it (one would contend for the GIL with the host's torch ops): waiting on an event sleeps, then spins,
    until its completion time."""

    def __init__(self):
        self.free_at = 0.0
        self.intervals: list[tuple[float, float]] = []
        self.blocked_s = 0.0  # host time spent waiting on the stream
        self.blocked_cpu_s = 0.0  # CPU time the host thread spent in those waits (the spin)

    def launch(self, seconds: float) -> float:
        start = max(time.perf_counter(), self.free_at)
        self.free_at = start + seconds
        if seconds:
            self.intervals.append((start, self.free_at))
        return self.free_at

    def wait(self, until: float) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        if until - t0 > 4e-4:  # sleep most of it, then spin (as a synchronizing host thread does)
            time.sleep(until - t0 - 3e-4)
        while time.perf_counter() < until:
            pass
        self.blocked_s += time.perf_counter() - t0
        self.blocked_cpu_s += time.thread_time() - c0

    def drain(self) -> None:
        self.wait(self.free_at)

    def busy_between(self, t0: float, t1: float) -> float:
        return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in self.intervals)


class Event:
    def __init__(self, stream: Stream):
        self.stream, self.at = stream, stream.launch(0.0)

    def query(self) -> bool:
        return time.perf_counter() >= self.at

    def synchronize(self) -> None:
        self.stream.wait(self.at)


def gpu_ms(points: str, batch: int) -> float:
    pts = sorted((int(b), float(ms)) for b, ms in (p.split(":") for p in points.split(",")))
    if batch <= pts[0][0]:
        return pts[0][1]
    for (b0, m0), (b1, m1) in itertools.pairwise(pts):
        if batch <= b1:
            return m0 + (m1 - m0) * (batch - b0) / (b1 - b0)
    return pts[-1][1]


def fake_flashinfer(torch) -> types.ModuleType:
    """flashinfer's wrappers with no kernels: plan() copies into a graph wrapper's buffers as 0.7.4 does."""

    class Decode:
        def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False, **kw):
            self.graph = False

        def plan(self, indptr, indices, last_page_len, *args, **kwargs):
            STATS["plans"] += 1

        def run(self, q, paged_kv_cache, *args, **kwargs):
            return torch.zeros_like(q)

    class GraphDecode(Decode):
        def __init__(  # noqa: PLR0917 - flashinfer 0.7's signature, kv_layout passed by position (cuda_graph.py)
                self, workspace, indptr_buffer, indices_buffer, last_page_len_buffer, kv_layout="NHD",
                use_tensor_cores=False):
            self.bufs = (indptr_buffer, indices_buffer, last_page_len_buffer)

        def plan(self, indptr, indices, last_page_len, *args, **kwargs):
            STATS["plans"] += 1
            self.bufs[0].copy_(indptr, non_blocking=True)
            self.bufs[2].copy_(last_page_len, non_blocking=True)
            self.bufs[1][:len(indices)].copy_(indices, non_blocking=True)

    class Prefill(Decode):
        pass

    return types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=Decode,
                                 CUDAGraphBatchDecodeWithPagedKVCacheWrapper=GraphDecode,
                                 BatchPrefillWithPagedKVCacheWrapper=Prefill, __version__="bench-fake")


STATS = {"plans": 0}


def install(stream: Stream, step_s: list[float]):
    """The fake device under whichever engine version is importable: graph replays queue `step_s[0]`."""
    import torch

    sys.modules["flashinfer"] = fake_flashinfer(torch)
    from services.scheduler.engine import cuda_graph

    if hasattr(cuda_graph, "GraphApi"):  # this checkout: graphs and events have seams
        return install_through_seams(stream, step_s, cuda_graph)
    return install_in_older_engine(stream, step_s, cuda_graph, torch)


def install_through_seams(stream: Stream, step_s: list[float], cuda_graph) -> str:
    """This checkout's engine: its graph API and its event recording replaced."""
    from services.scheduler.engine import transfer
    from services.scheduler.engine.attention import flashinfer_backend

    class Api(cuda_graph.GraphApi):
        def check(self, device):
            pass

        def capture(self, fn, pool):
            return "graph", pool

        def replay(self, graph):
            stream.launch(step_s[0])

        def synchronize(self):
            pass

    cuda_graph.DecodeGraphs.api = Api()
    record = lambda device: Event(stream)  # noqa: E731
    transfer.record_event = record
    flashinfer_backend.record_event = record
    return "overlap"


def install_in_older_engine(stream: Stream, step_s: list[float], cuda_graph, torch) -> str:
    """The older engine: CUDA graphs without the device check (its __init__ otherwise unchanged), replays
    that queue work, and the sync of its `ids.tolist()` modelled as a drain after the sampler."""
    class Graph:
        def replay(self):
            stream.launch(step_s[0])

        def pool(self):
            return None

    class Capture:
        def __init__(self, graph, pool=None):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    torch.cuda.CUDAGraph = Graph
    torch.cuda.graph = Capture
    torch.cuda.synchronize = lambda *a: None
    def init(self, runner, kv, max_bs, max_pages_per_seq):  # the older __init__ less its device check
        dev = kv.k[0].device
        self.runner, self.backend, self.kv = runner, runner.backend, kv
        self.sizes = [b for b in cuda_graph.BATCH_SIZES if b <= max_bs] or [1]
        top = self.sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=dev)
        self.positions = torch.zeros(top, dtype=torch.long, device=dev)
        self.slots = torch.zeros(top, dtype=torch.long, device=dev)
        self.keep = torch.arange(top, dtype=torch.long, device=dev)
        self.indptr = torch.zeros(top + 1, dtype=torch.int32, device=dev)
        self.indices = torch.zeros(top * max_pages_per_seq, dtype=torch.int32, device=dev)
        self.last_len = torch.ones(top, dtype=torch.int32, device=dev)
        self.graphs = {}

    cuda_graph.DecodeGraphs.__init__ = init
    return "sync"


def make_engine(batch: int, args: argparse.Namespace):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # paged.py still names EngineConfig (it imports it from config.py), so --code may be a checkout from before
    # config.py was split out of it
    from services.scheduler.engine.paged import EngineConfig, PagedEngine

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                      tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = Qwen3ForCausalLM(cfg).eval()
    per_seq = -(-(args.prompt_len + 4 * args.steps) // 16) + 1
    kw = dict(num_pages=batch * per_seq + 2, page_size=16, max_running=batch, prefill_budget=8192,
              backend="flashinfer", cuda_graphs=True, seed=0, prefix_cache=True)
    if "overlap" in EngineConfig.__dataclass_fields__:
        kw["overlap"] = True
    return PagedEngine(model, set(), EngineConfig(**kw))


def measure(batch: int, args: argparse.Namespace, stream: Stream, step_s: list[float], kind: str) -> dict:
    from services.scheduler.engine.base import EngineRequest
    from shared.messages import SamplingParams

    eng = make_engine(batch, args)
    if eng.runner.graphs is None:
        raise RuntimeError("graphs were not captured")
    if kind == "sync":  # the older engine blocks in its sampler's .tolist()
        sampler = eng.sampler

        def blocking(logits, rows):
            out = sampler(logits, rows)
            stream.drain()
            return out

        eng.sampler = blocking
    temp = 0.0 if args.mode == "greedy" else 1.0
    params = SamplingParams(max_tokens=4 * args.steps, temperature=temp, ignore_eos=True)
    for i in range(batch):
        eng.add(EngineRequest(f"r{i}", [(i * 7 + k) % 29 + 3 for k in range(args.prompt_len)], params))
    step_s[0] = 0.0
    while any(not s.is_decode for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(5):
        eng.step()
    stream.drain()
    step_s[0] = gpu_ms(args.gpu_ms, batch) / 1e3
    plans0, blocked0 = STATS["plans"], stream.blocked_s
    walls, hosts, cpus, tokens = [], [], [], 0
    t_start = time.perf_counter()
    for _ in range(args.steps):
        b0, bc0 = stream.blocked_s, stream.blocked_cpu_s
        t0, c0 = time.perf_counter(), time.thread_time()
        tokens += sum(len(o.ids) for o in eng.step())
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        walls.append(wall)
        hosts.append(wall - (stream.blocked_s - b0))
        cpus.append(cpu - (stream.blocked_cpu_s - bc0))
    t_end = time.perf_counter()
    elapsed = t_end - t_start
    busy = stream.busy_between(t_start, t_end)
    result = {
        "batch": batch, "gpu_ms": step_s[0] * 1e3,
        "host_ms_per_step": 1e3 * statistics.median(hosts),
        "host_ms_mean": 1e3 * statistics.fmean(hosts),
        "host_cpu_ms_per_step": 1e3 * statistics.median(cpus),
        "wall_ms_per_step": 1e3 * elapsed / args.steps,
        "gpu_busy_share": busy / elapsed,
        "plans_per_step": (STATS["plans"] - plans0) / args.steps,
        "tokens_per_step": tokens / args.steps,
        "blocked_ms_per_step": 1e3 * (stream.blocked_s - blocked0) / args.steps,
    }
    eng.close()
    stream.drain()
    return result


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(Path(args.code).resolve()))
    import torch

    torch.set_num_threads(1)
    stream, step_s = Stream(), [0.0]
    kind = install(stream, step_s)
    import services.scheduler.engine.paged as paged

    print(f"{args.label}: engine from {Path(paged.__file__).resolve().parents[3]} ({kind} steps), "
          f"{args.mode} sampling", flush=True)
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        runs = sorted((measure(batch, args, stream, step_s, kind) for _ in range(args.repeat)),
                      key=lambda r: r["host_ms_per_step"])
        r = runs[len(runs) // 2]
        r["runs_host_ms"] = [x["host_ms_per_step"] for x in runs]
        r["runs_busy_share"] = [x["gpu_busy_share"] for x in runs]
        results.append(r)
        print(f"  batch {batch:>3}: host {r['host_ms_per_step']:.3f} ms/step (CPU {r['host_cpu_ms_per_step']:.3f}, "
              f"mean {r['host_ms_mean']:.3f}), "
              f"wall {r['wall_ms_per_step']:.3f} ms/step, simulated GPU step {r['gpu_ms']:.2f} ms busy "
              f"{100 * r['gpu_busy_share']:.0f}%, {r['plans_per_step']:.2f} plans/step", flush=True)
    out = Path(args.out)
    try:
        report = json.loads(out.read_text())
    except (OSError, ValueError):
        report = {}
    report[f"{args.label}/{args.mode}"] = {
        "kind": kind, "code": str(Path(args.code).resolve()), "results": results,
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "code", "label")},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
