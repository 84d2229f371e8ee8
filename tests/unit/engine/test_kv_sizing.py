"""On a GPU the KV pool is sized after a warm-up, from the memory actually left; --max-kv-tokens overrides.

The arithmetic is a pure function; the orchestration (probe engine, warm-up, measure, real engine) runs
here on CPU against a fake device memory that hands out fixed numbers.
"""

from __future__ import annotations

import pytest

from services.scheduler.engine import factory
from services.scheduler.engine.factory import (
    PROBE_PAGES,
    MemoryProfile,
    build_paged_engine,
    kv_tokens_from_profile,
)
from services.scheduler.engine.model_geometry import attention_geometry
from services.scheduler.engine.paged import PagedEngine
from shared.settings import SchedulerSettings
from tests.unit.engine.util import clone_model

GiB, MiB = 1 << 30, 1 << 20


def test_kv_tokens_come_from_what_the_warm_up_left():
    # 10 GiB left once the probe's 2 MiB pool is freed, nothing transient: half of it at fraction 0.5
    assert kv_tokens_from_profile(MemoryProfile(10 * GiB - 2 * MiB, 2 * MiB, 0), 0.5, MiB) == 5 * 1024
    # the peak activations of the largest batch are kept free
    assert kv_tokens_from_profile(MemoryProfile(10 * GiB - 2 * MiB, 2 * MiB, 2 * GiB), 0.5, MiB) == 4 * 1024
    # a fraction close to 1 still leaves the minimum margin (1 GiB): 8 - 1 GiB, not 0.95 x 8 GiB
    assert kv_tokens_from_profile(MemoryProfile(8 * GiB, 0, 0), 0.95, MiB) == 7 * 1024
    # 114,688 bytes a token (Qwen3-0.6B, bf16) in 0.85 of 100 GiB
    assert kv_tokens_from_profile(MemoryProfile(100 * GiB, 0, 0), 0.85, 114_688) == 795_794


def test_no_memory_left_is_an_error_that_says_what_to_change():
    with pytest.raises(RuntimeError, match="max-kv-tokens"):
        kv_tokens_from_profile(MemoryProfile(GiB, 0, 512 * MiB), 0.9, MiB)


class FakeMemory:
    """Device memory that reports fixed numbers and records when the factory asked."""

    def __init__(self, events: list[str], free_after: int, transient: int):
        self.events, self.free_after, self.transient = events, free_after, transient

    def reset_peak(self) -> None:
        self.events.append("reset_peak")

    def measure(self) -> tuple[int, int]:
        self.events.append("measure")
        return self.free_after, self.transient

    def release(self) -> None:
        self.events.append("release")


@pytest.fixture
def events(monkeypatch) -> list[str]:
    """What happened, in order: the fake memory's calls and every engine's warm-up with its pool size."""
    seen: list[str] = []
    real = PagedEngine.warm_up

    def recording(self):
        seen.append(f"warm_up({self.config.num_pages} pages)")
        return real(self)

    monkeypatch.setattr(PagedEngine, "warm_up", recording)
    return seen


def test_the_pool_is_sized_after_a_probe_warm_up(demo_model, monkeypatch, events):
    monkeypatch.setattr(factory, "MIN_MARGIN_BYTES", MiB)  # CPU-sized numbers
    model = clone_model(demo_model)
    settings = SchedulerSettings(threads=1, page_size=8, max_running=4, chunk_size=32, kv_memory_fraction=0.5)
    per_token = attention_geometry(model).kv_shape(8).bytes_per_token(next(model.parameters()).dtype)
    probe_pool = PROBE_PAGES * 8 * per_token
    # 8 MiB left for KV: free after the warm-up, plus the probe's pool, minus the 2 MiB activation peak
    memory = FakeMemory(events, free_after=8 * MiB - probe_pool + 2 * MiB, transient=2 * MiB)

    eng = build_paged_engine(settings, model, eos=set(), memory=memory)

    tokens = 4 * MiB // per_token  # half of the 8 MiB
    assert eng.config.num_pages == -(-tokens // 8) + 1
    assert events == ["reset_peak", f"warm_up({PROBE_PAGES} pages)", "measure", "release",
                      f"warm_up({eng.config.num_pages} pages)"]


def test_max_kv_tokens_overrides_the_profile(demo_model, events):
    memory = FakeMemory(events, free_after=0, transient=0)  # would leave no room at all
    settings = SchedulerSettings(threads=1, page_size=8, max_kv_tokens=512)
    eng = build_paged_engine(settings, clone_model(demo_model), eos=set(), memory=memory)
    assert eng.stats()["kv_total_tokens"] == 512
    assert events == ["warm_up(65 pages)"], "no probe: the size is given"


def test_the_probe_engine_holds_the_lora_slots_when_it_is_measured(demo_model, monkeypatch, events):
    """On a GPU the LoRA slots (and their graphs and workspace) are allocated by the probe before the memory
    left for the KV cache is measured, so they come out of it."""
    monkeypatch.setattr(factory, "MIN_MARGIN_BYTES", MiB)
    held = []
    real = PagedEngine.warm_up
    monkeypatch.setattr(PagedEngine, "warm_up", lambda self: held.append(self.lora.stacks.nbytes) or real(self))
    settings = SchedulerSettings(threads=1, page_size=8, max_running=4, chunk_size=32, max_loras=2)
    memory = FakeMemory(events, free_after=8 * MiB, transient=0)
    eng = build_paged_engine(settings, clone_model(demo_model), eos=set(), memory=memory)
    assert held == [eng.lora.stacks.nbytes] * 2 and held[0] > 0
    assert events[:4] == ["reset_peak", f"warm_up({PROBE_PAGES} pages)", "measure", "release"]
