"""The warm-up runs every batch shape the engine will use and leaves the engine exactly as it was."""

from __future__ import annotations

import pytest
import torch

from services.scheduler.engine.base import EngineRequest
from services.scheduler.engine.config import EngineConfig
from services.scheduler.engine.kv_cache import SCRATCH_PAGE
from services.scheduler.engine.warm_up import WarmUpBatch, warm_up_batches
from shared.messages import SamplingParams
from tests.unit.engine.util import clone_model, drain, engine, greedy, hf_greedy, prompts, tokens


@pytest.fixture(scope="module")
def engine_model(demo_model):
    return clone_model(demo_model)


def test_warm_up_runs_the_model_and_leaves_the_engine_as_it_was(demo_model, engine_model):
    eng = engine(engine_model, num_pages=64, page_size=4, seed=5)
    calls = []
    forward = eng.runner.forward

    def counting(rows, ids, sample_idx, *device_tokens):
        calls.append([r.num_new for r in rows])
        return forward(rows, ids, sample_idx, *device_tokens)

    eng.runner.forward = counting
    stats, free, refs = eng.stats(), list(eng.pool.free), list(eng.pool.refs)
    generator = eng.sampler.generator.get_state()

    seconds = eng.warm_up()

    assert calls, "the warm-up ran no forward"
    assert any(1 in c for c in calls) and any(n > 1 for c in calls for n in c), "decode and prefill rows ran"
    assert seconds >= 0
    assert eng.stats() == stats and eng.pool.free == free and eng.pool.refs == refs
    assert torch.equal(eng.sampler.generator.get_state(), generator), "unseeded sampling stays reproducible"
    assert not eng.kv.k[0][SCRATCH_PAGE].any() and not eng.kv.v[0][SCRATCH_PAGE].any(), "scratch page cleared"
    assert not eng.has_work()

    # and it serves as an engine that never warmed up does, sampled requests included
    p = prompts([13], demo_model.config.vocab_size, seed=4)[0]
    out = drain(eng, {0: [EngineRequest("g", p, greedy(10)),
                          EngineRequest("s", p, SamplingParams(max_tokens=10, temperature=1.0))]})
    cold = engine(clone_model(demo_model), num_pages=64, page_size=4, seed=5)
    cold_out = drain(cold, {0: [EngineRequest("g", p, greedy(10)),
                                EngineRequest("s", p, SamplingParams(max_tokens=10, temperature=1.0))]})
    assert tokens(out[("g", 0)]) == hf_greedy(demo_model, p, 10)
    assert tokens(out[("s", 0)]) == tokens(cold_out[("s", 0)])
    assert eng.pool.available() == eng.pool.usable


def test_warm_up_batches_cover_every_shape_on_cuda():
    cfg = EngineConfig(num_pages=2, page_size=16, max_running=100, prefill_budget=512)
    sizes = (1, 2, 4, 8, 16, 32, 64, 96)
    batches = warm_up_batches(cfg, on_cuda=True, graph_sizes=sizes, max_context=4096)
    decode_only = sorted(b.decodes for b in batches if b.prefill == 0)
    assert decode_only == [*sizes, 100], "every graph size, and the largest batch that runs eagerly"
    assert WarmUpBatch(0, 512) in batches, "a full prefill chunk alone"
    assert WarmUpBatch(99, 512) in batches, "the largest step: the other 99 sequences decode during a chunk"

    # no graphs, one sequence at most, a context shorter than the budget, chunking off
    cfg = EngineConfig(num_pages=2, page_size=16, max_running=1, prefill_budget=512, chunked_prefill=False)
    assert warm_up_batches(cfg, True, (), max_context=300) == [WarmUpBatch(1, 0), WarmUpBatch(0, 300)]


def test_warm_up_on_cpu_is_one_small_mixed_batch():
    cfg = EngineConfig(num_pages=2, page_size=16, max_running=64, prefill_budget=512)
    assert warm_up_batches(cfg, on_cuda=False, graph_sizes=(), max_context=4096) == [WarmUpBatch(1, 17)]
