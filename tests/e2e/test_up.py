"""`rsinfer up` on its own: starts an embedded redis-server (bounded, with a random password kept out of `ps`),
prints how to reach it, serves on loopback, and on SIGTERM stops every child and the redis-server. With an API
key (from a file or the environment) it becomes ready, says a key is required, and shows the key to no `ps`.
Several on one machine keep to their own port, files and Redis; Ctrl-C or SIGTERM with a stream open lets it
finish (the API drains, then the stages stop, then Redis); kill -9 leaves nothing the next one trips on."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import openai
import pytest
import redis

from rsinfer.redis_server import free_port
from services.api.edge.admin import admin_socket_path
from shared.keys import Keys
from tests.support.helpers import wait_for
from tests.support.streaming import Streamer

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # `make test-fast` leaves it out


def start_up(port: int, model_dir, *args: str, **env: str) -> tuple[subprocess.Popen, list[str]]:
    """`rsinfer up` and its output up to "ready on" (an assertion error with the lines if it exits first)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RSINFER_")}
    if "RSINFER_CACHE" not in env:  # where it leaves its Redis's address
        env["RSINFER_CACHE"] = tempfile.mkdtemp(prefix="rsinfer-up-")
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
    """Stop it as a user does (SIGTERM: it removes its files and Redis), then kill whatever is left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def tool(cache: Path, *args: str) -> subprocess.CompletedProcess:
    """`rsinfer <args>` as a user runs it next to `up`: no Redis flag or variable, the same cache directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RSINFER_")}
    return subprocess.run([sys.executable, "-m", "rsinfer.cli", *args], env={**env, "RSINFER_CACHE": str(cache)},
                          capture_output=True, text=True, timeout=60)


KEY = "sk-up-0123456789abcdef0123456789abcdef"


def test_up_with_embedded_redis_and_an_api_key_file(demo_model_dir, tmp_path):
    """Its Redis: bounded, its password in a 0600 file and in no `ps`, reachable with the printed recipe, gone with
    `up`. Its API key from a file: `up` polls its own API with it and becomes ready, says a key is required, and
    no process shows the key. (The synthetic engine: nothing here reads the model's text.)"""
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")
    port = free_port()
    proc, lines = start_up(port, demo_model_dir, "--api-key-file", str(key_file), RSINFER_CACHE=str(tmp_path),
                           RSINFER_ENGINE="synthetic")
    try:
        text = "".join(lines)
        assert f"ready on http://127.0.0.1:{port}" in text
        assert f"rsinfer: clients must send an API key (Authorization: Bearer <key>): the key in {key_file} " \
               "(--api-key-file)\n" in lines and KEY not in text
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
        shown_in_ps = cmdlines(proc.pid)
        assert not [c for c in shown_in_ps if password in c], "the Redis password shows in ps"
        assert not [c for c in shown_in_ps if KEY in c], "the API key shows in ps"
        # loopback only: 127.0.0.2 is this machine too, but not the address the API listens on
        with pytest.raises(OSError), socket.create_connection(("127.0.0.2", port), timeout=2):
            pass
        base = f"http://127.0.0.1:{port}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
        assert client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                              extra_body={"ignore_eos": True}).usage.completion_tokens == 3
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
        assert not (tmp_path / f"up-{port}.json").exists() and not admin_socket_path("", port).parent.exists()
        gone = tool(tmp_path, "inspect", "--redis-url", url)  # its Redis is gone: one line, no traceback
        assert gone.returncode == 1 and len(gone.stdout.splitlines()) == 1 and "Traceback" not in gone.stderr

        def redis_gone() -> bool:
            try:
                redis.Redis.from_url(url, password=password, socket_connect_timeout=1).ping()
            except redis.ConnectionError:
                return True
            return False

        wait_for(redis_gone, timeout=10)
        assert not password_path.exists()
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


def test_children_do_not_outlive_a_killed_up(demo_model_dir, tmp_path):
    """kill -9 of `rsinfer up` (a test runner's timeout, an OOM kill) leaves no worker or redis-server behind.
    (Its API key from RSINFER_API_KEY: it says so, and becomes ready all the same.)"""
    port = free_port()
    cache = tmp_path
    proc, lines = start_up(port, demo_model_dir, RSINFER_CACHE=str(cache), RSINFER_ENGINE="synthetic",
                           RSINFER_API_KEY=KEY)
    try:
        assert "rsinfer: clients must send an API key (Authorization: Bearer <key>): the key in RSINFER_API_KEY\n" \
               in lines
        children = _children(proc.pid)
        assert len(children) == 5  # redis-server, tokenizer, scheduler, detokenizer, api
        proc.kill()
        proc.wait()
        wait_for(lambda: not [c for c in children if _alive(c)], timeout=30, every=0.2)
        # what it left (its file, its runtime directory with the Redis password) goes with the next tool or `up`;
        # its API, stopped by the kernel's SIGTERM, removed its control socket's directory itself
        runtime = Path(json.loads((cache / f"up-{port}.json").read_text())["dir"])
        assert (runtime / "redis" / "password").exists()
        assert not admin_socket_path("", port).parent.exists()
        tool(cache, "inspect")
        assert not (cache / f"up-{port}.json").exists() and not runtime.exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class Up:
    """`rsinfer up` on the synthetic engine with its whole output (its lines and its children's logs), read by a
    thread so that no child ever blocks on a full pipe."""

    def __init__(self, port: int, model_dir, cache: Path, *args: str, **env: str):
        base = {k: v for k, v in os.environ.items() if not k.startswith("RSINFER_")}
        env = {**base, "OMP_NUM_THREADS": "1", "RSINFER_THREADS": "1", "RSINFER_CACHE": str(cache),
               "RSINFER_ENGINE": "synthetic", **env}
        self.port, self.lines = port, []
        self.proc = subprocess.Popen([sys.executable, "-m", "rsinfer.cli", "up", "--port", str(port), "--model",
                                      str(model_dir), "--served-model-name", "demo", *args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float = 120) -> Up:
        wait_for(lambda: "ready on" in self.output or self.proc.poll() is not None, timeout, every=0.1)
        assert "ready on" in self.output, self.output
        return self

    def ended(self, timeout: float = 60) -> subprocess.CompletedProcess:
        """Its exit status and whole output once it has ended by itself."""
        self.proc.wait(timeout)
        self.reader.join(10)  # the pipe closes once every process that held it has exited
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, self.output)


def assert_clean_stop(output: str) -> None:
    """Nothing worse than INFO from `up` or a child: no stage cut off from Redis, no response left unfinished."""
    for bad in ("WARNING", "ERROR", "Traceback", "ASGI callable returned", "Connection refused"):
        assert bad not in output, output


def test_a_second_up_leaves_the_first_alone(demo_model_dir, tmp_path):
    """One on the port of a running `up` (or of any other server) stops before it starts anything, with one
    line; one whose model does not load fails on its own port. Neither touches the first's file, control socket
    or Redis: `inspect`, `healthcheck` and `drain` next to it still find it. (The first has tenants' keys alone:
    it becomes ready all the same, and says a key is required.)"""
    port = free_port()
    keys = tmp_path / "keys.yaml"  # tenants' keys alone (no --api-key): `up` still sees its API serve
    keys.write_text("- key: sk-team-a-0123456789abcdef0123456789\n  tenant: team-a\n")
    first = Up(port, demo_model_dir, tmp_path, "--api-keys-file", str(keys)).wait_ready()
    try:
        assert "rsinfer: clients must send an API key (Authorization: Bearer <key>): one of the keys in " \
               f"{keys} (--api-keys-file)\n" in first.lines
        state = json.loads((tmp_path / f"up-{port}.json").read_text())
        socket_path = admin_socket_path("", port)
        assert state["pid"] == first.proc.pid and socket_path.exists()
        again = Up(port, demo_model_dir, tmp_path).ended()
        assert again.returncode == 1 and again.stdout == (
            f"rsinfer: another rsinfer up (pid {first.proc.pid}) serves port {port}; stop it or give another --port\n")
        elsewhere = Up(port, demo_model_dir, tmp_path / "other-cache").ended()  # the port is taken all the same
        assert elsewhere.returncode == 1 and elsewhere.stdout.startswith(
            f"rsinfer: cannot listen on 127.0.0.1:{port}: ") and len(elsewhere.stdout.splitlines()) == 1
        (tmp_path / "broken-model").mkdir()
        broken = Up(free_port(), tmp_path / "broken-model", tmp_path).ended()
        assert broken.returncode == 1 and "ready on" not in broken.stdout and "failed to start" in broken.stdout
        assert json.loads((tmp_path / f"up-{port}.json").read_text()) == state and socket_path.exists()
        assert sorted(p.name for p in tmp_path.glob("up-*.json")) == [f"up-{port}.json"]
        shown = tool(tmp_path, "inspect")
        assert shown.returncode == 0 and "SCHEDULER" in shown.stdout.splitlines(), shown
        alive = tool(tmp_path, "healthcheck", "--role", "scheduler")  # this stack's own liveness file
        assert alive.returncode == 0 and Path(state["liveness"]["scheduler"]).parent == Path(state["dir"]), alive
        drained = tool(tmp_path, "drain")
        assert drained.returncode == 0 and json.loads(drained.stdout)["draining"] is True, drained
        first.proc.send_signal(signal.SIGTERM)  # idle
        assert first.proc.wait(60) == 0
        assert_clean_stop(first.ended().stdout)
        assert list(tmp_path.glob("up-*.json")) == [] and not Path(state["dir"]).exists()
        assert not socket_path.parent.exists()
    finally:
        stop(first.proc)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_stopping_up_lets_an_open_stream_finish(demo_model_dir, tmp_path, sig):
    """Ctrl-C (SIGINT to the terminal's whole foreground group) or SIGTERM (to `up` alone) with a stream open:
    the API drains first (new requests 503) while the stages and Redis keep serving the stream to its end and
    `[DONE]`; then the rest stops, with nothing in the log worse than INFO."""
    port = free_port()
    up = Up(port, demo_model_dir, tmp_path, "--grace-period-s", "30", RSINFER_STEP_MS="20").wait_ready()
    try:
        url = f"http://127.0.0.1:{port}"
        run = Streamer(url, {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                             "ignore_eos": True, "stream_options": {"include_usage": True}})
        wait_for(lambda: len(run.reply.ids) > 5, timeout=30)
        if sig == signal.SIGINT:
            os.killpg(up.proc.pid, sig)  # what a terminal's Ctrl-C does
        else:
            up.proc.send_signal(sig)
        wait_for(lambda: httpx.get(f"{url}/ready", timeout=5).status_code == 503, timeout=10)
        refused = httpx.post(f"{url}/v1/chat/completions", timeout=5, json={
            "model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        run.join(60)
        assert run.error is None and run.reply.done and run.finish == "length", run.error
        assert run.reply.usage["completion_tokens"] == 200
        # within the bounds `up` keeps (rsinfer/up.py `stop`): the API's grace period and margin, then the stages'
        assert up.proc.wait(2 * (30 + 10)) == 0
        assert_clean_stop(up.ended().stdout)
        assert not (tmp_path / f"up-{port}.json").exists()
    finally:
        stop(up.proc)
