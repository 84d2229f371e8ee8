"""Engine tests run on CPU in fp32 with tiny random models, one torch thread (2-core machines)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.engine.util import tiny_model


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def demo_model(random_model_dir):
    """The demo checkpoint's random-weight twin (Qwen3, ~1M parameters, the demo's vocabulary), fp32: engine tests
    compare greedy tokens with transformers' on random token ids, which only random weights keep varied."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session", params=["qwen3", "llama", "qwen2"])
def arch_model(request):
    return tiny_model(request.param)
