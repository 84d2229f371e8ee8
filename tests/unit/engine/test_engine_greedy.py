"""Greedy output of the paged engine is token-identical to transformers' `generate` (fp32)."""

from __future__ import annotations

import pytest

from services.scheduler.engine.base import EngineRequest
from shared.pages import extend_digests
from tests.unit.engine.util import clone_model, drain, engine, greedy, hf_greedy, prompts, tokens

LENGTHS = [5, 17, 33, 8, 50, 3, 12]
N = 24


@pytest.fixture(scope="module")
def reference(demo_model):
    ps = prompts(LENGTHS, demo_model.config.vocab_size)
    refs = [hf_greedy(demo_model, p, N) for p in ps]
    for r in refs:  # a random model with a weak init repeats one token: equality would prove nothing
        assert len(set(r)) > N // 3, f"reference output is not varied: {r}"
    return ps, refs


@pytest.fixture(scope="module")
def engine_model(demo_model):
    return clone_model(demo_model)


def _check(eng, ps, refs, arrivals):
    out = drain(eng, arrivals)
    for i, ref in enumerate(refs):
        got = out[(f"r{i}", 0)]
        assert tokens(got) == ref, f"request {i} (prompt {len(ps[i])} tokens) diverged"
        assert got[-1].finish_reason == "length"
    assert eng.pool.available() == eng.pool.usable


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prompts"])
def test_all_at_once(reference, engine_model, chunked):
    ps, refs = reference
    eng = engine(engine_model, chunked_prefill=chunked, prefill_budget=16)
    _check(eng, ps, refs, {0: [EngineRequest(f"r{i}", p, greedy(N)) for i, p in enumerate(ps)]})


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prompts"])
def test_requests_join_a_running_batch(reference, engine_model, chunked):
    ps, refs = reference
    eng = engine(engine_model, chunked_prefill=chunked, prefill_budget=16, page_size=3)
    arrivals = {3 * i: [EngineRequest(f"r{i}", p, greedy(N))] for i, p in enumerate(ps)}
    _check(eng, ps, refs, arrivals)


def test_prefix_cache_hit(demo_model, engine_model):
    """Requests sharing a 'system prompt' reuse its pages and still match the reference."""
    vocab = demo_model.config.vocab_size
    system = prompts([21], vocab, seed=5)[0]
    ps = [system + tail for tail in prompts([4, 9, 1], vocab, seed=6)]
    refs = [hf_greedy(demo_model, p, N) for p in ps]
    eng = engine(engine_model, page_size=4)
    arrivals = {0: [EngineRequest("r0", ps[0], greedy(N))],
                5: [EngineRequest("r1", ps[1], greedy(N)), EngineRequest("r2", ps[2], greedy(N))]}
    _check(eng, ps, refs, arrivals)
    assert eng.stats()["prefix_hit_tokens"] >= 2 * 20  # 5 full pages of the system prompt, twice


def test_identical_prompt_recomputes_only_its_last_token_page(demo_model, engine_model):
    p = prompts([16], demo_model.config.vocab_size, seed=9)[0]
    ref = hf_greedy(demo_model, p, N)
    eng = engine(engine_model, page_size=4)
    _check(eng, [p], [ref], {0: [EngineRequest("r0", p, greedy(N))]})
    _check(eng, [p], [ref], {0: [EngineRequest("r0", p, greedy(N))]})
    assert eng.stats()["prefix_hit_tokens"] == 12  # 3 of 4 pages: the last token must run


def test_other_architectures(arch_model):
    model = clone_model(arch_model)
    ps = prompts([7, 19, 2, 30], arch_model.config.vocab_size, seed=4)
    refs = [hf_greedy(arch_model, p, 16) for p in ps]
    assert all(len(set(r)) > 4 for r in refs)
    eng = engine(model, prefill_budget=8, page_size=4)
    arrivals = {2 * i: [EngineRequest(f"r{i}", p, greedy(16))] for i, p in enumerate(ps)}
    _check(eng, ps, refs, arrivals)


def test_same_prefix_computed_twice_at_once_converges_on_one_chain(demo_model, engine_model):
    """Two requests that miss the cache on the same prefix in one step compute it twice; the second
    switches to the first's pages, so every cached page's prefix stays cached while it is in use
    and eviction (tail first) never leaves a page cached behind a gap."""
    vocab = demo_model.config.vocab_size
    shared = prompts([8], vocab, seed=11)[0]  # 2 full pages
    pa, pb = (shared + tail for tail in prompts([5, 6], vocab, seed=12))
    pc = prompts([20], vocab, seed=13)[0]
    refs = {"a": hf_greedy(demo_model, pa, 3), "b": hf_greedy(demo_model, pb, N), "c": hf_greedy(demo_model, pc, 16)}
    eng = engine(engine_model, page_size=4, num_pages=16)  # 15 pages: 18 full pages in all
    cache = eng.pool.cache
    eng.add(EngineRequest("a", pa, greedy(3)))
    eng.add(EngineRequest("b", pb, greedy(N)))
    out: dict[str, list] = {}
    for step in range(200):
        if step == 6:
            eng.add(EngineRequest("c", pc, greedy(16)))  # after "a" ended: evicts its idle pages
        if not eng.has_work():
            break
        for o in eng.step():
            out.setdefault(o.uid, []).append(o)
        for seq in eng.scheduler.running:
            held = [cache.page_of.get(d) for d in seq.digests[:seq.num_cached_pages]]
            assert held == seq.pages[:seq.num_cached_pages], "a sequence holds pages the cache names otherwise"
    assert {uid: tokens(o) for uid, o in out.items()} == refs
    assert eng.pool.available() == eng.pool.usable
    for p, uid in ((pa, "a"), (pb, "b"), (pc, "c")):
        digests: list[bytes] = []
        extend_digests(digests, p + refs[uid], 4, 100)
        cached = [d in cache.page_of for d in digests]
        assert cached == sorted(cached, reverse=True), f"{uid}: a page cached behind a gap {cached}"
        if uid == "a":  # its own page was idle longest; the shared ones stayed (held by "b")
            assert cached[:3] == [True, True, False]
