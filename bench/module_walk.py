"""The module walk of one streamed chat completion: which project functions each process enters for it, in the
order they are first entered, and how often the walk comes back to a module it already left.

Every process of a BenchStack runs with bench/walk_hook/sitecustomize.py, which records the first entry of each
project function (services/, shared/, rsinfer/) while a window is open. The walk is recorded twice with the same
length: once idle (heartbeats, keep-alives, registry refreshes) and once around one streamed chat completion; the
functions of the idle window are taken out of the request's, so what is left is what the request itself runs.

    python bench/module_walk.py            # prints the walk per process, writes bench/results/module-walk.json

Figures per process: `stops` (functions entered), `modules` (distinct), `segments` (runs of one module in the walk)
and `returns` (segments - modules: how often the reader comes back to a module already visited).

The API also gets its `pass`: the modules services/api/answer/service.py hands the request to, in order (README, "the
path through the API reads as one pass"). Each step counts for the module the service entered to get there (a
package of the API, services/api/answer/request/, counting as one module), so what a module does beneath it (admission's
checks in schemas, limits, tenancy; the format's parsers) is folded into that module's one visit, and the
service's own functions are the path itself, not stops on it. Before the service runs, the steps are the HTTP edge
(services/api/edge/: http.py, app.py, routes.py, the body's parsing); after it returned the SSE response
(services/api/answer/sse.py), the server runs that, and it pulls the replies and their chunks. Steps of the request's
own tasks (the reply read and the disconnect watch the service races, services/api/answer/request/requests.py
`until_disconnect`) count for their module; those of the process's tasks (the reply hub's reader) are listed apart,
under `tasks`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import BenchStack  # noqa: E402
from shared.demo_model import ensure_demo_model  # noqa: E402
from shared.settings import DEMO_MODEL_NAME  # noqa: E402

HOOK = ROOT / "bench" / "walk_hook"
WINDOW_S = 3.0


def record(walk_dir: Path, action) -> dict[str, list]:
    """Open the window, run `action`, keep it open WINDOW_S in all, close it; every process's walk by role."""
    for old in walk_dir.glob("*.json"):
        old.unlink()
    (walk_dir / "window").write_text("on")
    began = time.monotonic()
    action()
    time.sleep(max(0.0, WINDOW_S - (time.monotonic() - began)))
    (walk_dir / "window").unlink()
    time.sleep(2.5)  # each process notices at its next project call (heartbeats: every second)
    walks: dict[str, list] = {}
    for path in sorted(walk_dir.glob("*.json")):
        walks[path.stem.rsplit("-", 1)[0]] = json.loads(path.read_text())
    return walks


def stream_one(url: str, max_tokens: int) -> None:
    body = {"model": DEMO_MODEL_NAME, "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
        for _ in resp.iter_lines():
            pass


def segments_of(modules: list[str]) -> list[str]:
    out: list[str] = []
    for module in modules:
        if not out or out[-1] != module:
            out.append(module)
    return out


EDGE = ("services.api.edge.", "services.api.main", "rsinfer.")  # the HTTP edge, and the process's entry
SERVICE = "services.api.answer.service"
# Tasks of the request's own, outside the service's stack: the response the server runs, the reply reads and the
# disconnect watch the service races (services/api/answer/request/requests.py `until_disconnect`).
OWN_TASKS = ("services.api.answer.sse", "services.api.answer.request")


def pass_unit(module: str) -> str:
    """What a module counts as in the pass: a module of one of the API's layers (services/api/<layer>/), a package
    of it (services/api/answer/request/) being one step, whichever of its modules runs, as the module it was split
    from was."""
    parts = module.split(".")
    return ".".join(parts[:4]) if parts[:2] == ["services", "api"] else module


def pass_module(module: str, callers: list[str]) -> str | None:
    """The module of the API's one pass that a step belongs to (module doc); None for another task's step."""
    stack = [m for m in (*callers, module) if not m.startswith(EDGE)]
    if not stack:
        return "edge"
    if SERVICE not in stack:
        return stack[0] if stack[0] in OWN_TASKS else None
    beneath = [m for m in stack[stack.index(SERVICE):] if m != SERVICE]
    return beneath[0] if beneath else SERVICE


def pass_of(steps: list[tuple[str, str, list[str]]]) -> tuple[list[str], list[str]]:
    """The pass's segments, and the modules other tasks ran in."""
    before = True  # until the service is entered, what runs is the edge's (parsing the body)
    modules, tasks = [], []
    for m, _, callers in steps:
        m, callers = pass_unit(m), [pass_unit(c) for c in callers]
        before = before and m != SERVICE and SERVICE not in callers
        module = "edge" if before else pass_module(m, callers)
        if module is None:
            tasks.append(m)
        elif module != SERVICE:
            modules.append(module)
    short = [s.rsplit(".", 1)[-1] for s in segments_of(modules)]
    return short, sorted({t.rsplit(".", 1)[-1] for t in tasks})


def figures(role: str, walk: list, idle: set[tuple[str, str]]) -> dict:
    """`own_segments`: the walk through the process's own package (services/<role>/) alone, as a reader of that
    stage's code sees it."""
    full = [(m, q, rest[0] if rest else []) for _, m, q, *rest in walk if (m, q) not in idle]
    steps = [(m, q) for m, q, _ in full]
    segments = segments_of([m for m, _ in steps])
    own = segments_of([m for m, _ in steps if m.startswith(f"services.{role}.")])
    modules = set(segments)
    extra = dict(zip(("pass", "tasks"), pass_of(full), strict=True)) if role == "api" else {}
    return {**extra, "stops": len(steps), "modules": len(modules), "segments": len(segments),
            "returns": len(segments) - len(modules), "walk": [f"{m}.{q}" for m, q in steps],
            "module_segments": [s.rsplit(".", 1)[-1] for s in segments],
            "own_segments": [s.rsplit(".", 1)[-1] for s in own]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "module-walk.json"))
    args = parser.parse_args()
    walk_dir = Path(tempfile.mkdtemp(prefix="rsinfer-walk-"))
    hook_env = {"PYTHONPATH": os.pathsep.join([str(HOOK), str(ROOT)]), "RSINFER_WALK_DIR": str(walk_dir),
                "RSINFER_WALK_ROOT": str(ROOT)}
    model_dir = str(ensure_demo_model())
    env = {role: hook_env for role in ("api", "tokenizer", "scheduler", "detokenizer")}
    with BenchStack(model_dir, DEMO_MODEL_NAME, env=env) as stack:
        url = stack.urls[0]
        stream_one(url, args.max_tokens)  # first-use work (lazy imports, caches) out of the way
        idle = record(walk_dir, lambda: None)
        busy = record(walk_dir, lambda: stream_one(url, args.max_tokens))
    out = {}
    for role, walk in busy.items():
        out[role] = figures(role, walk, {(m, q) for _, m, q, *_ in idle.get(role, [])})
    total = {k: sum(o[k] for o in out.values()) for k in ("stops", "returns")}
    for role, fig in out.items():
        print(f"{role:12s} stops {fig['stops']:3d}  modules {fig['modules']:2d}  segments {fig['segments']:3d}  "
              f"returns {fig['returns']:3d}")
        print(f"  its own package, {len(fig['own_segments'])} segments: " + " → ".join(fig["own_segments"]))
        if "pass" in fig:
            print(f"  its pass, {len(fig['pass'])} segments: " + " → ".join(fig["pass"])
                  + f" (other tasks: {', '.join(fig['tasks'])})")
    print(f"total: {total}")
    Path(args.output).write_text(json.dumps({"per_process": out, "total": total}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
