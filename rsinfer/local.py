"""Where a local `rsinfer up` left its embedded Redis: a 0600 JSON file in the user's cache directory
(`$RSINFER_CACHE`, else ~/.cache/rsinfer) with the Redis URL, the password file and the namespace, written once
its Redis runs and removed when it stops. `rsinfer inspect` and `rsinfer healthcheck` run next to it without
`--redis-url` read it, so they need no flags. The last `up` started wins; the file of one that died is ignored
(its process is gone)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

FILE = "up.json"


def state_path() -> Path:
    base = os.environ.get("RSINFER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rsinfer")
    return Path(base) / FILE


def remember(redis_url: str, password_file: str, namespace: str) -> Path:
    """Write the file (atomically, readable by this user alone)."""
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{FILE}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": os.getpid(), "redis_url": redis_url, "redis_password_file": password_file,
                   "namespace": namespace}, f)
    os.replace(tmp, path)
    return path


def forget(path: Path) -> None:
    """Remove the file if it is still this process's (a later `up` may have replaced it)."""
    with contextlib.suppress(OSError, ValueError):
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()


def found() -> dict | None:
    """What a running `up` left, or None (no file, an unreadable one, or its process gone)."""
    try:
        state = json.loads(state_path().read_text())
        os.kill(int(state["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return state


def overrides(given: dict) -> dict:
    """Settings to add to those given (flags) for a tool run next to `up`: its Redis and namespace, unless a
    Redis URL was given as a flag or in the environment."""
    if given.get("redis_url") or os.environ.get("RSINFER_REDIS_URL"):
        return {}
    state = found()
    if state is None:
        return {}
    out = {"redis_url": state["redis_url"]}
    if state.get("redis_password_file") and not (given.keys() & {"redis_password", "redis_password_file"}) and not (
            os.environ.get("RSINFER_REDIS_PASSWORD") or os.environ.get("RSINFER_REDIS_PASSWORD_FILE")):
        out["redis_password_file"] = state["redis_password_file"]
    if "namespace" not in given and not os.environ.get("RSINFER_NAMESPACE"):
        out["namespace"] = state["namespace"]
    return out
