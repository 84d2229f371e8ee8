"""A worker's liveness as a local file, so that it does not depend on Redis.

A stage worker touches its liveness file whenever its loop moves (a step, an idle read, a retry while Redis is
unreachable or full), at most once a second. `rsinfer healthcheck --role <stage>` (the liveness and startup
probes) passes while the file is younger than `--max-stall-s` and the process that wrote it lives: a Redis
outage, however long, does not fail it (Kubernetes would restart every worker, and a scheduler's warm-up can
take minutes); an engine step or a handler that hangs does. Whether the worker can serve now, Redis included,
is readiness: `rsinfer healthcheck --role <stage> --ready` also needs its heartbeat in Redis to be fresh.

The file lives in the temp directory (a pod's /tmp emptyDir, which the probe's exec shares) unless
`--liveness-file` names it; its name carries the namespace, role and worker name, so several workers on one
machine have their own. It is created once the worker serves (after a scheduler's warm-up: the startup probe
waits for it), removed when it stops, and a stale one left by a crashed predecessor (a container restarted in
the same pod keeps /tmp) is removed when the process starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

TOUCH_EVERY_S = 1.0


def liveness_path(explicit: str, namespace: str, role: str, name: str) -> Path:
    if explicit:
        return Path(explicit)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{namespace}-{role}-{name}")
    return Path(tempfile.gettempdir()) / f"rsinfer-{safe}.alive"


class Liveness:
    """The file one worker touches while its loop moves."""

    def __init__(self, path: Path, role: str, worker_id: str):
        self.path, self.role, self.id = path, role, worker_id
        self.armed = False  # once the worker serves; before, moving does not count (startup)
        self._touched = 0.0

    def clear(self) -> None:
        """Remove a file a previous process left (it would pass a startup probe before this one serves)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def arm(self) -> None:
        self.armed = True
        self._write()

    def moved(self) -> None:
        if not self.armed:
            return
        now = time.monotonic()
        if now - self._touched < TOUCH_EVERY_S:
            return
        self._touched = now
        try:
            os.utime(self.path)
        except FileNotFoundError:
            self._write()  # someone cleaned the temp directory
        except OSError:
            pass  # a full or read-only disk must not stop the loop: the probe will say so

    def _write(self) -> None:
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"role": self.role, "id": self.id, "pid": os.getpid()}))
            tmp.replace(self.path)
            self._touched = time.monotonic()

    def remove(self) -> None:
        self.armed = False
        self.clear()


def check(path: Path, max_stall_s: float) -> tuple[bool, str]:
    """(alive, why): the file exists, its process lives, and it was touched within `max_stall_s`."""
    try:
        age = time.time() - path.stat().st_mtime
        info = json.loads(path.read_text())
    except FileNotFoundError:
        return False, f"no liveness file {path} (not serving yet, or stopped)"
    except (OSError, ValueError) as e:
        return False, f"liveness file {path} unreadable: {e}"
    pid = int(info.get("pid", 0))
    if pid <= 0:
        return False, f"liveness file {path} names no process"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False, f"process {pid} that wrote {path} is gone"
    except PermissionError:
        pass  # it exists
    if age > max_stall_s:
        return False, f"loop has not moved for {age:.0f}s"
    return True, f"loop moved {age:.1f}s ago"
