"""What a completion's first output tells besides its token: the prompt's logprobs (echo) and how much of
the prompt came from the prefix cache."""

from __future__ import annotations

import torch

from services.scheduler.engine.base import EngineRequest
from tests.unit.engine.util import clone_model, drain, engine, greedy, prompts


def test_prompt_logprobs_match_the_model_across_prefill_chunks(demo_model):
    eng = engine(clone_model(demo_model), prefill_budget=8)  # the 21-token prompt is prefilled in 3 chunks
    [prompt] = prompts([21], demo_model.config.vocab_size, seed=4)
    out = drain(eng, {0: [EngineRequest("e", prompt, greedy(2, n=2, prompt_logprobs=3))]})
    first = out[("e", 0)][0]
    with torch.inference_mode():
        ref = torch.log_softmax(demo_model(torch.tensor([prompt])).logits[0].float(), -1)
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(prompt) - 1
    for p, (lp, top) in enumerate(first.prompt_logprobs):
        assert abs(lp - ref[p, prompt[p + 1]].item()) < 1e-3
        assert [t for t, _ in top] == ref[p].topk(3).indices.tolist()
    assert out[("e", 1)][0].prompt_logprobs is None  # the scheduler copies choice 0's to the others


def test_cached_prompt_tokens_are_reported_once(demo_model):
    eng = engine(clone_model(demo_model), page_size=4)
    [prompt] = prompts([18], demo_model.config.vocab_size, seed=5)
    cold = drain(eng, {0: [EngineRequest("a", prompt, greedy(3))]})
    warm = drain(eng, {0: [EngineRequest("b", prompt, greedy(3))]})
    assert cold[("a", 0)][0].cached_tokens == 0
    assert warm[("b", 0)][0].cached_tokens == 16  # four full pages; the last token is always recomputed
    assert all(o.cached_tokens == 0 for o in warm[("b", 0)][1:])


def test_a_request_resumed_before_its_first_token_still_scores_its_prompt(demo_model):
    eng = engine(clone_model(demo_model))
    [prompt] = prompts([9], demo_model.config.vocab_size, seed=6)
    out = drain(eng, {0: [EngineRequest("r", prompt, greedy(2, n=2, prompt_logprobs=1), [[], []])]})
    assert len(out[("r", 0)][0].prompt_logprobs) == len(prompt) - 1
