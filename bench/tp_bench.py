"""Tensor parallelism on CPU (gloo): the paged engine's decode step with 1 rank and with 2, and what the
collectives cost per step.

    .venv/bin/python bench/tp_bench.py                     # demo shape and a 4-layer Qwen3-0.6B shape, fp32
    .venv/bin/python bench/tp_bench.py --shapes tiny --steps 64 --runs 5

Each engine is built by the scheduler's own factory (`build_engine`, so --tensor-parallel-size 2 starts a real
worker process), the same greedy requests in each, runs interleaved (load from other processes falls on both
alike). Collective time is rank 0's time inside torch.distributed calls during a step (it includes waiting for
the other rank to arrive: on a loaded machine, mostly that). CPU figures are not what a GPU node sees: NCCL
over NVLink all-reduces a decode step's activations in microseconds. Writes bench/results/tp-step.json. Not a
test: timings depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "all_gather", "broadcast")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="tiny,qwen3-0.6b-4l", help="tiny (the demo's) and/or qwen3-0.6b-4l")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=0, help="decode steps timed per run (0: 64 tiny, 16 others)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "tp-step.json"))
    return ap.parse_args()


def write_model(shape: str, folder: Path) -> Path:
    """The demo checkpoint (untrained), or the Qwen3-0.6B shape cut to 4 layers with the demo's tokenizer."""
    from shared.demo_model import SHAPES, make_model

    make_model(folder, "tiny", train=False)
    if shape == "qwen3-0.6b-4l":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(0)
        config = Qwen3Config(**{**SHAPES["qwen3-0.6b"], "num_hidden_layers": 4}, vocab_size=151936,
                             tie_word_embeddings=False, initializer_range=0.1, eos_token_id=None,
                             bos_token_id=None, pad_token_id=None)
        model = Qwen3ForCausalLM(config)
        with torch.no_grad():
            model.model.embed_tokens.weight.normal_(0.0, 1.0)
        model.save_pretrained(folder, safe_serialization=True)
    return folder


class CollectiveClock:
    """Time spent in torch.distributed's collectives (tp_shard.py and tp_group.py call them through `dist.`)."""

    def __init__(self):
        self.seconds, self.calls = 0.0, 0
        for name in COLLECTIVES:
            setattr(dist, name, self._timed(getattr(dist, name)))

    def _timed(self, fn):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        return timed

    def take(self) -> tuple[float, int]:
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out


def build(folder: Path, size: int):
    from services.scheduler.engine.factory import build_engine
    from shared.settings import SchedulerSettings

    settings = SchedulerSettings(device="cpu", dtype="float32", threads=1, max_kv_tokens=8192, max_running=64,
                                 tensor_parallel_size=size)
    return build_engine(settings, str(folder))


def one_run(engine, tag: str, prompts: list[list[int]], steps: int, clock: CollectiveClock) -> dict:
    from services.scheduler.engine.base import EngineRequest
    from shared.messages import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add(EngineRequest(f"{tag}-{i}", p, params))
    started: set[str] = set()
    while len(started) < len(prompts):
        started.update(o.uid for o in engine.step())
    wall, cpu, comm, calls, tokens = [], [], [], [], []
    clock.take()
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        outs = engine.step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        seconds, n = clock.take()
        comm.append(seconds)
        calls.append(n)
        tokens.append([t for o in sorted(outs, key=lambda o: int(o.uid.rsplit("-", 1)[1])) for t in o.ids])
    for i in range(len(prompts)):
        engine.abort(f"{tag}-{i}")
    return {"wall_ms": 1e3 * statistics.median(wall), "cpu_ms": 1e3 * statistics.median(cpu),
            "collective_ms": 1e3 * statistics.median(comm), "collectives": statistics.median(calls), "tokens": tokens}


def bench_shape(shape: str, args, clock: CollectiveClock) -> dict:
    steps = args.steps or (64 if shape == "tiny" else 16)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(shape, Path(tmp) / shape)
        engines = {1: build(folder, 1), 2: build(folder, 2)}
        g = torch.Generator().manual_seed(1)
        runs: dict[int, list[dict]] = {1: [], 2: []}
        agree = True
        for run in range(args.runs + 1):  # the first run warms up
            prompts = [torch.randint(3, 1000, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
            results = {n: one_run(e, f"{shape}-{n}-{run}", prompts, steps, clock) for n, e in engines.items()}
            agree = agree and results[1]["tokens"] == results[2]["tokens"]
            if run:
                for n, r in results.items():
                    runs[n].append(r)
        for engine in engines.values():
            engine.close()
    out: dict = {"steps": steps, "greedy_agree": agree}
    for n, rs in runs.items():
        out[f"tp{n}"] = {k: statistics.median(r[k] for r in rs) for k in ("wall_ms", "cpu_ms", "collective_ms",
                                                                           "collectives")}
        out[f"tp{n}"]["best_wall_ms"] = min(r["wall_ms"] for r in rs)
    return out


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    clock = CollectiveClock()
    before = os.getloadavg()
    shapes = {s: bench_shape(s, args, clock) for s in args.shapes.split(",")}
    result = {"when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
              "config": {"batch": args.batch, "prompt_len": args.prompt_len, "runs": args.runs, "dtype": "float32",
                         "threads": 1, "backend": "gloo"},
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                          "loadavg": [round(x, 2) for x in before],
                          "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
              "shapes": shapes}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
