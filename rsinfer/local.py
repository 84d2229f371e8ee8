"""Where each local `rsinfer up` left its stack: one 0600 JSON file per stack, keyed by its HTTP port, in the
user's cache directory (`$RSINFER_CACHE`, else ~/.cache/rsinfer): `up-<port>.json`, with its owner (pid and
start time), the port, its runtime directory (the embedded Redis's files, the workers' liveness files), the
Redis URL, password file and namespace. `up` claims the file before it starts anything (a second `up` on that
port stops there), completes it once its Redis runs, and removes it when it stops; nobody else removes a live
one. The file of an `up` that died (kill -9) is stale: the next `up`, `inspect`, `healthcheck` or `drain` on
this machine removes it and its runtime directory.

`rsinfer inspect`, `healthcheck` and `drain` run next to `up` without `--redis-url` read it, so they need no
flags: the stack on `--port`, or the only one running (several: they ask for `--port`)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

RUNTIME_PREFIX = "rsinfer-up-"  # the runtime directory's name starts so (tempfile.mkdtemp's prefix in rsinfer/up.py)


class StackError(Exception):
    """Which stack a command means cannot be told (several run, none on that port), or a port is taken: the
    message is for the user."""


def state_dir() -> Path:
    return Path(os.environ.get("RSINFER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rsinfer"))


def state_path(port: int) -> Path:
    return state_dir() / f"up-{port}.json"


def _start_time(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot; Linux), so that a recycled pid is not taken for it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _me() -> dict:
    return {"pid": os.getpid(), "started": _start_time(os.getpid())}


def _alive(state: dict) -> bool:
    try:
        pid = int(state["pid"])
        os.kill(pid, 0)
    except PermissionError:
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False
    started = state.get("started")
    return started is None or started == _start_time(pid)


def _mine(state: dict | None) -> bool:
    return state is not None and {k: state.get(k) for k in ("pid", "started")} == _me()


def _read(path: Path) -> dict | None:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """One claim or sweep at a time on this machine: a stale file is never removed after another `up` took its
    place."""
    state_dir().mkdir(parents=True, exist_ok=True)
    with open(state_dir() / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _write(path: Path, state: dict, *, exclusive: bool = False) -> None:
    """The file, readable by this user alone; replaced atomically unless `exclusive` (then it must not exist)."""
    target = path if exclusive else path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_EXCL if exclusive else 0), 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)
    if not exclusive:
        os.replace(target, path)


def _remove_stale(path: Path, state: dict | None) -> None:
    """A dead `up`'s file and its runtime directory (only a directory of ours that `up` would have made)."""
    runtime = Path(str((state or {}).get("dir") or ""))
    with contextlib.suppress(OSError):
        if runtime.name.startswith(RUNTIME_PREFIX) and runtime.stat().st_uid == os.getuid():
            shutil.rmtree(runtime, ignore_errors=True)
    with contextlib.suppress(OSError):
        path.unlink()


def claim(port: int, runtime_dir: Path) -> Path:
    """Make this process the owner of port `port`'s file; StackError if a live `up` owns it (a stale one goes)."""
    path = state_path(port)
    with _locked():
        other = next((s for s in _sweep() if s.get("port") == port), None)
        if other is not None:
            raise StackError(f"another rsinfer up (pid {other.get('pid')}) serves port {port}; "
                             "stop it or give another --port")
        _write(path, {**_me(), "port": port, "dir": str(runtime_dir)}, exclusive=True)
    return path


def update(path: Path, **fields: object) -> None:
    """Add `fields` to this process's file (what its Redis is, once it runs)."""
    state = _read(path)
    if _mine(state):
        _write(path, {**state, **fields})


def forget(path: Path) -> None:
    """Remove the file if it is this process's."""
    if _mine(_read(path)):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def running() -> list[dict]:
    """The stacks whose `up` lives, by port; the files of dead ones are removed on the way. Nothing is made
    where no `up` ever ran (a pod's read-only root filesystem: `rsinfer drain` and the probes run there)."""
    if not state_dir().is_dir():
        return []
    try:
        with _locked():
            return _sweep()
    except OSError:  # a directory this user cannot write: read it as it is
        return sorted((s for s in map(_read, state_dir().glob("up-*.json")) if s is not None and _alive(s)),
                      key=lambda s: int(s.get("port", 0)))


def _sweep() -> list[dict]:
    stacks = []
    for path in state_dir().glob("up-*.json"):
        state = _read(path)
        if state is not None and _alive(state):
            stacks.append(state)
        else:
            _remove_stale(path, state)
    return sorted(stacks, key=lambda s: int(s.get("port", 0)))


def pick(port: int | None) -> dict | None:
    """The running stack on `port`, or the only one running; None when none runs (and no port was named)."""
    stacks = running()
    if port is not None:
        found = next((s for s in stacks if s.get("port") == port), None)
        if found is None and stacks:
            raise StackError(f"no rsinfer up serves port {port} here (running: {_ports(stacks)})")
        return found
    if len(stacks) > 1:
        raise StackError(f"several rsinfer up run here (ports {_ports(stacks)}): give --port")
    return stacks[0] if stacks else None


def _ports(stacks: list[dict]) -> str:
    return ", ".join(str(s.get("port")) for s in stacks)


def overrides(given: dict, stack: dict | None) -> dict:
    """Settings to add to those given (flags) for a tool run next to `stack` (`pick`): its Redis and namespace,
    unless a Redis URL was given as a flag or in the environment."""
    if given.get("redis_url") or os.environ.get("RSINFER_REDIS_URL") or not (stack or {}).get("redis_url"):
        return {}
    out = {"redis_url": stack["redis_url"]}
    if stack.get("redis_password_file") and not (given.keys() & {"redis_password", "redis_password_file"}) and not (
            os.environ.get("RSINFER_REDIS_PASSWORD") or os.environ.get("RSINFER_REDIS_PASSWORD_FILE")):
        out["redis_password_file"] = stack["redis_password_file"]
    if "namespace" not in given and not os.environ.get("RSINFER_NAMESPACE"):
        out["namespace"] = stack["namespace"]
    return out
