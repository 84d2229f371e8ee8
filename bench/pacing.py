"""Merging paced by load (--stream-entry-rate, issue 34) against the fixed 10 ms wait it replaced as the default,
at a GPU's step rate: time to first token, the gaps between chunks and tokens per chunk at 1, 64 and 512 streams.

    python bench/pacing.py [--step-ms 5] [--rounds 2] [--tokens 64]

The synthetic engine (no model) steps every --step-ms; each round starts one stack per configuration, in turn
(the order flips every round, so load from other processes falls on both alike), and sends, per stream count C,
max(16, 2C) streamed completions of --tokens tokens, C at a time, after a warm-up. Medians over the rounds;
results in bench/results/pacing.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import BenchStack, completion_body, loadavg, run_load  # noqa: E402
from bench.run_all import id_prompts  # noqa: E402
from shared.demo_model import ensure_demo_model  # noqa: E402
from shared.settings import DEMO_MODEL_NAME  # noqa: E402

RESULTS = ROOT / "bench/results/pacing.json"
STREAMS = (1, 64, 512)
CONFIGS = {"fixed 10 ms": {"RSINFER_STREAM_FLUSH_MS": "10", "RSINFER_STREAM_ENTRY_RATE": "0"},
           "paced (defaults)": {}}
FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tokens_per_chunk", "tok_per_s")


def one_stack(model: str, step_ms: float, extra: dict[str, str], tokens: int) -> dict[int, dict]:
    """Per stream count, the load's summary on a fresh stack of this configuration."""
    env = {"scheduler": {"RSINFER_ENGINE": "synthetic", "RSINFER_STEP_MS": str(step_ms),
                         "RSINFER_MAX_RUNNING": str(max(STREAMS)), "RSINFER_BATCH_SIZE": str(max(STREAMS)), **extra}}
    out = {}
    with BenchStack(model, DEMO_MODEL_NAME, env=env) as stack:
        run_load(stack.urls, [completion_body(DEMO_MODEL_NAME, p, 8) for p in id_prompts(16, 2, 16)], 16)
        for c in STREAMS:
            bodies = [completion_body(DEMO_MODEL_NAME, p, tokens) for p in id_prompts(max(16, 2 * c), 11, 16)]
            s = run_load(stack.urls, bodies, c, stagger_s=0.002, processes=1 if c < 256 else 2).summary()
            chunks = s["chunks_per_request"]
            out[c] = {**{f: s[f] for f in FIGURES if f in s}, "tokens_per_chunk": tokens / chunks if chunks else 0.0,
                      "ok": s["ok"], "requests": s["requests"]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-ms", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--output", default=str(RESULTS))
    args = ap.parse_args()
    model = str(ensure_demo_model())
    runs: dict[str, list[dict[int, dict]]] = {k: [] for k in CONFIGS}
    load_before = loadavg()
    for r in range(args.rounds):
        for name in sorted(CONFIGS, reverse=bool(r % 2)):
            runs[name].append(one_stack(model, args.step_ms, CONFIGS[name], args.tokens))
            for c, p in runs[name][-1].items():
                print(f"round {r} {name:16} {c:>3} streams: TTFT p50/p99 {p['ttft_p50_ms']:.1f}/{p['ttft_p99_ms']:.1f}"
                      f" ms, ITL p50/p99 {p['itl_p50_ms']:.1f}/{p['itl_p99_ms']:.1f} ms, {p['tokens_per_chunk']:.1f}"
                      f" tokens/chunk, {p['ok']}/{p['requests']} ok", flush=True)
    medians = {name: {c: {f: round(statistics.median(run[c][f] for run in rs), 2) for f in FIGURES}
                      for c in STREAMS} for name, rs in runs.items()}
    print(f"medians of {args.rounds} rounds, {args.step_ms:g} ms steps, {args.tokens} tokens per request:")
    print(f"  {'streams':>7} " + "".join(f"| {name:^44} " for name in CONFIGS))
    for c in STREAMS:
        print(f"  {c:>7} " + "".join(
            f"| TTFT p50 {m[c]['ttft_p50_ms']:6.1f} ms, ITL p50 {m[c]['itl_p50_ms']:5.1f} ms, "
            f"{m[c]['tokens_per_chunk']:4.1f} tok " for m in medians.values()))
    out = {"step_ms": args.step_ms, "rounds": args.rounds, "tokens": args.tokens, "configs": CONFIGS,
           "load_before": load_before, "load_after": loadavg(), "medians": medians, "runs": runs}
    Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
