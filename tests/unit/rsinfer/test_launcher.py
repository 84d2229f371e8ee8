"""rsinfer/launcher.py with real child processes (small standard-library modules stand in for a stage): the
environment each gets, its log, a death noticed while waiting, and stop/kill reaching what it started."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from rsinfer.launcher import Launcher, ProcessDied, serving
from tests.support.helpers import wait_for

pytestmark = pytest.mark.timeout(60)


def test_each_process_gets_the_shared_environment_and_its_own(monkeypatch):
    monkeypatch.setenv("RSINFER_FROM_THE_CALLER", "1")
    monkeypatch.setenv("OTHER_FROM_THE_CALLER", "1")
    shared = Launcher({"RSINFER_A": "a", "RSINFER_B": "b", "OTHER_FROM_THE_CALLER": None})
    env = shared.env(RSINFER_B="own", RSINFER_C="c")
    assert env["RSINFER_A"] == "a" and env["RSINFER_B"] == "own" and env["RSINFER_C"] == "c"
    assert env["RSINFER_FROM_THE_CALLER"] == "1" and "OTHER_FROM_THE_CALLER" not in env
    only_ours = Launcher({"RSINFER_A": "a"}, inherit_rsinfer=False).env()
    assert "RSINFER_FROM_THE_CALLER" not in only_ours and only_ours["RSINFER_A"] == "a"
    assert only_ours["PATH"] == os.environ["PATH"]


def test_a_process_that_exits_is_reported_while_waiting_with_its_log(tmp_path: Path):
    stack = Launcher(log_dir=tmp_path)
    try:
        stack.start("lister", "/no/such/file", module="json.tool")  # `python -m json.tool <role>`: exits 2
        with pytest.raises(ProcessDied, match=r"lister \(exit 2\).*logs in"):
            stack.wait_until(lambda: False, timeout=30)
        assert "No such file" in (tmp_path / "lister.log").read_text()
    finally:
        stack.stop()
    assert stack.procs == {}


def test_wait_until_times_out_while_every_process_runs():
    stack = Launcher()
    try:
        stack.start("server", "0", module="http.server")
        with pytest.raises(TimeoutError):
            stack.wait_until(lambda: False, timeout=0.5)
    finally:
        stack.stop()


def test_stop_terminates_newest_first_and_kills_what_does_not_stop(tmp_path: Path):
    stack = Launcher(log_dir=tmp_path, cwd=tmp_path)  # `python -m` finds modules in its cwd
    # a process that ignores SIGTERM: stop() kills it once the grace is over
    (tmp_path / "stubborn.py").write_text("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                          "print('up', flush=True)\ntime.sleep(60)\n")
    try:
        first = stack.start("first", "0", module="http.server")
        second = stack.start("second", "x", module="stubborn")
        wait_for(lambda: "up" in (tmp_path / "second.log").read_text(), 20, 0.05)
        began = time.monotonic()
        stack.stop(grace=1.0)
        assert time.monotonic() - began < 10
        assert first.returncode == -signal.SIGTERM and second.returncode == -signal.SIGKILL
    finally:
        stack.stop()


def test_stop_can_take_some_processes_first(tmp_path: Path):
    """As `rsinfer up` stops its API before the stages that serve its open streams."""
    stack = Launcher()
    try:
        first, second = stack.start("stage", "0", module="http.server"), stack.start("api", "0", module="http.server")
        stack.stop(grace=10, names=["api"])
        assert second.returncode is not None and first.poll() is None and list(stack.procs) == ["stage"]
    finally:
        stack.stop()
    assert first.returncode is not None and stack.procs == {}


class _FakeApi(BaseHTTPRequestHandler):
    """/health with a pid, and /ready with each model's live workers per stage, as the API answers them."""

    pid = 0
    bodies: ClassVar[dict] = {"/health": {"status": "ok"}, "/ready": {"ready": True, "models": {
        "m": {"tokenizer": 1, "scheduler": 1, "detokenizer": 1}, "cold": {"tokenizer": 0, "scheduler": 1}}}}

    def do_GET(self) -> None:
        body = json.dumps({**self.bodies[self.path], **({"pid": self.pid} if self.path == "/health" else {})})
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *_) -> None:
        pass


def test_serving_means_this_stacks_own_api():
    """Another server that holds the port (and answers like an API) is not this stack's API."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeApi)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        _FakeApi.pid = 4242
        assert serving(url, "m") and serving(url, "m", pid=4242)
        assert not serving(url, "m", pid=os.getpid())
        assert not serving(url, "cold") and not serving(url)  # a stage without a worker: not every model serves
    finally:
        server.shutdown()


def test_with_groups_of_their_own_a_kill_reaches_the_grandchildren(tmp_path: Path):
    """As `rsinfer up`'s children are reached when a test kills the `up` it started."""
    parent = tmp_path / "parent.py"
    parent.write_text("import subprocess, sys, time\n"
                      "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                      "print(child.pid, flush=True)\ntime.sleep(60)\n")
    stack = Launcher(log_dir=tmp_path, own_groups=True, die_with_parent=False, cwd=tmp_path)
    stack.start("parent", "x", module="parent")
    wait_for(lambda: (tmp_path / "parent.log").read_text().strip(), 20, 0.05)
    grandchild = int((tmp_path / "parent.log").read_text().split()[0])
    stack.kill("parent")
    wait_for(lambda: not _alive(grandchild), 10, 0.05)
    assert stack.procs == {}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
