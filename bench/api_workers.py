"""`make bench`'s 512-stream synthetic point (bench/run_all.py `synthetic_point`) through one API process and
through one `--api-workers N` group (rsinfer/api_workers.py) on one stack, in interleaved pairs so that load from
other processes falls on both alike; medians. The API's CPU per token counts the group's workers.

    python bench/api_workers.py [--pairs 3] [--workers 2] [--tokens 64] [--waves 2]
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
from bench.run_all import Point, id_prompts, synthetic_env, synthetic_point  # noqa: E402
from rsinfer.redis_server import free_port  # noqa: E402
from shared.demo_model import ensure_demo_model  # noqa: E402
from shared.settings import DEMO_MODEL_NAME  # noqa: E402

FIGURES = ("steady_tok_per_s", "tok_per_s", "ttft_p50_ms", "itl_p99_ms")


class Stack(BenchStack):
    """The bench stack with a second API: a group of workers; `measured` names the API whose CPU is counted."""

    measured = "api"

    def pids(self) -> dict[str, int]:
        out = {k: v for k, v in super().pids().items() if not k.startswith("api") or k == self.measured}
        if self.measured == "group":  # its workers, the supervisor's children
            group = out["group"]
            kids = Path(f"/proc/{group}/task/{group}/children").read_text().split()
            out.update({f"api-worker{i}": int(pid) for i, pid in enumerate(kids)})
        return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--waves", type=int, default=2)
    args = ap.parse_args()
    name = DEMO_MODEL_NAME
    point = Point(512, 512 * args.waves, args.tokens, 2)
    runs: dict[str, list[dict]] = {"api": [], "group": []}
    with Stack(str(ensure_demo_model()), name, apis=1, env=synthetic_env(512)) as stack:
        port = free_port()
        stack._spawn("group", "api", RSINFER_PORT=str(port), RSINFER_API_WORKERS=str(args.workers))
        group_url = f"http://127.0.0.1:{port}"
        stack.wait_serving(group_url, name, 300)
        urls = {"api": stack.urls[0], "group": group_url}
        for url in urls.values():  # warm-up
            run_load([url], [completion_body(name, p, 8) for p in id_prompts(16, 2, 16)], 16)
        for i in range(args.pairs):
            for key, url in sorted(urls.items(), reverse=bool(i % 2)):  # each goes first in every other pair
                stack.measured = key
                p = synthetic_point(stack, [url], name, point)
                runs[key].append(p)
                share = p["steady_tok_per_s"] / p["ideal"]
                print(f"pair {i} {key:5}: {p['steady_tok_per_s']:,.0f} tok/s steady ({share:.0%} of "
                      f"{p['ideal']:,.0f}), TTFT p50 {p['ttft_p50_ms']:.0f} ms, ITL p99 {p['itl_p99_ms']:.0f} ms, "
                      f"API {p['us_per_token'].get('api', 0):.0f} µs/token, {p['ok']}/{p['requests']} ok, "
                      f"load {loadavg()}", flush=True)
    medians = {k: {f: statistics.median(r[f] for r in rs) for f in FIGURES} for k, rs in runs.items()}
    for k, rs in runs.items():
        medians[k]["api_us_per_token"] = statistics.median(r["us_per_token"].get("api", 0) for r in rs)
        medians[k]["ideal"] = rs[0]["ideal"]
    print(json.dumps({"workers": args.workers, "medians": medians}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
