"""rsinfer/local.py: one file per `rsinfer up`, keyed by its port, that only its owner removes; the tools pick
the stack on --port or the only one; a dead `up`'s file and runtime directory are swept by whoever comes next."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

from rsinfer import local
from rsinfer.cli import main

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory of `up` files and no Redis settings in the environment."""
    monkeypatch.setenv("RSINFER_CACHE", str(tmp_path / "cache"))
    for name in ("RSINFER_REDIS_URL", "RSINFER_NAMESPACE", "RSINFER_REDIS_PASSWORD", "RSINFER_REDIS_PASSWORD_FILE"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "cache"


def _dead_pid() -> int:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(gone.stdout)


def test_up_leaves_where_its_redis_is(cache, tmp_path):
    assert local.pick(None) is None and local.overrides({}, None) == {}
    path = local.claim(7000, tmp_path / "rsinfer-up-7000-x")
    local.update(path, redis_url="redis://127.0.0.1:7001/0", redis_password_file="/run/pw", namespace="ns1")
    assert path == cache / "up-7000.json" and oct(path.stat().st_mode & 0o777) == "0o600"
    stack = local.pick(None)
    assert stack == local.pick(7000) and stack["port"] == 7000
    assert local.overrides({}, stack) == {"redis_url": "redis://127.0.0.1:7001/0", "redis_password_file": "/run/pw",
                                          "namespace": "ns1"}
    assert local.overrides({"namespace": "x"}, stack) == {"redis_url": "redis://127.0.0.1:7001/0",
                                                          "redis_password_file": "/run/pw"}
    assert local.overrides({"redis_url": "redis://elsewhere"}, stack) == {}  # a URL given wins
    local.forget(path)
    assert not path.exists()


def test_each_up_has_its_own_file_that_only_it_removes(cache, tmp_path):
    """A second `up` on the port of a live one is refused before it starts anything and leaves the first's file;
    with several running, the tools ask which (--port)."""
    mine = local.claim(7000, tmp_path / "rsinfer-up-7000-a")
    with pytest.raises(local.StackError, match=rf"another rsinfer up \(pid {os.getpid()}\) serves port 7000"):
        local.claim(7000, tmp_path / "rsinfer-up-7000-b")
    assert json.loads(mine.read_text())["dir"].endswith("rsinfer-up-7000-a")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:  # another live process's file, on another port: this process neither removes nor takes it
        theirs = cache / "up-7001.json"
        theirs.write_text(json.dumps({"pid": other.pid, "port": 7001, "dir": "", "namespace": "b"}))
        local.forget(theirs)
        local.update(theirs, namespace="mine now")
        assert json.loads(theirs.read_text())["namespace"] == "b"
        with pytest.raises(local.StackError, match=r"several rsinfer up run here \(ports 7000, 7001\): give --port"):
            local.pick(None)
        assert local.pick(7001)["namespace"] == "b"
        with pytest.raises(local.StackError, match=r"no rsinfer up serves port 7002 here \(running: 7000, 7001\)"):
            local.pick(7002)
    finally:
        other.kill()
        other.wait()
    local.forget(mine)
    assert local.running() == [] and not theirs.exists()  # 7001's process is gone: its file went with the sweep


def test_a_dead_ups_file_and_runtime_directory_are_swept(cache, tmp_path):
    """kill -9 of `up` leaves its file and its runtime directory (the Redis password): the next `up` or tool
    removes both, and a later `up` takes the port."""
    runtime = tmp_path / "rsinfer-up-7000-dead"
    (runtime / "redis").mkdir(parents=True)
    (runtime / "redis" / "password").write_text("secret\n")
    path = local.claim(7000, runtime)
    path.write_text(json.dumps({**json.loads(path.read_text()), "pid": _dead_pid()}))
    elsewhere = tmp_path / "not-a-runtime-dir"  # a file naming a directory `up` would not have made: kept
    elsewhere.mkdir()
    (cache / "up-7001.json").write_text(json.dumps({"pid": _dead_pid(), "port": 7001, "dir": str(elsewhere)}))
    (cache / "up-7002.json").write_text("{not json")
    assert local.pick(None) is None
    assert not runtime.exists() and elsewhere.exists() and list(cache.glob("up-*.json")) == []
    again = local.claim(7000, tmp_path / "rsinfer-up-7000-new")
    assert json.loads(again.read_text())["pid"] == os.getpid()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process start times from /proc")
def test_a_recycled_pid_is_not_the_up_that_wrote_the_file(cache, tmp_path):
    path = local.claim(7000, tmp_path / "rsinfer-up-7000-x")
    path.write_text(json.dumps({**json.loads(path.read_text()), "started": "1"}))  # this pid, another start
    assert local.running() == [] and not path.exists()


def test_the_tools_ask_which_when_several_run(cache, tmp_path, capsys, monkeypatch):
    """`inspect`, `healthcheck` and `drain` next to several `up`: one line that asks for --port, exit status 1."""
    monkeypatch.delenv("RSINFER_PORT", raising=False)
    mine = local.claim(7000, tmp_path / "rsinfer-up-7000-a")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (cache / "up-7001.json").write_text(json.dumps({"pid": other.pid, "port": 7001, "dir": "", "namespace": "b"}))
        for argv, says in ((["inspect"], "rsinfer inspect: "), (["healthcheck", "--role", "scheduler"], "unhealthy: "),
                           (["drain"], "drain failed: ")):
            assert main(argv) == 1
            assert capsys.readouterr().out == f"{says}several rsinfer up run here (ports 7000, 7001): give --port\n"
        liveness = tmp_path / "scheduler.alive"
        liveness.write_text(json.dumps({"role": "scheduler", "id": "s", "pid": os.getpid()}))
        local.update(mine, liveness={"scheduler": str(liveness)}, namespace="a")
        assert main(["healthcheck", "--role", "scheduler", "--port", "7000"]) == 0  # that stack's own file
        assert capsys.readouterr().out.startswith("ok: ")
    finally:
        other.kill()
        other.wait()
        local.forget(mine)


def test_nothing_is_made_where_no_up_ever_ran(tmp_path, monkeypatch):
    """A pod (read-only root filesystem, no cache directory): `rsinfer drain` and the probes find no stack and
    write nothing."""
    monkeypatch.setenv("RSINFER_CACHE", str(tmp_path / "none"))
    assert local.running() == [] and local.pick(None) is None and not (tmp_path / "none").exists()
    readonly = tmp_path / "ro"
    readonly.mkdir()
    (readonly / "up-7000.json").write_text(json.dumps({"pid": os.getpid(), "port": 7000, "started": None}))
    monkeypatch.setenv("RSINFER_CACHE", str(readonly))

    def read_only(*_):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(local.fcntl, "flock", read_only)
    assert [s["port"] for s in local.running()] == [7000]
