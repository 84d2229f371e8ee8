"""`rsinfer up` on its own: starts an embedded redis-server (bounded, with a random password kept out of `ps`),
prints how to reach it, serves on loopback, and on SIGTERM stops every child and the redis-server. With an API
key (from a file or the environment) it becomes ready and shows the key to no `ps`."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai
import pytest
import redis

from shared.keys import Keys
from shared.redis_server import free_port

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # `make test-fast` leaves it out


def start_up(port: int, model_dir, *args: str, **env: str) -> tuple[subprocess.Popen, list[str]]:
    """`rsinfer up` and its output up to "ready on" (an assertion error with the lines if it exits first)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RSINFER_")}
    env.setdefault("RSINFER_CACHE", tempfile.mkdtemp(prefix="rsinfer-up-"))  # where it leaves its Redis's address
    proc = subprocess.Popen([sys.executable, "-m", "rsinfer.cli", "up", "--port", str(port), "--model",
                             str(model_dir), "--served-model-name", "demo", *args],
                            env={**base, "OMP_NUM_THREADS": "1", "RSINFER_THREADS": "1", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    lines: list[str] = []
    while not any("ready on" in line for line in lines):
        line = proc.stdout.readline()
        if not line:
            proc.wait(10)
            raise AssertionError(f"rsinfer up exited early: {lines}")
        lines.append(line)
    return proc, lines


def cmdlines(pid: int) -> list[str]:
    """The command lines of `pid` and its children, as `ps` shows them."""
    out = []
    for p in [pid, *_children(pid)]:
        with contextlib.suppress(OSError):
            out.append(Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode())
    return out


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def tool(cache: Path, *args: str) -> subprocess.CompletedProcess:
    """`rsinfer <args>` as a user runs it next to `up`: no Redis flag or variable, the same cache directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RSINFER_")}
    return subprocess.run([sys.executable, "-m", "rsinfer.cli", *args], env={**env, "RSINFER_CACHE": str(cache)},
                          capture_output=True, text=True, timeout=60)


def test_up_with_embedded_redis(demo_model_dir, tmp_path):
    port = free_port()
    proc, lines = start_up(port, demo_model_dir, RSINFER_CACHE=str(tmp_path))
    try:
        text = "".join(lines)
        # the printed recipe works: the password comes from a 0600 file, the URL carries none
        url = re.search(r"redis-cli -u (\S+)\)", text).group(1)
        password_path = Path(re.search(r"password in (\S+):", text).group(1))
        assert stat.S_IMODE(os.stat(password_path).st_mode) == 0o600
        password = password_path.read_text().strip()
        assert len(password) >= 24 and password not in text
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url).ping()
        r = redis.Redis.from_url(url, password=password)
        assert r.ping()
        assert r.config_get("maxmemory") == {"maxmemory": str(1 << 30)}
        assert r.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        cli = subprocess.run(["redis-cli", "-u", url, "PING"], env={**os.environ, "REDISCLI_AUTH": password},
                             capture_output=True, text=True, timeout=10)
        assert cli.stdout.strip() == "PONG", cli
        assert not [c for c in cmdlines(proc.pid) if password in c], "the Redis password shows in ps"
        # loopback only: 127.0.0.2 is this machine too, but not the address the API listens on
        with pytest.raises(OSError), socket.create_connection(("127.0.0.2", port), timeout=2):
            pass
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3).usage.completion_tokens == 3
        roles = sorted(m.decode().split(":")[0] for m in r.zrange(Keys().workers(), 0, -1))
        assert roles == ["api", "detokenizer", "scheduler", "tokenizer"]
        # inspect and healthcheck find up's Redis with no flag (the file it left in the cache directory)
        shown = tool(tmp_path, "inspect")
        assert shown.returncode == 0, shown
        assert all(role.upper() in shown.stdout.splitlines() for role in roles) and "{" not in shown.stdout
        ready = tool(tmp_path, "healthcheck", "--role", "scheduler", "--ready")
        assert ready.returncode == 0, ready
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert not (tmp_path / "up.json").exists()
        gone = tool(tmp_path, "inspect", "--redis-url", url)  # its Redis is gone: one line, no traceback
        assert gone.returncode == 1 and len(gone.stdout.splitlines()) == 1 and "Traceback" not in gone.stderr
        time.sleep(0.2)
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(url, password=password, socket_connect_timeout=1).ping()
        assert not password_path.exists()
    finally:
        stop(proc)


def test_up_with_an_api_key_becomes_ready_and_keeps_it_out_of_ps(demo_model_dir, tmp_path):
    """The key from a file (or RSINFER_API_KEY): `up` polls its own API with it, and no process shows it."""
    key = "sk-up-0123456789abcdef0123456789abcdef"
    key_file = tmp_path / "api-key"
    key_file.write_text(key + "\n")
    port = free_port()
    proc, lines = start_up(port, demo_model_dir, "--api-key-file", str(key_file))
    try:
        assert f"ready on http://127.0.0.1:{port}" in "".join(lines)
        base = f"http://127.0.0.1:{port}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        reply = openai.OpenAI(base_url=base, api_key=key, max_retries=0).chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert reply.usage.completion_tokens == 2
        assert not [c for c in cmdlines(proc.pid) if key in c], "the API key shows in ps"
    finally:
        stop(proc)
    port = free_port()
    proc, lines = start_up(port, demo_model_dir, RSINFER_API_KEY=key)
    try:
        assert f"ready on http://127.0.0.1:{port}" in "".join(lines)
    finally:
        stop(proc)


def _children(pid: int) -> list[int]:
    out = []
    for proc_stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = proc_stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(proc_stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_children_do_not_outlive_a_killed_up(demo_model_dir):
    """kill -9 of `rsinfer up` (a test runner's timeout, an OOM kill) leaves no worker or redis-server behind."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RSINFER_")}
    env.update(OMP_NUM_THREADS="1", RSINFER_THREADS="1", RSINFER_CACHE=tempfile.mkdtemp(prefix="rsinfer-up-"))
    proc = subprocess.Popen([sys.executable, "-m", "rsinfer.cli", "up", "--port", str(port), "--model",
                             str(demo_model_dir)], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    try:
        while "ready on" not in (line := proc.stdout.readline()):
            assert line, "rsinfer up exited early"
        children = _children(proc.pid)
        assert len(children) == 5  # redis-server, tokenizer, scheduler, detokenizer, api
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        while any(_alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [c for c in children if _alive(c)]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
