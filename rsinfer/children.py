"""Child processes that never outlive the process that started them (`rsinfer up`'s workers and
redis-server): if the parent dies, even by SIGKILL, the kernel sends the child SIGTERM (Linux
PR_SET_PDEATHSIG), so nothing is left running against a Redis or a port that is gone."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from typing import Any

PR_SET_PDEATHSIG = 1


def spawn(argv: list[str], **kw: Any) -> subprocess.Popen:
    """subprocess.Popen whose child gets SIGTERM when this process dies (on Linux; elsewhere a plain Popen).
    Linux sends it when the *thread* that spawned the child ends: spawn from the main thread, never from a
    pool thread (asyncio.to_thread), or the child is terminated when that thread is retired."""
    if sys.platform.startswith("linux"):
        kw.setdefault("preexec_fn", _terminate_with(os.getpid()))
    return subprocess.Popen(argv, **kw)


def _terminate_with(parent: int):
    def preexec() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the request was in place
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec
