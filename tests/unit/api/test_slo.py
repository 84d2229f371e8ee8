"""SLO-aware admission's pure parts (services/api/answer/slo.py): the targets a request carries, the wait a queue
means for it, and whether it met them; no Redis."""

from __future__ import annotations

import time

import pytest

from services.api.answer.schemas.sampling_fields import SloTargets
from services.api.answer.slo import MAX_SLO_MS, Slo, expected_wait, fair_ahead, requested_slo, slo_met
from services.api.errors import ApiError
from services.api.operations.registry import Snapshot
from shared.heartbeats import WorkerInfo


def test_both_header_spellings_and_the_body_give_targets_the_body_winning():
    assert requested_slo({}) is None and requested_slo(None, None) is None
    assert requested_slo({"x-slo-ttft-ms": "1500"}) == Slo(1500, 0)
    assert requested_slo({"x-llm-d-slo-ttft-ms": "250.4", "x-llm-d-slo-tpot-ms": "40"}) == Slo(250, 40)
    assert requested_slo({"x-slo-ttft-ms": "100", "x-llm-d-slo-ttft-ms": "900"}) == Slo(100, 0)
    assert requested_slo({"x-slo-tpot-ms": "20"}) == Slo(0, 20)
    assert requested_slo({"x-slo-ttft-ms": "100"}, SloTargets(ttft_ms=700)) == Slo(700, 0)
    assert requested_slo({"x-slo-tpot-ms": "30"}, SloTargets(ttft_ms=700)) == Slo(700, 30)


@pytest.mark.parametrize("value", ["0", "-5", "abc", "", "nan", "inf", str(MAX_SLO_MS + 1)])
@pytest.mark.parametrize("header", ["x-slo-ttft-ms", "x-llm-d-slo-ttft-ms", "x-slo-tpot-ms", "x-llm-d-slo-tpot-ms"])
def test_a_bad_header_is_a_400_naming_it(header, value):
    with pytest.raises(ApiError) as e:
        requested_slo({header: value})
    assert e.value.status == 400 and e.value.param == header


def test_the_body_field_is_bounded_by_its_schema():
    for bad in ({"ttft_ms": 0}, {"ttft_ms": MAX_SLO_MS + 1}, {"tpot_ms": -1}, {"ttfb_ms": 5}):
        with pytest.raises(ValueError):
            SloTargets(**bad)


def test_with_fair_queueing_one_turn_of_each_other_tenant_is_ahead():
    counts, weights = {"a": 40, "b": 3, "c": 1}, {"a": 1, "b": 2, "c": 1}
    assert fair_ahead(counts, weights, "a") == 2 + 1  # b's turn of 2, c's 1; a's own flood is behind it
    assert fair_ahead(counts, weights, "c") == 1 + 2
    assert fair_ahead({"a": 40}, {"a": 1}, "a") == 0
    assert fair_ahead(counts, {**weights, "a": 4}, "b") == 2 + 1  # a's 4 against b's 2: two of a's per b's one


def scheduler(running: int, waiting: int = 0, max_running: int | None = 4, model: str = "m") -> WorkerInfo:
    load = {"running": running, "waiting": waiting, **({"max_running": max_running} if max_running else {})}
    return WorkerInfo(id=f"s{running}{waiting}", role="scheduler", model=model, load=load, updated_at=0.0)


def test_the_wait_is_the_slots_to_free_ahead_of_it_at_the_measured_service_time():
    snap = Snapshot(workers=[scheduler(4), scheduler(2)])  # 8 slots, 2 free
    assert expected_wait(snap, "m", ahead=1, service_s=2.0) == 0
    assert expected_wait(snap, "m", ahead=9, service_s=2.0) == pytest.approx(8 * 2.0 / 8)
    assert expected_wait(Snapshot(workers=[scheduler(4, waiting=3)]), "m", 0, 1.0) == pytest.approx(4 / 4)
    assert expected_wait(snap, "m", ahead=9, service_s=None) is None, "nothing measured yet: no refusal"
    assert expected_wait(Snapshot(workers=[scheduler(4, max_running=None)]), "m", 9, 1.0) is None
    assert expected_wait(snap, "other", 9, 1.0) is None


def test_met_means_its_first_token_and_its_pace_within_the_targets():
    now = time.monotonic()
    assert slo_met((1000, 0), now - 1.0, now - 0.5, 10)
    assert not slo_met((400, 0), now - 1.0, now - 0.5, 10)
    assert slo_met((0, 100), now - 5.0, now - 0.5, 11)  # 50 ms a token after the first
    assert not slo_met((0, 20), now - 5.0, now - 0.5, 11)
    assert not slo_met((1000, 0), now - 1.0, None, 0)
