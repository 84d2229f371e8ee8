"""The factory builds the engine the settings ask for; the simple fallback still works."""

from __future__ import annotations

import pytest
import torch

from services.scheduler.engine.base import EngineRequest, RequestRejected
from services.scheduler.engine.factory import build_engine, kv_num_pages, pick_dtype
from services.scheduler.engine.paged import PagedEngine
from services.scheduler.engine.simple import SimpleEngine
from shared.messages import SamplingParams
from shared.settings import SchedulerSettings
from tests.unit.engine.util import drain, greedy, hf_greedy, prompts, tokens


def _settings(**kw) -> SchedulerSettings:
    return SchedulerSettings(threads=1, max_kv_tokens=2048, page_size=8, **kw)


def test_paged_is_the_default_and_matches_the_reference(demo_model_dir, demo_model):
    eng = build_engine(_settings(), str(demo_model_dir))
    assert isinstance(eng, PagedEngine) and torch.get_num_threads() == 1
    stats = eng.stats()
    assert stats["kv_total_tokens"] == 2048 and stats["total_pages"] == 256
    p = prompts([11], demo_model.config.vocab_size, seed=8)[0]
    out = drain(eng, {0: [EngineRequest("a", p, greedy(12))]})
    assert tokens(out[("a", 0)]) == hf_greedy(demo_model, p, 12)


def test_simple_engine_still_works(demo_model_dir, demo_model):
    eng = build_engine(_settings(engine="simple"), str(demo_model_dir))
    assert isinstance(eng, SimpleEngine)
    p = prompts([7], demo_model.config.vocab_size, seed=9)[0]
    eng.add(EngineRequest("a", p, greedy(8)))
    ids = []
    while eng.has_work():
        ids += [t for o in eng.step() for t in o.ids]
    assert ids == hf_greedy(demo_model, p, 8)


def test_simple_engine_omitted_max_tokens_means_the_context(demo_model_dir):
    eng = build_engine(_settings(engine="simple"), str(demo_model_dir))
    assert eng.add(EngineRequest("a", [5, 6, 7], SamplingParams(temperature=0.0, ignore_eos=True))) == \
        eng.max_context - 3
    for _ in range(3):
        assert [o.finish_reason for o in eng.step()] == [None]
    assert eng.abort("a") and not eng.has_work()
    with pytest.raises(RequestRejected) as e:
        eng.add(EngineRequest("b", [5, 6, 7], SamplingParams(max_tokens=2, min_tokens=3)))
    assert e.value.param == "min_tokens"


def test_kv_sizing_and_dtype_rules():
    s = SchedulerSettings(max_kv_tokens=0, page_size=16, max_running=4)
    pages = kv_num_pages(s, bytes_per_token=2048, max_context=1000)
    assert pages == 4 * 1000 // 16 + 1  # capped at max_running full contexts, plus the scratch page
    assert kv_num_pages(_settings(), 2048, 10**6) == 2048 // 8 + 1

    class Cfg:
        dtype = torch.float32

    assert pick_dtype("auto", torch.device("cuda"), Cfg) == torch.bfloat16
    assert pick_dtype("auto", torch.device("cpu"), Cfg) == torch.float32
    assert pick_dtype("bfloat16", torch.device("cpu"), Cfg) == torch.bfloat16
