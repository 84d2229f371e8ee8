"""Records, in every process started with RSINFER_WALK_DIR set (bench/module_walk.py), the first entry of each
project function while a recording window is open: the window is open while the file `<dir>/window` exists.
When the window closes, this process writes `<dir>/<role>-<pid>.json`: [[t, module, qualname], ...] in order."""

import json
import os
import sys
import threading
import time

_DIR = os.environ.get("RSINFER_WALK_DIR")
_ROOT = os.environ.get("RSINFER_WALK_ROOT", "")
_PACKAGES = ("services", "shared", "rsinfer")


def _install() -> None:
    window = os.path.join(_DIR, "window")
    roots = tuple(os.path.join(_ROOT, p) + os.sep for p in _PACKAGES)
    state = {"open": False, "checked": 0.0, "seen": set(), "walk": []}
    lock = threading.Lock()

    def role() -> str:
        with open("/proc/self/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        return argv[argv.index(b"rsinfer.cli") + 1].decode() if b"rsinfer.cli" in argv else "python"

    def dump() -> None:
        path = os.path.join(_DIR, f"{role()}-{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump(state["walk"], f)

    def check(now: float) -> None:
        state["checked"] = now
        opened = os.path.exists(window)
        if opened and not state["open"]:
            state["seen"], state["walk"] = set(), []
        elif state["open"] and not opened:
            dump()
        state["open"] = opened

    def profile(frame, event, _arg):
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(roots):
            return
        now = time.time()
        with lock:
            if now - state["checked"] > 0.01:
                check(now)
            if state["open"] and code not in state["seen"]:
                state["seen"].add(code)
                module = os.path.relpath(code.co_filename, _ROOT)[:-3].replace(os.sep, ".")
                state["walk"].append([now, module, code.co_qualname])

    sys.setprofile(profile)
    threading.setprofile(profile)


if _DIR:
    _install()
