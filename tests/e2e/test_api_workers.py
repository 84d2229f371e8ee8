"""`--api-workers 2` (rsinfer/api_workers.py): two API processes on one port under a supervisor. Connections
spread over both; each scrape shows the group's metrics; a stream on one outlives the other's SIGKILL, and the
dead one starts again while the port keeps serving; `rsinfer drain` drains both; SIGTERM drains both and the
group exits 0; workers that die at start make the group exit 1 (a crash loop Kubernetes sees). The group runs
beside the session's stack (tests/e2e/conftest.py `stack`), whose stages serve it: it costs two API processes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from rsinfer.launcher import serving
from rsinfer.redis_server import free_port
from services.api.edge.admin import admin_socket_path
from tests.support.helpers import wait_for
from tests.support.stack import LIFECYCLE_ENV, MODEL, Stack
from tests.support.streaming import body

pytestmark = [pytest.mark.timeout(120)]

GROUP_ENV = {**LIFECYCLE_ENV, "RSINFER_API_WORKERS": "2", "RSINFER_DRAIN_TIMEOUT_S": "3",
             "RSINFER_GRACE_PERIOD_S": "60"}


PINNED: list[httpx.Client] = []  # closed with the group


@dataclass
class Group:
    stack: Stack
    port: int
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def group(stack):
    """A group of two API processes on a port of its own, beside the session's stack (its stages serve it)."""
    port = free_port()
    proc = stack.start("api-workers", "api", RSINFER_PORT=str(port), **GROUP_ENV)
    g = Group(stack, port, proc)
    stack.wait_until(lambda: serving(g.url, MODEL, pid=proc.pid), 120, "api workers")
    yield g
    for client in PINNED:
        client.close()
    if "api-workers" in stack.procs:
        stack.stop(names=["api-workers"])


def _health(url: str) -> dict | None:
    """/health on a new connection (the kernel picks the worker), None when it does not answer in time."""
    try:
        return httpx.get(f"{url}/health", timeout=3).json()
    except httpx.HTTPError:
        return None


def pinned(url: str, worker: int) -> httpx.Client:
    """A kept-alive connection the kernel gave to `worker`."""
    def attempt() -> httpx.Client | None:
        client = httpx.Client(base_url=url, timeout=30)
        if client.get("/health").json().get("worker") == worker:
            PINNED.append(client)
            return client
        client.close()
        return None

    return wait_for(attempt, timeout=30)


def _stream(client: httpx.Client, payload: dict, on_first=lambda: None) -> dict:
    """Streams `payload` on `client`: its usage and whether [DONE] came; `on_first` runs after the first chunk."""
    usage, done, first = None, False, True
    with client.stream("POST", "/v1/chat/completions", json={**payload, "stream": True,
                                                            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                usage = json.loads(line[6:]).get("usage") or usage
                if first:
                    first = False
                    on_first()
    return {"done": done, "tokens": usage and usage["completion_tokens"]}


def _generated(client: httpx.Client) -> float:
    text = client.get("/metrics").text
    return sum(float(v) for v in re.findall(r"^rsinfer_generated_tokens_total\{[^}]*\} (\S+)$", text, re.M))


def test_connections_spread_over_both_workers_whose_metrics_every_scrape_shows(group):
    url = group.url
    seen = set()
    wait_for(lambda: seen.update({(_health(url) or {}).get("worker")}) or {0, 1} <= seen, timeout=30)
    a, b = pinned(url, 0), pinned(url, 1)
    assert a.get("/health").json()["group"] == b.get("/health").json()["group"] == group.proc.pid
    before = _generated(a)
    for client, n in ((a, 7), (b, 11)):
        assert client.post("/v1/chat/completions", json=body(1, n)).json()["usage"]["completion_tokens"] == n
    assert _generated(a) == _generated(b) == before + 18  # each process renders the group's counters
    assert "# HELP rsinfer_generated_tokens_total completion tokens" in b.get("/metrics").text


def test_a_stream_outlives_the_other_workers_death_and_the_dead_one_starts_again(group):
    url = group.url
    a, b = pinned(url, 0), pinned(url, 1)
    dead = b.get("/health").json()["pid"]
    assert _stream(a, body(2, 100), lambda: os.kill(dead, signal.SIGKILL)) == {"done": True, "tokens": 100}
    wait_for(lambda: (h := _health(url)) and h["worker"] == 1 and h["pid"] != dead, timeout=60)
    for i in range(6):  # on new connections: both workers serve
        assert httpx.post(f"{url}/v1/chat/completions", json=body(i, 3), timeout=30).status_code == 200


def test_rsinfer_drain_drains_every_worker_of_the_port(group):
    url = group.url
    a, b = pinned(url, 0), pinned(url, 1)
    hook = subprocess.run([sys.executable, "-m", "rsinfer.cli", "drain", "--wait", "0"],
                          env=group.stack.env(**GROUP_ENV, RSINFER_PORT=str(group.port)), capture_output=True,
                          text=True,
                          timeout=30)
    assert hook.returncode == 0, hook.stdout + hook.stderr
    assert [json.loads(line)["draining"] for line in hook.stdout.splitlines()] == [True, True]
    assert a.get("/ready").status_code == b.get("/ready").status_code == 503
    wait_for(lambda: a.get("/ready").status_code == b.get("/ready").status_code == 200, timeout=15)  # undone


def test_sigterm_drains_every_worker_then_the_group_exits_0(group):
    url = group.url
    clients, started = [pinned(url, 0), pinned(url, 1)], threading.Barrier(3)
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(_stream, c, body(3 + k, 100), started.wait) for k, c in enumerate(clients)]
        started.wait(timeout=30)  # both streams open
        group.proc.send_signal(signal.SIGTERM)
        assert [r.result(timeout=60) for r in runs] == [{"done": True, "tokens": 100}] * 2
    assert group.stack.procs.pop("api-workers").wait(30) == 0
    assert not list(admin_socket_path("", group.port).parent.glob("control*.sock"))


def test_workers_that_die_at_start_stop_the_group_nonzero(group, tmp_path):
    tmp_path.chmod(0o755)  # not private: the control socket is refused, each worker's start fails
    s = group.stack
    proc = s.start("api-loop", "api", RSINFER_PORT=str(free_port()), RSINFER_API_WORKERS="2",
                   RSINFER_ADMIN_SOCKET=str(tmp_path / "control.sock"))
    s.procs.pop("api-loop")
    assert proc.wait(90) == 1
    log = (s.log_dir / "api-loop.log").read_text()
    assert "deaths within 60 s: stopping the group" in log, log
    assert "api not started: " in log and "mode 0700" in log, "each worker says why it did not start"
