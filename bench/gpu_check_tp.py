"""bench/gpu_check.py's tensor-parallel section (7): TP=1 against TP=2 on the Qwen3-0.6B-shaped model, where the
machine has two GPUs or more; on one GPU, or on CPU, it says so and skips (GPU_CHECK_TP_ON_CPU=1 runs it on the
CPU over gloo, tiny shapes: how this file's code is checked without two GPUs).

- agreement: greedy text of 8 prompts through the scheduler's own factory with --tensor-parallel-size 1 and 2
  (bf16 on GPUs: sums in another order, so reported, not asserted: identical sequences and the mean common prefix);
- decode ms per step at batch 1 and 32 for each, and rank 0's host time inside collectives per step;
- all-reduce time per step: NCCL all-reduces of a decode step's activations ([batch, hidden]) timed in two
  processes of their own, times the step's count (two per layer and one for the embedding), and the logits'
  all-gather.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

STEPS = 24
BATCHES = (1, 32)


def tp_section(check) -> dict:
    import torch

    on_cpu = os.environ.get("GPU_CHECK_TP_ON_CPU") == "1"
    gpus = 0 if check.args.cpu_smoke else torch.cuda.device_count()
    if gpus < 2 and not on_cpu:
        why = f"tensor parallelism needs 2 or more GPUs; this machine has {gpus}" + (" (CPU smoke)" if
                                                                                    check.args.cpu_smoke else "")
        print(f"[tensor_parallel] skipped: {why}", flush=True)
        return {"skipped_why": why, "gpus": gpus}
    device = "cpu" if on_cpu else "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        folder = _checkpoint(check, Path(tmp) / "model")
        engines = {n: _engine(folder, n, device) for n in (1, 2)}
        try:
            out = {"gpus": gpus, "device": device, "agreement": _agreement(engines, check),
                   "decode": {f"tp{n}": _decode(e, n) for n, e in engines.items()}}
        finally:
            for e in engines.values():
                e.close()
    out["collectives"] = _collective_times(check.model.config, device)
    return out


def _checkpoint(check, folder: Path) -> Path:
    """The check's model with the demo's tokenizer (the GPU machine has no network and no Qwen vocabulary)."""
    from shared.demo_model import make_model

    make_model(folder, "tiny", train=False)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    check.model.save_pretrained(folder, safe_serialization=True)
    return folder


def _engine(folder: Path, size: int, device: str):
    from services.scheduler.engine.factory import build_engine
    from shared.settings import SchedulerSettings

    dtype = "float32" if device == "cpu" else "bfloat16"
    settings = SchedulerSettings(device=device, dtype=dtype, threads=1, max_kv_tokens=32768, max_running=64,
                                 tensor_parallel_size=size, cuda_graphs=False)
    return build_engine(settings, str(folder))


def _run(engine, tag: str, prompts: list[list[int]], new: int, timed: int = 0) -> tuple[dict, list[float]]:
    from services.scheduler.engine.base import EngineRequest
    from shared.messages import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add(EngineRequest(f"{tag}-{i}", p, params))
    out: dict[int, list[int]] = {}
    times = []
    while engine.has_work():
        t = time.perf_counter()
        outs = engine.step()
        if all(len(v) for v in out.values()) and len(out) == len(prompts):
            times.append(time.perf_counter() - t)
        for o in outs:
            out.setdefault(int(o.uid.rsplit("-", 1)[1]), []).extend(o.ids)
    return out, times[-timed:] if timed else times


def _agreement(engines: dict, check) -> dict:
    import torch

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (40, 64, 17, 100, 33, 8, 64, 90)]
    texts = {n: _run(e, f"agree{n}", prompts, 32)[0] for n, e in engines.items()}

    def common(a: list[int], b: list[int]) -> int:
        return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

    prefix = [common(texts[1][i], texts[2][i]) for i in range(len(prompts))]
    return {"identical": f"{sum(texts[1][i] == texts[2][i] for i in range(len(prompts)))}/{len(prompts)}",
            "mean_common_prefix_tokens": round(statistics.mean(prefix), 1), "of_tokens": 32}


def _decode(engine, size: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(5)
    out = {}
    for batch in BATCHES:
        prompts = [torch.randint(3, 500, (32,), generator=g).tolist() for _ in range(batch)]
        _, times = _run(engine, f"decode{size}-{batch}", prompts, STEPS + 4, timed=STEPS)
        out[f"ms_per_step@{batch}"] = round(1e3 * statistics.median(times), 3)
    ranks = getattr(getattr(engine, "group", None), "ranks", None)
    if ranks:
        out["weight_gib_per_rank"] = [round(r["weight_bytes"] / 2**30, 3) for r in ranks]
    return out


def _collective_times(config, device: str) -> dict:
    """Per-call all-reduce and all-gather times of a decode step's tensors, in 2 fresh processes."""
    import json

    import torch.multiprocessing as mp

    from services.scheduler.engine.tp_group import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        spec = {"port": free_port(), "device": device, "hidden": config.hidden_size, "vocab": config.vocab_size,
                "layers": config.num_hidden_layers, "out": str(out)}
        mp.spawn(_collective_rank, args=(spec,), nprocs=2, join=True)
        return json.loads(out.read_text())


def _collective_rank(rank: int, spec: dict) -> None:
    import json

    import torch
    import torch.distributed as dist

    device, hidden, vocab, layers = spec["device"], spec["hidden"], spec["vocab"], spec["layers"]
    port, out = spec["port"], spec["out"]

    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=2)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    result = {}
    for batch in BATCHES:
        x = torch.ones(batch, hidden, dtype=dtype, device=dev)
        part = torch.ones(batch, vocab // 2, dtype=dtype, device=dev)
        parts = [torch.empty_like(part) for _ in range(2)]
        per_reduce = _timed(lambda x=x: dist.all_reduce(x), dev)
        per_gather = _timed(lambda part=part, parts=parts: dist.all_gather(parts, part), dev)
        result[f"batch{batch}"] = {"all_reduce_us": round(1e6 * per_reduce, 1),
                                   "logits_all_gather_us": round(1e6 * per_gather, 1),
                                   "all_reduces_per_step": 2 * layers + 1,
                                   "collective_ms_per_step": round(1e3 * ((2 * layers + 1) * per_reduce + per_gather),
                                                                   3)}
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _timed(fn, dev, n: int = 50) -> float:
    import torch

    for _ in range(5):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return (time.perf_counter() - t) / n
