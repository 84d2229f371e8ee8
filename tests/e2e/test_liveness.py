"""Worker probes, as the chart runs them (`rsinfer healthcheck`, a separate process): liveness says the process
lives and its loop moves, whatever Redis does, so a Redis outage restarts no worker; readiness (`--ready`) fails
while Redis is gone and passes again once it is back; a frozen worker (SIGSTOP: its loop stuck) fails liveness
within --max-stall-s, and passes again once it moves."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from rsinfer.redis_server import RedisServer
from tests.support.helpers import wait_for
from tests.support.stack import Stack, new_stack, start_pipeline

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # `make test-fast` leaves it out

ROLES = ("tokenizer", "scheduler", "detokenizer")
MAX_STALL_S = 4.0
OUTAGE_S = 2 * MAX_STALL_S  # well past --max-stall-s and the heartbeat TTL (3 s, tests/support/stack.py)


def probe(s: Stack, role: str, ready: bool = False, max_stall_s: float = MAX_STALL_S) -> int:
    cmd = [sys.executable, "-m", "rsinfer.cli", "healthcheck", "--role", role, "--max-stall-s", str(max_stall_s)]
    proc = subprocess.run(cmd + (["--ready"] if ready else []), env=s.env(RSINFER_WORKER_ID=f"{role}1"),
                          capture_output=True, text=True, timeout=60)
    return proc.returncode


def all_pass(s: Stack, ready: bool = False) -> bool:
    return all(probe(s, role, ready) == 0 for role in ROLES)


def test_liveness_survives_a_redis_outage_and_a_stuck_loop_fails_it(demo_model_dir, tmp_path_factory):
    server = RedisServer().start()
    s = new_stack(server, demo_model_dir, tmp_path_factory, "live")
    try:
        start_pipeline(s)
        assert all_pass(s) and all_pass(s, ready=True)

        server.proc.kill()  # Redis gone, abruptly
        server.proc.wait()
        t0, readiness = time.monotonic(), []
        while time.monotonic() - t0 < OUTAGE_S:
            assert all_pass(s), f"liveness failed {time.monotonic() - t0:.1f}s into a Redis outage"
            readiness.append([probe(s, role, ready=True) for role in ROLES])
        assert readiness[-1] == [1, 1, 1], readiness
        assert not [n for n, p in s.procs.items() if p.poll() is not None], "a worker exited"

        server = RedisServer(port=server.port).start()  # back, empty
        wait_for(lambda: all_pass(s, ready=True), timeout=60, every=0.5)

        frozen = ("scheduler", "detokenizer")  # the engine loop, and a FastStream-fed stage, stalled together
        for role in frozen:
            s.procs[f"{role}1"].send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: all(probe(s, r) == 1 for r in frozen), timeout=MAX_STALL_S + 20, every=0.2)
            # the stall is what fails it (not the probe or Redis): a bound it has not reached yet still passes
            assert [probe(s, r, max_stall_s=600) for r in frozen] == [0, 0]
        finally:
            for role in frozen:
                s.procs[f"{role}1"].send_signal(signal.SIGCONT)
        wait_for(lambda: all(probe(s, r) == 0 for r in frozen), timeout=30, every=0.2)
    finally:
        s.stop()
        server.stop()
