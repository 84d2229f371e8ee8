"""Ending asyncio tasks on every path: `stop_task` stops a background task without hanging a shutdown, and
`unless_set` ends an await (a blocked read) when an event (SIGTERM's) comes first."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


async def stop_task(task: asyncio.Future, patience_s: float = 2.0) -> None:
    """Cancel a background task and wait for it, cancelling again if it swallowed the first cancellation
    (Python 3.11's asyncio.wait_for, which redis-py's blocking pool uses, can), never hanging a shutdown."""
    for _ in range(3):
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=patience_s)
        if done:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                task.result()
            return
    log.warning("task %s did not stop", getattr(task, "get_name", lambda: task)())


async def unless_set(work: Awaitable[T], event: asyncio.Event, default: T) -> T:
    """`work`'s result, or `default` once `event` is set first (`work` is then cancelled; an exception it raised
    before that is raised here)."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            await stop_task(task)
    if not task.done() or task.cancelled():
        return default
    return task.result()
