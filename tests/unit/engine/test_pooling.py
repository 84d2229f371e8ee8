"""Prefill-only requests in the paged engine (services/scheduler/engine/pooling.py): embeddings equal the same
pooling of transformers' final hidden states, scores equal a softmax over its next-token logits, both batched
with generation, ended after their prefill with their pages released."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.scheduler.engine.base import EngineRequest, RequestRejected
from shared.messages import Pooling, SamplingParams
from tests.unit.engine.util import clone_model, drain, engine, greedy, prompts


def embed(pooling: str = "last", **kw) -> SamplingParams:
    return SamplingParams(max_tokens=1, pooling=Pooling("embed", pooling=pooling, **kw))


def score(labels: list[int], apply_softmax: bool) -> SamplingParams:
    return SamplingParams(max_tokens=1, pooling=Pooling("score", label_token_ids=labels, apply_softmax=apply_softmax))


@torch.inference_mode()
def hf_embedding(model, prompt: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0].float()
    v = hidden[-1] if pooling == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(v, dim=-1) if normalize else v


def vector(out) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(out.embedding, dtype="<f4").copy())


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_transformers_pooling_across_chunks(demo_model, pooling):
    eng = engine(clone_model(demo_model), prefill_budget=8)  # the longer prompts are prefilled in chunks
    batch = prompts([21, 5, 1, 13], demo_model.config.vocab_size, seed=11)
    out = drain(eng, {0: [EngineRequest(f"e{k}", p, embed(pooling)) for k, p in enumerate(batch)]})
    for k, prompt in enumerate(batch):
        [only] = out[(f"e{k}", 0)]
        assert only.finish_reason == "stop" and only.ids == [] and only.scores is None
        got, ref = vector(only), hf_embedding(demo_model, prompt, pooling)
        assert got.shape == (demo_model.config.hidden_size,)
        assert torch.nn.functional.cosine_similarity(got, ref, dim=0) >= 0.9999
        assert torch.allclose(got, ref, atol=1e-4)
        assert abs(got.norm().item() - 1.0) < 1e-5
    assert eng.pool.used() == 0 and not eng.has_work()  # every page back (the cached ones are evictable)


def test_unnormalized_embedding_and_prefix_cache_for_last_pooling(demo_model):
    eng = engine(clone_model(demo_model), page_size=4)
    [prompt] = prompts([18], demo_model.config.vocab_size, seed=12)
    cold = drain(eng, {0: [EngineRequest("a", prompt, embed(normalize=False))]})[("a", 0)][0]
    warm = drain(eng, {0: [EngineRequest("b", prompt, embed(normalize=False))]})[("b", 0)][0]
    assert cold.cached_tokens == 0 and warm.cached_tokens == 16  # the last token is always computed
    ref = hf_embedding(demo_model, prompt, "last", normalize=False)
    assert torch.allclose(vector(cold), ref, atol=1e-4) and torch.allclose(vector(warm), ref, atol=1e-4)
    mean = drain(eng, {0: [EngineRequest("c", prompt, embed("mean"))]})[("c", 0)][0]
    assert mean.cached_tokens == 0  # mean pooling needs every token's hidden state: computed whole
    assert torch.allclose(vector(mean), hf_embedding(demo_model, prompt, "mean"), atol=1e-4)


@pytest.mark.parametrize("overlap", [False, True])  # True: the step launched before the last one is read (CUDA)
def test_embeddings_and_scores_batch_with_a_generation(demo_model, overlap):
    vocab = demo_model.config.vocab_size
    gen_prompt, *others = prompts([7, 9, 30, 6], vocab, seed=13)
    alone = drain(engine(clone_model(demo_model)), {0: [EngineRequest("g", gen_prompt, greedy(12))]})
    eng = engine(clone_model(demo_model), prefill_budget=16, overlap=overlap)
    arrivals = {0: [EngineRequest("g", gen_prompt, greedy(12))],
                2: [EngineRequest("e", others[0], embed()), EngineRequest("m", others[1], embed("mean"))],
                4: [EngineRequest("s", others[2], score([3, 4, 5], True))]}
    steps_before = eng.steps
    out = drain(eng, arrivals)
    assert [t for o in out[("g", 0)] for t in o.ids] == [t for o in alone[("g", 0)] for t in o.ids]
    assert eng.steps - steps_before <= 14  # no step of their own: they ran in the generation's steps
    assert torch.allclose(vector(out[("e", 0)][0]), hf_embedding(demo_model, others[0], "last"), atol=1e-4)
    assert torch.allclose(vector(out[("m", 0)][0]), hf_embedding(demo_model, others[1], "mean"), atol=1e-4)
    assert len(out[("s", 0)]) == 1 and len(out[("s", 0)][0].scores) == 3
    assert eng.pool.used() == 0


@pytest.mark.parametrize("apply_softmax", [True, False])
def test_scores_equal_a_softmax_over_transformers_next_token_logits(demo_model, apply_softmax):
    eng = engine(clone_model(demo_model), prefill_budget=8)
    vocab = demo_model.config.vocab_size
    batch = prompts([17, 3], vocab, seed=14)
    labels = [5, 77, vocab - 1]
    out = drain(eng, {0: [EngineRequest(f"s{k}", p, score(labels, apply_softmax)) for k, p in enumerate(batch)]})
    for k, prompt in enumerate(batch):
        [only] = out[(f"s{k}", 0)]
        assert only.finish_reason == "stop" and only.embedding is None
        with torch.inference_mode():
            logits = demo_model(torch.tensor([prompt])).logits[0, -1].float()
        ref = torch.softmax(logits[labels], -1) if apply_softmax else torch.softmax(logits, -1)[labels]
        assert max(abs(a - b) for a, b in zip(only.scores, ref.tolist(), strict=True)) < 1e-5
        if apply_softmax:
            assert abs(sum(only.scores) - 1.0) < 1e-6


def test_refusals_name_the_field(demo_model):
    eng = engine(clone_model(demo_model))
    vocab = demo_model.config.vocab_size
    cases = [(score([1, vocab], False), "label_token_ids", f"Token ID {vocab}"),
             (score([], False), "label_token_ids", "at least one"),
             (embed(dimensions=32), "dimensions", "does not support truncating"),
             (SamplingParams(max_tokens=1, n=2, pooling=Pooling("embed")), "n", "one choice")]
    for params, param, words in cases:
        with pytest.raises(RequestRejected) as e:
            eng.add(EngineRequest("x", [1, 2, 3], params))
        assert e.value.param == param and words in str(e.value)
    # its own size is no truncation
    out = drain(eng, {0: [EngineRequest("d", [1, 2, 3], embed(dimensions=demo_model.config.hidden_size))]})
    assert len(vector(out[("d", 0)][0])) == demo_model.config.hidden_size


def test_matryoshka_dimensions_truncate_then_normalize(demo_model):
    model = clone_model(demo_model)
    model.config.matryoshka_dimensions = [32, 64]
    eng = engine(model)
    [prompt] = prompts([9], demo_model.config.vocab_size, seed=15)
    out = drain(eng, {0: [EngineRequest("t", prompt, embed(dimensions=32))]})
    hidden = hf_embedding(demo_model, prompt, "last", normalize=False)
    assert torch.allclose(vector(out[("t", 0)][0]), torch.nn.functional.normalize(hidden[:32], dim=0), atol=1e-4)
    with pytest.raises(RequestRejected, match="not one this model allows"):
        eng.add(EngineRequest("u", prompt, embed(dimensions=48)))


def test_an_aborted_embedding_releases_its_pages(demo_model):
    eng = engine(clone_model(demo_model), prefill_budget=8)
    [prompt] = prompts([40], demo_model.config.vocab_size, seed=16)
    eng.add(EngineRequest("a", prompt, embed("mean")))
    eng.step()  # part-way through its prompt
    assert eng.pool.used() > 0
    assert eng.abort("a")
    assert eng.pool.used() == 0 and not eng.has_work()


def test_a_preempted_mean_pooled_prefill_sums_each_position_once(demo_model):
    eng = engine(clone_model(demo_model), prefill_budget=8)
    [prompt] = prompts([30], demo_model.config.vocab_size, seed=17)
    eng.add(EngineRequest("p", prompt, embed("mean")))
    eng.step()
    eng.step()  # 16 of its 30 positions summed
    [seq] = eng.scheduler.running
    assert seq.pooled_upto == 16
    eng.scheduler._preempt(seq)  # as when a decode needs its pages: recomputed from the start
    out = drain(eng)
    assert torch.allclose(vector(out[("p", 0)][0]), hf_embedding(demo_model, prompt, "mean"), atol=1e-4)
