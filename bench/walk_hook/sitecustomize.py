"""Records, in every process started with RSINFER_WALK_DIR set (bench/module_walk.py), the first entry of each
project function while a recording window is open: the window is open while the file `<dir>/window` exists.
When the window closes, this process writes `<dir>/<role>-<pid>.json`: [[t, module, qualname, callers], ...] in
order, `callers` being the project modules on the stack below it, outermost first (what it was called within)."""

import json
import os
import sys
import threading
import time

_DIR = os.environ.get("RSINFER_WALK_DIR")
_ROOT = os.environ.get("RSINFER_WALK_ROOT", "")
_PACKAGES = ("services", "shared", "rsinfer")


class _Recorder:
    """The first entry of each project function, while the window file exists; written out when it goes."""

    def __init__(self) -> None:
        self.window = os.path.join(_DIR, "window")
        self.roots = tuple(os.path.join(_ROOT, p) + os.sep for p in _PACKAGES)
        self.open, self.checked = False, 0.0
        self.seen: set = set()
        self.walk: list = []
        self.lock = threading.Lock()

    @staticmethod
    def role() -> str:
        with open("/proc/self/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        return argv[argv.index(b"rsinfer.cli") + 1].decode() if b"rsinfer.cli" in argv else "python"

    def dump(self) -> None:
        path = os.path.join(_DIR, f"{self.role()}-{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump(self.walk, f)

    def check(self, now: float) -> None:
        self.checked = now
        opened = os.path.exists(self.window)
        if opened and not self.open:
            self.seen, self.walk = set(), []
        elif self.open and not opened:
            self.dump()
        self.open = opened

    def profile(self, frame, event, _arg) -> None:
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(self.roots):
            return
        now = time.time()
        with self.lock:
            if now - self.checked > 0.01:
                self.check(now)
            if self.open and code not in self.seen:
                self.seen.add(code)
                self.walk.append([now, self.module(code), code.co_qualname, self.callers(frame.f_back)])

    def module(self, code) -> str:
        return os.path.relpath(code.co_filename, _ROOT)[:-3].replace(os.sep, ".")

    def callers(self, frame) -> list:
        out: list = []
        while frame is not None and len(out) < 64:
            if frame.f_code.co_filename.startswith(self.roots):
                out.append(self.module(frame.f_code))
            frame = frame.f_back
        return out[::-1]


def _install() -> None:
    recorder = _Recorder()
    sys.setprofile(recorder.profile)
    threading.setprofile(recorder.profile)


if _DIR:
    _install()
