"""The sampler row by row, and seeded sampling that does not depend on batch companions."""

from __future__ import annotations

import math

import pytest
import torch

from services.scheduler.engine.base import EngineRequest
from services.scheduler.engine.sampling import Sampler, SampleRow
from shared.messages import SamplingParams
from tests.unit.engine.util import clone_model, drain, engine, prompts, tokens

EOS = 3


def _rows(params: SamplingParams, count: int = 1, tokens_: list[int] | None = None, step: int = 0):
    t = tokens_ or [0]
    return [SampleRow(params, 0, step, t, 1) for _ in range(count)]


def _logits(*values: float, rows: int = 1) -> torch.Tensor:
    return torch.tensor([list(values)] * rows)


def test_greedy_and_top_k_one():
    x = _logits(0.1, 2.0, 1.5, -1.0)
    s = Sampler({EOS}, seed=0)
    assert s(x, _rows(SamplingParams(temperature=0.0))).ids == [1]
    assert s(x, _rows(SamplingParams(temperature=5.0, top_k=1))).ids == [1]


def test_temperature_sampling_follows_softmax():
    x = _logits(0.0, 1.0, 2.0, 0.5, rows=4000)
    got = torch.tensor(Sampler(set(), seed=1)(x, _rows(SamplingParams(temperature=1.0), 4000)).ids)
    freq = torch.bincount(got, minlength=4).float() / 4000
    assert torch.allclose(freq, torch.softmax(x[0], -1), atol=0.03)


def test_top_k_top_p_min_p_filter():
    x = _logits(3.0, 2.9, 2.8, -5.0, -5.0, rows=500)
    s = Sampler(set(), seed=2)
    assert set(s(x, _rows(SamplingParams(top_k=2), 500)).ids) == {0, 1}
    # top_p: token 0 alone holds ~36%; 0.3 keeps just it, 0.5 keeps two
    assert set(s(x, _rows(SamplingParams(top_p=0.3), 500)).ids) == {0}
    assert set(s(x, _rows(SamplingParams(top_p=0.5), 500)).ids) == {0, 1}
    assert set(s(x, _rows(SamplingParams(min_p=0.5), 500)).ids) == {0, 1, 2}


def test_penalties():
    s = Sampler(set(), seed=0)
    x = _logits(2.0, 1.9, -1.0, 0.0)
    # repetition: 2.0 / 2 = 1.0 < 1.9, so the seen token 0 loses
    assert s(x, _rows(SamplingParams(temperature=0, repetition_penalty=2.0), tokens_=[0])).ids == [1]
    # frequency/presence count completion tokens only (prompt_len=1 here): token 1 seen twice
    p = SamplingParams(temperature=0, frequency_penalty=0.1, presence_penalty=0.0)
    assert s(x, [SampleRow(p, 0, 2, [1, 1, 1], 1)]).ids == [0]
    p = SamplingParams(temperature=0, presence_penalty=0.05)
    assert s(_logits(2.0, 2.04, 0, 0), [SampleRow(p, 0, 1, [0, 1], 1)]).ids == [0]


def test_min_tokens_bans_eos_and_stop_ids():
    s = Sampler({EOS}, seed=0)
    x = _logits(0, 0, 0, 9.0, 8.0, 1.0)
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4])
    assert s(x, _rows(p, step=1)).ids == [5]
    assert s(x, _rows(p, step=2)).ids == [3]


def test_logprobs_are_of_raw_logits():
    s = Sampler(set(), seed=0)
    x = _logits(1.0, 2.0, 0.5, -1.0)
    p = SamplingParams(temperature=0.7, repetition_penalty=1.5, logprobs=True, top_logprobs=2, seed=3)
    r = s(x, _rows(p, tokens_=[1]))
    ref = torch.log_softmax(x[0], -1)
    assert math.isclose(r.logprobs[0], ref[r.ids[0]].item(), rel_tol=1e-6)
    assert [t for t, _ in r.top_logprobs[0]] == [1, 0]
    assert math.isclose(r.top_logprobs[0][0][1], ref[1].item(), rel_tol=1e-6)
    assert s(x, _rows(SamplingParams())).logprobs == [None]


def test_seed_gives_the_same_tokens_whatever_the_batch():
    x = torch.randn(1, 50)
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
    alone = Sampler(set(), seed=0)(x, _rows(p)).ids
    others = [SampleRow(SamplingParams(temperature=1.0, top_k=3), 0, 0, [0], 1)] * 3
    crowd = Sampler(set(), seed=5)(torch.cat([torch.randn(3, 50), x]), [*others, *_rows(p)]).ids
    assert crowd[-1] == alone[0]


@pytest.fixture(scope="module")
def engine_model(demo_model):
    return clone_model(demo_model)


def test_seeded_requests_reproduce_across_batch_companions(demo_model, engine_model):
    vocab = demo_model.config.vocab_size
    target = EngineRequest("t", prompts([12], vocab, seed=1)[0],
                           SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=100, seed=1234,
                                          repetition_penalty=1.1, ignore_eos=True))
    alone = tokens(drain(engine(engine_model), {0: [target]})[("t", 0)])
    companions = [EngineRequest(f"c{i}", p, SamplingParams(max_tokens=15, temperature=1.2, ignore_eos=True))
                  for i, p in enumerate(prompts([5, 30, 8], vocab, seed=2))]
    crowded = drain(engine(engine_model, prefill_budget=8, seed=99),
                    {0: companions[:2], 3: [target], 6: companions[2:]})
    assert tokens(crowded[("t", 0)]) == alone
    assert len(set(alone)) > 5
