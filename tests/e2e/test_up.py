"""`rsinfer up` on its own: starts an embedded redis-server, prints its URL, serves, and on SIGTERM
stops every child and the redis-server."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import redis

from shared.keys import Keys
from shared.redis_server import free_port

pytestmark = pytest.mark.timeout(120)


def test_up_with_embedded_redis(demo_model_dir, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RSINFER_")}
    env.update(OMP_NUM_THREADS="1", RSINFER_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "rsinfer.cli", "up", "--port", str(port), "--model",
                             str(demo_model_dir), "--served-model-name", "demo"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = []
        while not any("ready on" in line for line in lines):
            line = proc.stdout.readline()
            assert line, f"rsinfer up exited early: {lines}"
            lines.append(line)
        url = re.search(r"redis-cli -u (\S+)\)", "".join(lines)).group(1)
        r = redis.Redis.from_url(url)
        assert r.ping()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3).usage.completion_tokens == 3
        roles = sorted(m.decode().split(":")[0] for m in r.zrange(Keys().workers(), 0, -1))
        assert roles == ["api", "detokenizer", "scheduler", "tokenizer"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        time.sleep(0.2)
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
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
    env.update(OMP_NUM_THREADS="1", RSINFER_THREADS="1")
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
