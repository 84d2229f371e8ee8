"""The one launcher of rsinfer's process stack. `rsinfer up` (rsinfer/up.py), the end-to-end tests
(tests/support/stack.py) and the benchmarks (bench/harness.py) start, watch and stop their processes with it:
each process is `python -m rsinfer.cli <role>` (or a test's own entry module) with an environment of its own,
and they are stopped together, in reverse start order, however the caller ends."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from rsinfer import children
from shared.heartbeats import model_state

STAGES_IN_ORDER = ("tokenizer", "scheduler", "detokenizer", "api")  # the order a pipeline starts in
# Every process but a scheduler: its work is I/O and small tensors, so one torch thread (the scheduler's engine
# takes the cores).
SINGLE_THREAD = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


class ProcessDied(RuntimeError):
    """A process of the stack exited while the stack waited for it to serve."""


def api_ready(url: str) -> bool:
    """The API at `url` answers /ready with 200: it takes requests (which may wait for workers)."""
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def api_pid(url: str) -> int | None:
    """The pid of the API process answering at `url` (its /health says; of --api-workers' group, its
    supervisor's), or None."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            health = json.loads(resp.read())
            return int(health.get("group", health["pid"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def serving(url: str, model: str | None = None, api_key: str | None = None, pid: int | None = None) -> bool:
    """The API at `url` is ready and `model` (or every model it knows, at least one) has a live worker in
    every stage. `/ready` alone says only that the API takes requests: they would wait for the workers.
    Its body gives each known model's live workers per stage and needs no key (the API may have only
    `--api-keys-file`'s keys); with `api_key`, /v1/models as that key sees it. `pid`: the API process that must
    be the one answering (not another server that holds the port)."""
    if pid is not None and api_pid(url) != pid:
        return False
    states = _model_states(url, api_key)
    wanted = [model] if model else list(states)
    return bool(wanted) and all(states.get(m) == "ready" for m in wanted)


def _model_states(url: str, api_key: str | None) -> dict[str, str]:
    """Each model's `state` (shared/heartbeats.py model_state) while the API is ready; {} otherwise."""
    try:
        if api_key is None:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as resp:
                return {m: model_state(counts) for m, counts in json.loads(resp.read())["models"].items()}
        if not api_ready(url):
            return {}
        request = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"Bearer {api_key}"})
        with urllib.request.urlopen(request, timeout=2) as resp:
            return {c.get("id"): c.get("state") for c in json.loads(resp.read())["data"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # a 503 (not ready) is an OSError
        return {}


class Launcher:
    """Named child processes sharing one environment, each with its own on top.

    `env`: for every process, over this process's environment (a value of None removes the variable).
    `inherit_rsinfer`: False drops this process's own RSINFER_* variables, so that only what the caller says
    configures the children (tests and benches; `up` passes its settings on through them).
    `log_dir`: each process writes stdout and stderr to `<log_dir>/<name>.log`; None: they share ours.
    `own_groups`: each process leads a process group of its own, and kill/stop reach the whole group (what
    `rsinfer up` started under it too); else a terminal's Ctrl-C reaches them with us.
    `die_with_parent`: the kernel stops them if we die, even by SIGKILL (rsinfer/children.py: only from the
    thread that started them; tests, which may start processes from any thread, turn it off and stop them
    at the end of the run instead)."""

    def __init__(self, env: Mapping[str, str | None] | None = None, *, inherit_rsinfer: bool = True,
                 log_dir: Path | None = None, own_groups: bool = False, die_with_parent: bool = True,
                 cwd: Path | None = None) -> None:
        self.base_env = dict(env or {})
        self.inherit_rsinfer = inherit_rsinfer
        self.log_dir = log_dir
        self.own_groups = own_groups
        self.die_with_parent = die_with_parent
        self.cwd = cwd
        self.procs: dict[str, subprocess.Popen] = {}  # by name, in start order

    def env(self, **extra: str | None) -> dict[str, str]:
        """The environment of a process started with `extra` (its own variables, over the shared ones)."""
        env = {k: v for k, v in os.environ.items() if self.inherit_rsinfer or not k.startswith("RSINFER_")}
        for key, value in {**self.base_env, **extra}.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def start(self, name: str, role: str, module: str = "rsinfer.cli", **extra: str | None) -> subprocess.Popen:
        """Start `python -m <module> <role>` as process `name` with the shared environment and `extra`."""
        if name in self.procs and self.procs[name].poll() is None:
            raise ValueError(f"a process named {name} is running")
        argv = [sys.executable, "-m", module, role]
        kw: dict = {"env": self.env(**extra), "cwd": self.cwd, "start_new_session": self.own_groups}
        if self.log_dir is not None:
            log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115  (the child owns it from here)
            kw.update(stdout=log, stderr=subprocess.STDOUT)
        try:
            proc = children.spawn(argv, **kw) if self.die_with_parent else subprocess.Popen(argv, **kw)
        finally:
            if self.log_dir is not None:
                log.close()
        self.procs[name] = proc
        return proc

    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.procs.items()}

    def dead(self) -> list[str]:
        """`<name> (exit <code>)` of every process that has exited."""
        return [f"{name} (exit {p.returncode})" for name, p in self.procs.items() if p.poll() is not None]

    def wait_until(self, check: Callable[[], bool], timeout: float, what: str = "the stack") -> None:
        """Until `check()` holds; ProcessDied as soon as a process exits, TimeoutError after `timeout` s."""
        deadline = time.monotonic() + timeout
        where = f"; logs in {self.log_dir}" if self.log_dir else ""
        while True:
            if dead := self.dead():
                raise ProcessDied(f"processes died: {', '.join(dead)}{where}")
            if check():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not ready in {timeout:.0f} s{where}")
            time.sleep(0.2)

    def wait_serving(self, url: str, model: str | None, timeout: float = 300.0, api_key: str | None = None,
                     api: str | None = None) -> None:
        """Until the API at `url` takes requests and `model` has a live worker in every stage (`serving`);
        `api`: the name of this stack's API process, which must be the one answering at `url`."""
        pid = self.procs[api].pid if api else None
        self.wait_until(lambda: serving(url, model, api_key, pid), timeout, url)

    def send_signal(self, name: str, sig: int) -> None:
        """Send `sig` to process `name` (its whole group when each process has its own)."""
        proc = self.procs[name]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.own_groups:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)

    def kill(self, name: str, sig: int = signal.SIGKILL, timeout: float = 30.0) -> None:
        """Take process `name` out of the stack: send it `sig` and wait for it; after a SIGKILL, whatever it
        started in its group goes too."""
        proc = self.procs.pop(name)
        proc.send_signal(sig)
        proc.wait(timeout)
        if sig == signal.SIGKILL and self.own_groups:
            _kill_group(proc)

    def stop(self, grace: float = 15.0, names: Iterable[str] | None = None) -> None:
        """SIGTERM every process (newest first), let them finish for up to `grace` seconds in all, SIGKILL what
        is left (whole groups when each has its own); the stack is empty after. `names`: only those processes."""
        wanted = set(self.procs if names is None else names)
        procs = [(n, p) for n, p in reversed(self.procs.items()) if n in wanted]
        for name, proc in procs:
            if proc.poll() is None or self.own_groups:
                self.send_signal(name, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for _, proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            if self.own_groups:
                _kill_group(proc)
            elif proc.poll() is None:
                proc.kill()
            proc.wait()
        for name, _ in procs:
            del self.procs[name]


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
