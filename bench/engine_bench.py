"""Engine benchmark: the same workload through (a) rsinfer's paged engine in-process, (b) transformers'
`generate` with static padded batches and (c) transformers' continuous batching (`generate_batch`).

    .venv/bin/python bench/engine_bench.py --shape tiny                       # the demo model, fp32
    .venv/bin/python bench/engine_bench.py --shape qwen3-0.6b --dtype bfloat16 --requests 32 --output-len 64

Each system can also run alone (`--systems a`, then `b`, then `c`): results of the same workload
accumulate in the results file and the ratios are printed from it.

Every request is greedy with EOS ignored, so each produces exactly --output-len tokens; the figure is
output tokens per second of wall time (prefill included), median over --runs after one warm-up;
the systems' runs are interleaved so that load from other processes falls on all of them. It
prints one line per system and the ratios, and writes them to bench/results/<name>.json. Not a test:
timings depend on the machine and on whatever else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint folder (default: a random model of --shape, made once)")
    ap.add_argument("--shape", default="tiny", choices=["tiny", "qwen3-0.6b"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-running", type=int, default=0, help="engine's running batch (0 = every request)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk-size", type=int, default=512)
    ap.add_argument("--cuda-graphs", action="store_true")
    ap.add_argument("--systems", default="abc", help="subset of a (engine), b (generate), c (generate_batch)")
    ap.add_argument("--decode-latency", action="store_true", help="also time batch-1 decode steps (a)")
    ap.add_argument("--out", help="results file (default bench/results/<shape>-<dtype>-<device>.json)")
    return ap.parse_args()


def model_dir(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    from shared.demo_model import make_model

    cache = Path(os.environ.get("RSINFER_CACHE", Path.home() / ".cache" / "rsinfer")) / "bench-models"
    target = cache / f"{args.shape}-{args.dtype}"
    if not (target / "config.json").exists():
        print(f"making a random {args.shape} checkpoint in {target} ...", flush=True)
        make_model(target, shape=args.shape, seed=0, dtype=args.dtype)
    return target


def load(path: Path, args: argparse.Namespace):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(args.device).eval()


def workload(vocab: int, args: argparse.Namespace, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]


def sync(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def run_engine(model, prompts: list[list[int]], args: argparse.Namespace) -> int:
    from services.scheduler.engine.base import EngineRequest
    from shared.messages import SamplingParams

    engine = make_engine(model, args)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add(EngineRequest(f"r{i}", p, params))
    produced = 0
    while engine.has_work():
        produced += sum(len(o.ids) for o in engine.step())
    engine.close()
    return produced


def make_engine(model, args: argparse.Namespace):
    from services.scheduler.engine.config import EngineConfig
    from services.scheduler.engine.paged import PagedEngine

    per_seq = -(-(args.prompt_len + args.output_len) // args.page_size)
    config = EngineConfig(num_pages=args.requests * per_seq + 2, page_size=args.page_size,
                          max_running=args.max_running or args.requests, prefill_budget=args.chunk_size,
                          prefix_cache=True, cuda_graphs=args.cuda_graphs, seed=0)
    return PagedEngine(model, set(), config)


def run_generate(model, prompts: list[list[int]], args: argparse.Namespace) -> int:
    ids = torch.tensor(prompts, device=args.device)  # equal lengths: one static batch, no padding
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
                         min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
    return int(out[:, ids.shape[1]:].numel())


def run_generate_batch(model, prompts: list[list[int]], args: argparse.Namespace) -> int:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cfg = GenerationConfig(max_new_tokens=args.output_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # Sized like the engine's run (its defaults size the cache from free memory and spend seconds
    # clearing it; its async batching thread only costs time on CPU): ~4x faster than its defaults here.
    per_seq = -(-(args.prompt_len + args.output_len) // args.page_size)
    cb = ContinuousBatchingConfig(num_blocks=len(prompts) * per_seq + 8, page_size=args.page_size,
                                  max_batch_tokens=args.chunk_size,
                                  use_async_batching=None if args.device == "cuda" else False)
    outs = model.generate_batch(inputs=prompts, generation_config=cfg, continuous_batching_config=cb,
                                progress_bar=False)
    return sum(len(o.generated_tokens) for o in outs.values())


def timed(fn, model, prompts, args) -> tuple[float, int, float]:
    """(wall seconds, tokens, CPU seconds of this process)."""
    sync(args)
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = fn(model, prompts, args)
    sync(args)
    return time.perf_counter() - t0, tokens, time.process_time() - c0


def measure(chosen: dict, path: Path, args: argparse.Namespace, vocab: int) -> dict:
    """Time every chosen system, interleaved run by run (a, b, c, a, b, c, ...), so that load from
    other processes falls on all of them alike; each system has its own model copy (the engine
    re-routes its model's attention) and one small warm-up first."""
    models = {name: load(path, args) for name in chosen}
    small = argparse.Namespace(**{**vars(args), "requests": 4, "output_len": 8})
    for name, fn in chosen.items():
        fn(models[name], workload(vocab, small, seed=1), small)
    rates: dict[str, list[float]] = {name: [] for name in chosen}
    cpu_us: dict[str, list[float]] = {name: [] for name in chosen}
    tokens: dict[str, int] = {}
    for run in range(args.runs):
        prompts = workload(vocab, args, seed=100 + run)
        for name, fn in chosen.items():
            secs, tokens[name], cpu = timed(fn, models[name], prompts, args)
            rates[name].append(tokens[name] / secs)
            cpu_us[name].append(1e6 * cpu / tokens[name])
            print(f"  run {run + 1} {name}: {tokens[name]} tokens in {secs:.2f} s = "
                  f"{tokens[name] / secs:,.1f} tok/s, {cpu_us[name][-1]:.1f} CPU µs/token", flush=True)
    return {name: {"tok_per_s": statistics.median(r), "runs": r, "tokens": tokens[name],
                   "cpu_us_per_token": statistics.median(cpu_us[name]), "runs_requested": args.runs}
            for name, r in rates.items()}


def decode_latency(path: Path, args: argparse.Namespace, vocab: int, steps: int = 64) -> dict:
    """Median time of one batch-1 decode step of the engine."""
    from services.scheduler.engine.base import EngineRequest
    from shared.messages import SamplingParams

    engine = make_engine(load(path, args), args)
    engine.add(EngineRequest("lat", workload(vocab, args)[0],
                             SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)))
    engine.step()  # prefill
    times = []
    for _ in range(steps):
        sync(args)
        t0 = time.perf_counter()
        engine.step()
        sync(args)
        times.append(time.perf_counter() - t0)
    engine.close()
    return {"median_ms": 1000 * statistics.median(times), "min_ms": 1000 * min(times)}


def workload_config(args: argparse.Namespace) -> dict:
    skip = {"out", "systems", "runs", "decode_latency"}
    return {k: v for k, v in vars(args).items() if k not in skip}


def previous_results(out: Path, args: argparse.Namespace) -> dict:
    """Results of the other systems from an earlier invocation on the same workload (so that each
    system can be run as its own command), else nothing."""
    try:
        old = json.loads(out.read_text())
    except (OSError, ValueError):
        return {}
    return old.get("results", {}) if old.get("config") == workload_config(args) else {}


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = model_dir(args)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    systems = {"a": ("engine", run_engine), "b": ("generate", run_generate),
               "c": ("generate_batch", run_generate_batch)}
    print(f"{path.name}: {args.requests} requests x {args.prompt_len} prompt + {args.output_len} output tokens, "
          f"{args.dtype} on {args.device}, {torch.get_num_threads()} threads", flush=True)
    out = Path(args.out) if args.out else (Path(__file__).parent / "results" /
                                           f"{args.shape}-{args.dtype}-{args.device}.json")
    report = {"model": path.name, "config": workload_config(args),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                          "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None},
              "results": previous_results(out, args)}
    results = report["results"]
    results.update(measure(dict(systems[key] for key in args.systems), path, args, vocab))
    if args.decode_latency:
        report["decode_batch1"] = decode_latency(path, args, vocab)
        print(f"engine decode step at batch 1: {report['decode_batch1']['median_ms']:.3f} ms (median)")
    for name, r in results.items():
        print(f"{name:>15}: {r['tok_per_s']:>10,.1f} output tok/s")
    if "engine" in results:
        for other in ("generate", "generate_batch"):
            if other in results:
                ratio = results["engine"]["tok_per_s"] / results[other]["tok_per_s"]
                report[f"engine_vs_{other}"] = ratio
                print(f"engine / {other}: {ratio:.2f}x")
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
