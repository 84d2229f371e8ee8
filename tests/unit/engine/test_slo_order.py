"""The paged engine admits waiting requests of one priority earliest TTFT deadline first (issue 35, item 4)."""

from __future__ import annotations

from services.scheduler.engine.base import EngineRequest
from tests.unit.engine.util import clone_model, engine, greedy, prompts


def test_waiting_requests_start_by_priority_then_deadline_then_arrival(demo_model):
    eng = engine(clone_model(demo_model), max_running=1)
    ps = prompts([6] * 5, demo_model.config.vocab_size, seed=5)
    for uid, p, priority, due in (("plain", ps[0], 0, float("inf")), ("late", ps[1], 0, 200.0),
                                  ("soon", ps[2], 0, 100.0), ("urgent-low", ps[3], 1, 1.0),
                                  ("plain2", ps[4], 0, float("inf"))):
        eng.add(EngineRequest(uid, p, greedy(1), priority=priority, ttft_due=due))
    started: list[str] = []
    while eng.has_work():
        started += [o.uid for o in eng.step() if o.start == 0 and o.ids]
    assert started == ["soon", "late", "plain", "plain2", "urgent-low"]
