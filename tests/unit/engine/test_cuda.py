"""CUDA only (skipped elsewhere): flashinfer attention against the torch backend, CUDA graphs against eager.

Run on a GPU machine with flashinfer-python 0.7.x installed (`pip install rsinfer[gpu]`); the first
run JIT-compiles flashinfer's kernels. bf16, so logits are compared with a tolerance.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from services.scheduler.engine.attention import RowSpec
from services.scheduler.engine.attention.torch_backend import TorchPagedAttention
from services.scheduler.engine.base import EngineRequest
from services.scheduler.engine.kv_cache import KVCache, PagePool, pages_for
from services.scheduler.engine.model_geometry import attention_geometry
from services.scheduler.engine.model_runner import ModelRunner
from tests.unit.engine.util import clone_model, drain, engine, greedy, prompts, tiny_model, tokens

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer"),
    pytest.mark.timeout(600),  # first use compiles kernels
]
PAGE = 16
ATOL = 5e-2  # bf16 logits at scale ~5


@pytest.fixture(scope="module")
def model():
    m = tiny_model("qwen3")
    m.config.head_dim = 64  # a head size flashinfer builds
    m = type(m)(m.config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.1)
        m.model.embed_tokens.weight.normal_(0.0, 1.0)
    return m.to("cuda", torch.bfloat16).eval()


def _runner(model, backend: str):
    from services.scheduler.engine.config import make_backend

    m = clone_model(model).to("cuda", torch.bfloat16)
    kv = KVCache(attention_geometry(m).kv_shape(PAGE), 64, torch.bfloat16, "cuda")
    be = make_backend(backend, kv, m, torch.bfloat16)
    pool = PagePool(64, shuffle_seed=1, on_alloc=kv.zero_pages if isinstance(be, TorchPagedAttention) else None)
    return ModelRunner(m, be, PAGE), pool


def _steps(runner, pool, seqs):
    """Chunked prefill (chunk 13) with one-token steps at the end, all logits returned per step."""
    pages = [pool.alloc(pages_for(len(s), PAGE)) for s in seqs]
    done, outs = [0] * len(seqs), []
    while any(d < len(s) for d, s in zip(done, seqs, strict=True)):
        rows = sorted([(min(13, len(s) - done[i]), i) for i, s in enumerate(seqs) if done[i] < len(s)],
                      key=lambda r: r[0] != 1)
        specs = [RowSpec(pages[i], done[i], n) for n, i in rows]
        ids = [t for (n, i) in rows for t in seqs[i][done[i]:done[i] + n]]
        outs.append(runner.forward(specs, ids, list(range(len(ids)))))
        for n, i in rows:
            done[i] += n
    return outs


def test_flashinfer_matches_torch_backend(model):
    seqs = prompts([40, 7, 1, 29, 64], model.config.vocab_size)
    fi = _steps(*_runner(model, "flashinfer"), seqs)
    ref = _steps(*_runner(model, "torch"), seqs)
    for a, b in zip(fi, ref, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_engine_on_cuda_with_and_without_graphs(model):
    ps = prompts([9, 33, 17], model.config.vocab_size, seed=3)
    runs = []
    for graphs in (False, True):
        eng = engine(clone_model(model).to("cuda", torch.bfloat16), page_size=PAGE, num_pages=64,
                     cuda_graphs=graphs)
        assert eng.runner.backend.name == "flashinfer"
        if graphs:
            assert eng.runner.graphs is not None
        out = drain(eng, {0: [EngineRequest(f"r{i}", p, greedy(12)) for i, p in enumerate(ps)]})
        assert eng.pool.available() == eng.pool.usable
        runs.append([tokens(out[(f"r{i}", 0)]) for i in range(len(ps))])
    for a, b in zip(*runs, strict=True):
        assert a[:6] == b[:6]  # bf16: allow late divergence between kernel choices


def test_workspace_starts_zeroed(model):
    from services.scheduler.engine.config import make_backend

    m = clone_model(model).to("cuda", torch.bfloat16)
    kv = KVCache(attention_geometry(m).kv_shape(PAGE), 4, torch.bfloat16, "cuda")
    assert not make_backend("flashinfer", kv, m, torch.bfloat16).workspace.any()


def test_factory_warms_up_captures_under_inference_mode_and_sizes_kv_from_what_is_left(model):
    from services.scheduler.engine.factory import PROBE_PAGES, build_paged_engine
    from shared.settings import SchedulerSettings

    m = clone_model(model).to("cuda", torch.bfloat16)
    settings = SchedulerSettings(page_size=PAGE, max_running=16, chunk_size=64, cuda_graphs=True,
                                 kv_memory_fraction=0.05)
    free_before, _ = torch.cuda.mem_get_info()
    eng = build_paged_engine(settings, m, eos=set())
    assert eng.runner.graphs is not None, "capture failed: see the warning"
    assert eng.runner.graphs.logits.is_inference()
    assert eng.pool.usable > PROBE_PAGES and eng.kv.nbytes <= 0.05 * free_before
    ps = prompts([9, 33], model.config.vocab_size, seed=5)
    out = drain(eng, {0: [EngineRequest(f"r{i}", p, greedy(8)) for i, p in enumerate(ps)]})
    assert all(len(tokens(out[(f"r{i}", 0)])) == 8 for i in range(len(ps)))
    assert eng.pool.available() == eng.pool.usable
