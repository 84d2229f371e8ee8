"""End-to-end benchmark: start `rsinfer up` (embedded redis-server, every stage its own process), drive it
with `rsinfer bench` (streaming /v1/completions over plain sockets), print the figures and write them
to bench/results/pipeline-<model>.json.

    python bench/pipeline_bench.py [--model DIR] [--requests 256] [--concurrency 64] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rsinfer.launcher import Launcher
from rsinfer.redis_server import free_port

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="checkpoint folder (default: the demo model)")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    port = free_port()
    up = Launcher({"RSINFER_LOG_LEVEL": "WARNING", "RSINFER_PORT": str(port),
                   **({"RSINFER_MODEL": args.model} if args.model else {})},
                  log_dir=Path(tempfile.mkdtemp(prefix="rsinfer-pipeline-")))
    url = f"http://127.0.0.1:{port}"
    runs = []
    try:
        up.start("up", "up")
        up.wait_serving(url, None)  # the API up and every stage of the model live
        name = Path(args.model).name if args.model else "rsinfer-demo"
        for i in range(args.runs):
            out = ROOT / "bench" / "results" / f".pipeline-run{i}.json"
            subprocess.run([sys.executable, "-m", "rsinfer.cli", "bench", "--url", url, "--requests",
                            str(args.requests), "--concurrency", str(args.concurrency), "--max-tokens",
                            str(args.max_tokens), "--prompt-words", str(args.prompt_words), "--output", str(out)],
                           check=True)
            runs.append(json.loads(out.read_text())["summary"])
            out.unlink()
    finally:
        up.stop(60)
    tps = sorted(r["output_tok_per_s"] for r in runs)
    result = {"model": name, "cpus": os.cpu_count(), "median_output_tok_per_s": tps[len(tps) // 2], "runs": runs}
    dest = ROOT / "bench" / "results" / f"pipeline-{name}.json"
    dest.write_text(json.dumps(result, indent=1))
    print(f"median output tok/s over {len(runs)} runs: {result['median_output_tok_per_s']}  -> {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
