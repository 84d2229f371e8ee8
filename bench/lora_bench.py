"""LoRA step cost: the paged engine's decode step at batch 16 with 0, 1 and 4 distinct adapters, on CPU.

    .venv/bin/python bench/lora_bench.py                                  # demo and Qwen3-0.6B shapes, fp32
    .venv/bin/python bench/lora_bench.py --shapes tiny --steps 128 --runs 5

Four engines over one model (random weights of the shape), the same 16 greedy requests in each, run by run
interleaved (so load from other processes falls on all alike):
  no-lora     --max-loras 0: the engine without adapters
  base        --max-loras 4, every row on the base model: what having adapters on costs a base-only step
  1-adapter   every row on one adapter
  4-adapters  4 rows on each of 4 adapters
Adapters are random, rank 16 (--rank) on all seven projections, the dearest kind. A run adds the 16 requests,
steps until all are prefilled, then times --steps decode steps (wall and this process's CPU time per step);
figures are the median step of a run, then the median over --runs. One torch thread, as the scheduler runs on
2 shared cores. Writes bench/results/lora-step.json. Not a test: timings depend on the machine and its load.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

CONFIGS = ("no-lora", "base", "1-adapter", "4-adapters")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="tiny,qwen3-0.6b", help="comma-separated shared/demo_model.py shapes")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=0, help="decode steps timed per run (0: 96 tiny, 16 others)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "lora-step.json"))
    return ap.parse_args()


def random_model(shape: str) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from shared.demo_model import SHAPES

    vocab = 151936 if shape == "qwen3-0.6b" else 1088
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=vocab, tie_word_embeddings=False, initializer_range=0.1, eos_token_id=None,
                         bos_token_id=None, pad_token_id=None, **SHAPES[shape])
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    return model.eval()


def write_adapter(model: torch.nn.Module, folder: Path, rank: int, seed: int) -> None:
    """A random PEFT folder of rank `rank` on every projection (what peft's save_pretrained writes)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, module in model.named_modules():
        if name.split(".")[-1] in TARGETS and isinstance(module, torch.nn.Linear):
            prefix = f"base_model.model.{name}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=g) * 0.02
            weights[f"{prefix}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=g) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}))


def make_engines(model, args, source):
    from services.scheduler.engine.config import EngineConfig
    from services.scheduler.engine.paged import PagedEngine

    pages = args.batch * -(-(args.prompt_len + args.steps + 16) // 16) + 2
    engines = {}
    for name in CONFIGS:
        loras = 0 if name == "no-lora" else 4
        config = EngineConfig(num_pages=pages, page_size=16, max_running=args.batch, prefill_budget=2048,
                              prefix_cache=False, seed=0, max_loras=loras, max_lora_rank=args.rank)
        engines[name] = PagedEngine(model, set(), config, adapters=source if loras else None)
    return engines


def adapter_of(config: str, row: int) -> str | None:
    return {"no-lora": None, "base": None, "1-adapter": "a0", "4-adapters": f"a{row % 4}"}[config]


def one_run(engine, config: str, prompts: list[list[int]], steps: int) -> dict:
    from services.scheduler.engine.base import EngineRequest
    from shared.messages import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add(EngineRequest(f"{config}-{i}", p, params, adapter=adapter_of(config, i)))
    started: set[str] = set()
    for _ in range(10_000):  # adapters load (off the step thread), then every prompt prefills
        started.update(o.uid for o in engine.step())
        if len(started) == len(prompts):
            break
    wall, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        outs = engine.step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        assert len(outs) == len(prompts), "every row decodes every step"
    for i in range(len(prompts)):
        engine.abort(f"{config}-{i}")
    return {"wall_ms": 1e3 * statistics.median(wall), "cpu_ms": 1e3 * statistics.median(cpu)}


def bench_shape(shape: str, args) -> dict:
    model = random_model(shape)
    steps = args.steps or (96 if shape == "tiny" else 16)
    args = argparse.Namespace(**{**vars(args), "steps": steps})
    with tempfile.TemporaryDirectory() as tmp:
        folders = {f"a{k}": Path(tmp) / f"a{k}" for k in range(4)}
        for k, folder in enumerate(folders.values()):
            write_adapter(model, folder, args.rank, seed=k)
        from services.scheduler.engine.lora_weights import AdapterFolders

        engines = make_engines(model, args, AdapterFolders(folders))
        g = torch.Generator().manual_seed(1)
        vocab = model.config.vocab_size
        runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
        for run in range(args.runs + 1):  # the first run warms up (and loads the adapters)
            prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
            for config, engine in engines.items():
                r = one_run(engine, config, prompts, steps)
                if run:
                    runs[config].append(r)
                    print(f"  {shape} run {run} {config:>10}: {r['wall_ms']:8.2f} ms/step wall, "
                          f"{r['cpu_ms']:8.2f} ms CPU", flush=True)
        loads = {c: e.stats().get("lora_loads", 0) for c, e in engines.items()}
        for e in engines.values():
            e.close()
    result = {c: {"wall_ms": statistics.median(r["wall_ms"] for r in rs),
                  "cpu_ms": statistics.median(r["cpu_ms"] for r in rs),
                  "runs": rs} for c, rs in runs.items()}
    base = result["no-lora"]["cpu_ms"]
    for c in CONFIGS:
        result[c]["cpu_vs_no_lora"] = result[c]["cpu_ms"] / base
    return {"steps": steps, "configs": result, "lora_loads": loads,
            "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    report = {"when": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                          "loadavg": os.getloadavg()},
              "config": {"batch": args.batch, "prompt_len": args.prompt_len, "rank": args.rank, "runs": args.runs,
                         "threads": args.threads, "targets": list(TARGETS), "dtype": "float32"},
              "shapes": {}}
    for shape in args.shapes.split(","):
        print(f"{shape}: batch {args.batch}, rank {args.rank} on {len(TARGETS)} projections, "
              f"{args.threads} thread(s)", flush=True)
        report["shapes"][shape] = bench_shape(shape, args)
        for c, r in report["shapes"][shape]["configs"].items():
            print(f"{shape:>12} {c:>10}: {r['wall_ms']:8.2f} ms/step wall, {r['cpu_ms']:8.2f} ms CPU "
                  f"({r['cpu_vs_no_lora']:.2f}x no-lora)")
    report["machine"]["loadavg_after"] = os.getloadavg()
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
