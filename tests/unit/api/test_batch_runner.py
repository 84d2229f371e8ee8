"""services/api/batch_api/batch_runner.py's wait between turns: a parked batch that is due but cannot start (the runner
or its tenant is full) waits for a run to end (or the next turn); it never makes the loop spin without yielding."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from services.api.batch_api.batch_runner import BatchRunner, Held
from shared.settings import ApiSettings


async def test_a_due_parked_batch_that_cannot_start_waits_for_a_run_to_end():
    r = BatchRunner(SimpleNamespace(s=ApiSettings(batch_claim_idle_s=30), ctx=SimpleNamespace(pod="api-0")))
    r.held["b1"] = Held("t", "k", "1-0", "b1", due=time.monotonic() - 5)  # due, but the runner is full
    waiting = asyncio.create_task(r.sleep())
    for _ in range(20):
        await asyncio.sleep(0)
    assert not waiting.done()  # it waits; the loop goes round only when something changed
    r.wake.set()  # a run ended
    await asyncio.wait_for(waiting, 5)
    assert not r.wake.is_set()
