"""End-to-end fixtures: a real redis-server on a free port and real rsinfer processes (tests/support/stack.py),
started once per session or module (each process imports torch). Tests that kill or restart processes start
their own stack in their own namespace on the same redis-server."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator

import pytest

from tests.support.stack import STARTED, Stack, running_pipeline, running_up


@pytest.fixture(scope="session", autouse=True)
def no_process_outlives_the_run() -> Iterator[None]:
    """A test that takes a process out of its Stack (to stop it itself) and fails before it does leaves it
    running: at the end of the run every process group a Stack started is killed."""
    yield
    for proc in STARTED:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


@pytest.fixture(scope="session")
def stack(redis_server, demo_model_dir, tmp_path_factory) -> Iterator[Stack]:
    """`rsinfer up` on a free port against the test redis-server, for the whole session."""
    with running_up(redis_server, demo_model_dir, tmp_path_factory, "e2e") as s:
        yield s


@pytest.fixture(scope="module")
def pipeline(redis_server, demo_model_dir, tmp_path_factory) -> Iterator[Stack]:
    """Separate processes of each stage, for tests that kill, stop and restart them (module-scoped)."""
    with running_pipeline(redis_server, demo_model_dir, tmp_path_factory, "life") as s:
        yield s
