"""Requests end, abort, get preempted, fork and fail without leaking a page; refusals are clear."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from services.scheduler.engine.base import EngineRequest, RequestRejected
from services.scheduler.engine.model_geometry import UnsupportedModel
from shared.messages import SamplingParams
from shared.pages import extend_digests
from tests.unit.engine.util import clone_model, drain, engine, greedy, hf_greedy, prompts, tiny_model, tokens

N = 24


@pytest.fixture(scope="module")
def engine_model(demo_model):
    return clone_model(demo_model)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_preemption_keeps_greedy_output_and_frees_pages(demo_model, engine_model, prefix_cache):
    ps = prompts([10, 14, 9, 12, 11, 13], demo_model.config.vocab_size, seed=1)
    refs = [hf_greedy(demo_model, p, N) for p in ps]
    # 6 requests need ~9 pages each at the end; 21 pages force preemptions during decode
    eng = engine(engine_model, num_pages=22, page_size=4, prefix_cache=prefix_cache)
    out = drain(eng, {0: [EngineRequest(f"r{i}", p, greedy(N)) for i, p in enumerate(ps)]})
    assert eng.stats()["preemptions"] > 0
    for i, ref in enumerate(refs):
        assert tokens(out[(f"r{i}", 0)]) == ref
    assert eng.pool.available() == eng.pool.usable
    if not prefix_cache:
        assert len(eng.pool.free) == eng.pool.usable


def test_random_mix_of_finish_abort_preempt_returns_every_page(engine_model):
    rng = random.Random(3)
    eng = engine(engine_model, num_pages=30, page_size=4, max_running=6)
    start = eng.pool.available()
    live: set[str] = set()
    for step in range(150):
        if step < 100 and rng.random() < 0.4:
            uid = f"q{step}"
            n = rng.choice([1, 1, 2])
            params = (greedy(rng.randrange(1, 20), n=n) if rng.random() < 0.5 else
                      SamplingParams(max_tokens=rng.randrange(1, 20), temperature=1.0, top_k=50, seed=step, n=n))
            eng.add(EngineRequest(uid, prompts([rng.randrange(1, 30)], 1000, seed=step)[0], params))
            live.add(uid)
        if live and rng.random() < 0.15:
            uid = rng.choice(sorted(live))
            eng.abort(uid)
            live.discard(uid)
        for o in eng.step():
            if o.finish_reason:
                live.discard(o.uid)  # n > 1: other choices may still run; abort() below is harmless
    for uid in list(live):
        eng.abort(uid)
    assert not eng.has_work()
    assert eng.pool.available() == start
    assert all(r == 0 for r in eng.pool.refs)
    assert eng.stats()["preemptions"] > 0


def test_abort_running_and_waiting(engine_model):
    eng = engine(engine_model, max_running=1)
    eng.add(EngineRequest("a", [5, 6, 7, 8, 9], greedy(50)))
    eng.add(EngineRequest("b", [5, 6, 7], greedy(50)))
    eng.step()
    eng.step()
    assert eng.stats()["running"] == 1 and eng.stats()["waiting"] == 1
    assert eng.abort("a") and eng.abort("b") and not eng.abort("zzz")
    assert not eng.has_work() and eng.pool.available() == eng.pool.usable


def test_n_choices_share_prompt_pages(demo_model, engine_model):
    p = prompts([10], demo_model.config.vocab_size, seed=2)[0]
    ref = hf_greedy(demo_model, p, N)
    eng = engine(engine_model, page_size=4, prefix_cache=False)
    eng.add(EngineRequest("n", p, greedy(N, n=3)))
    first = eng.step()
    assert sorted(o.index for o in first) == [0, 1, 2]
    parent = eng.scheduler.running[0]
    assert [eng.pool.refs[pg] for pg in parent.pages[:2]] == [3, 3]  # 2 full prompt pages, shared
    out = drain(eng)
    for i in range(3):
        assert tokens([o for o in first if o.index == i] + out[("n", i)]) == ref
    assert eng.pool.available() == eng.pool.usable


def test_seeded_n_choices_differ_and_repeat(engine_model):
    def run():
        eng = engine(engine_model)
        params = SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=3)
        out = drain(eng, {0: [EngineRequest("s", [4, 5, 6, 7, 8], params)]})
        return [tokens(out[("s", i)]) for i in range(3)]

    a, b = run(), run()
    assert a == b
    assert len({tuple(x) for x in a}) == 3


def test_resume_continues_a_request(demo_model, engine_model):
    p = prompts([9], demo_model.config.vocab_size, seed=4)[0]
    ref = hf_greedy(demo_model, p, N)
    eng = engine(engine_model)
    out = drain(eng, {0: [EngineRequest("r", p, greedy(N), output_ids=[ref[:10]])]})
    got = out[("r", 0)]
    assert got[0].start == 10 and [t for o in got for t in o.ids] == ref[10:]


def test_finish_reasons_stop_tokens_min_tokens(demo_model, engine_model):
    p = prompts([9], demo_model.config.vocab_size, seed=4)[0]
    ref = hf_greedy(demo_model, p, N)
    stop = ref[3]
    eng = engine(engine_model, eos={stop})
    params = SamplingParams(max_tokens=N, temperature=0.0)
    out = drain(eng, {0: [EngineRequest("eos", p, params),
                          EngineRequest("ids", p, SamplingParams(max_tokens=N, temperature=0.0,
                                                                   stop_token_ids=[ref[5]], ignore_eos=True)),
                          EngineRequest("len", p, greedy(4))]})
    assert tokens(out[("eos", 0)]) == ref[:4] and out[("eos", 0)][-1].finish_reason == "stop"
    assert tokens(out[("ids", 0)]) == ref[:6] and out[("ids", 0)][-1].finish_reason == "stop"
    assert tokens(out[("len", 0)]) == ref[:4] and out[("len", 0)][-1].finish_reason == "length"
    # min_tokens: the EOS cannot end the request (nor be chosen) before 6 tokens
    out = drain(eng, {0: [EngineRequest("min", p, SamplingParams(max_tokens=6, temperature=0.0, min_tokens=6))]})
    got = tokens(out[("min", 0)])
    assert stop not in got and len(got) == 6 and got[:3] == ref[:3]


def test_refusals(engine_model):
    eng = engine(engine_model, num_pages=16, page_size=4)
    ctx = eng.max_context
    with pytest.raises(RequestRejected, match="context"):
        eng.add(EngineRequest("long", [5] * 10, greedy(ctx)))
    with pytest.raises(RequestRejected, match="KV cache"):
        eng.add(EngineRequest("kv", [5] * 10, greedy(60)))
    with pytest.raises(RequestRejected, match="empty"):
        eng.add(EngineRequest("empty", [], greedy(3)))
    with pytest.raises(RequestRejected, match="token ids"):
        eng.add(EngineRequest("vocab", [10**6], greedy(3)))
    assert not eng.has_work()


def test_omitted_max_tokens_runs_to_what_the_pool_holds(demo_model, engine_model):
    """A KV pool far smaller than the context: no max_tokens means up to the context as far as the pool
    can take the request, ending with "length", not a refusal."""
    p = prompts([10], demo_model.config.vocab_size, seed=3)[0]
    eng = engine(engine_model, num_pages=16, page_size=4)  # 15 pages, 60 tokens; the context is 4096
    assert eng.max_context > 60
    unbounded = SamplingParams(temperature=0.0, ignore_eos=True)
    assert eng.add(EngineRequest("one", p, unbounded)) == 50
    out = drain(eng)[("one", 0)]
    assert tokens(out) == hf_greedy(demo_model, p, 50) and out[-1].finish_reason == "length"
    # n choices share the prompt's 2 full pages and run side by side: (2 + 13 // 2) pages each
    two = SamplingParams(temperature=0.0, ignore_eos=True, n=2)
    assert eng.add(EngineRequest("two", p, two)) == 8 * 4 - 10
    out = drain(eng)
    assert [len(tokens(out[("two", i)])) for i in range(2)] == [22, 22]
    assert eng.stats()["preemptions"] == 0 and eng.pool.available() == eng.pool.usable


def test_omitted_max_tokens_with_more_choices_than_fit_side_by_side(demo_model, engine_model):
    p = prompts([5], demo_model.config.vocab_size, seed=3)[0]
    eng = engine(engine_model, num_pages=6, page_size=4)  # 5 pages: 5 choices cannot decode at once
    assert eng.add(EngineRequest("five", p, SamplingParams(temperature=0.0, ignore_eos=True, n=5))) == 15
    out = drain(eng)
    ref = hf_greedy(demo_model, p, 15)
    for i in range(5):  # they take turns (preempted and resumed), each to the pool's length
        assert tokens(out[("five", i)]) == ref and out[("five", i)][-1].finish_reason == "length"
    assert eng.stats()["preemptions"] > 0 and eng.pool.available() == eng.pool.usable


def test_omitted_max_tokens_refusals_and_min_tokens(engine_model):
    eng = engine(engine_model, num_pages=16, page_size=4)  # 60 tokens of KV
    with pytest.raises(RequestRejected, match=r"prompt \(60 tokens\) does not fit the KV cache of 60 tokens"):
        eng.add(EngineRequest("big", [5] * 60, SamplingParams()))
    with pytest.raises(RequestRejected, match="min_tokens") as e:
        eng.add(EngineRequest("min", [5] * 10, SamplingParams(min_tokens=51)))
    assert e.value.param == "min_tokens"
    with pytest.raises(RequestRejected, match="min_tokens") as e:
        eng.add(EngineRequest("min", [5] * 10, SamplingParams(max_tokens=5, min_tokens=6)))
    assert e.value.param == "min_tokens"
    # min_tokens above what n choices hold side by side, within what one holds: they take turns
    assert eng.add(EngineRequest("turns", [5] * 10, SamplingParams(min_tokens=40, n=2))) == 40
    assert eng.add(EngineRequest("fits", [5] * 10, SamplingParams(min_tokens=50))) == 50
    eng.close()


def test_room_and_stats(engine_model):
    eng = engine(engine_model, max_running=2)
    assert eng.room() == 2
    for uid in "abc":
        eng.add(EngineRequest(uid, [5, 6, 7], greedy(30)))
    assert eng.room() == 0  # some are waiting
    eng.step()
    stats = eng.stats()
    for key in ("running", "waiting", "kv_used_tokens", "kv_total_tokens", "free_pages", "total_pages",
                "preemptions", "steps"):
        assert key in stats
    assert stats["running"] == 2 and stats["waiting"] == 1 and stats["kv_used_tokens"] > 0
    assert eng.room() == 0


def test_failed_step_fails_its_requests_and_frees_pages(engine_model, monkeypatch):
    eng = engine(engine_model)
    eng.add(EngineRequest("x", [5, 6, 7], greedy(5, n=2)))
    monkeypatch.setattr(eng.runner, "forward", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    out = eng.step()
    assert sorted(o.index for o in out) == [0, 1]
    assert all(o.finish_reason == "error" and "boom" in o.error for o in out)
    assert not eng.has_work() and eng.pool.available() == eng.pool.usable
    monkeypatch.undo()
    eng.add(EngineRequest("y", [5, 6, 7], greedy(2)))
    assert len(tokens(drain(eng)[("y", 0)])) == 2


def test_unsupported_architectures_are_refused_with_the_reason():
    sliding = tiny_model("qwen2")
    sliding.config.layer_types = ["sliding_attention"] * sliding.config.num_hidden_layers
    with pytest.raises(UnsupportedModel, match="sliding"):
        engine(sliding)
    plain = tiny_model("llama")
    plain._supports_attention_backend = False
    with pytest.raises(UnsupportedModel, match="AttentionInterface"):
        engine(plain)


def test_logits_dtype_and_device_follow_the_model(engine_model):
    eng = engine(engine_model)
    assert eng.kv.k[0].dtype == torch.float32 and eng.kv.k[0].device.type == "cpu"


def test_prefix_tree_under_pressure_keeps_no_page_behind_a_gap(engine_model):
    """Shared prefixes, n > 1, aborts and preemption in a small pool: at every step a sequence holds the
    cache's own pages for its cached prefix, and no cached page ever outlives its parent."""
    rng = random.Random(5)
    eng = engine(engine_model, num_pages=24, page_size=4, max_running=6)
    cache = eng.pool.cache
    heads = prompts([8, 12, 5], 1000, seed=21)
    sent: dict[str, list[int]] = {}
    produced: dict[tuple[str, int], list[int]] = {}
    for step in range(160):
        if step < 110 and rng.random() < 0.4:
            uid = f"q{step}"
            sent[uid] = rng.choice(heads) + prompts([rng.randrange(0, 10)], 1000, seed=step)[0]
            eng.add(EngineRequest(uid, sent[uid], greedy(rng.randrange(1, 16), n=rng.choice([1, 1, 2]))))
        if sent and rng.random() < 0.05:
            eng.abort(rng.choice(sorted(sent)))
        for o in eng.step():
            produced.setdefault((o.uid, o.index), []).extend(o.ids)
        for seq in eng.scheduler.running:
            k = seq.num_cached_pages
            assert [cache.page_of.get(d) for d in seq.digests[:k]] == seq.pages[:k]
    for uid in sent:
        eng.abort(uid)
    assert eng.stats()["preemptions"] > 0 and eng.pool.available() == eng.pool.usable
    for (uid, _), out in produced.items():
        digests: list[bytes] = []
        extend_digests(digests, sent[uid] + out, 4, 1000)
        cached = [d in cache.page_of for d in digests]
        assert cached == sorted(cached, reverse=True), f"{uid}: a page cached behind a gap {cached}"


def test_room_is_safe_to_ask_while_a_step_runs_in_its_thread(engine_model, monkeypatch):
    """The scheduler asks room() on its event loop while the step thread runs (services/scheduler/main.py
    `work`: it reads new requests during the forward). Here the step thread admits a waiting sequence exactly
    while room() is part-way through the waiting queue: iterating it there raised "deque mutated during
    iteration", which nothing caught, and the scheduler exited."""
    from concurrent.futures import Future

    from services.scheduler.engine.sequence import Seq

    eng = engine(engine_model, max_running=4)
    for uid in "abc":
        eng.add(EngineRequest(uid, [5, 6, 7], greedy(8)))
    eng.scheduler.waiting[0].compiling = Future()  # not ready (its grammar "compiles"): room() looks further
    on_loop, in_room, stepped = threading.get_ident(), threading.Event(), threading.Event()
    ready = Seq.ready.fget

    def observed_ready(seq):
        if threading.get_ident() == on_loop and not in_room.is_set():
            in_room.set()  # room() is iterating the queue: let the step thread change it now
            stepped.wait(10)
        return ready(seq)

    monkeypatch.setattr(Seq, "ready", property(observed_ready))

    def step_thread():
        in_room.wait(10)
        eng.step()  # admits "b" and "c": waiting.remove()
        stepped.set()

    thread = threading.Thread(target=step_thread)
    thread.start()
    try:
        room = eng.room()
    finally:
        in_room.set()
        thread.join(20)
    assert not thread.is_alive()
    assert room == 0  # sequences were waiting to be admitted when it was asked
    assert eng.room() == 2  # b and c run (two free slots of four); a waits for its grammar
    eng.abort("b")
    assert eng.room() == 3
    monkeypatch.undo()
    eng.close()
