"""Helpers of the engine tests: tiny random checkpoints with a meaningful init, references, drivers."""

from __future__ import annotations

import torch

from services.scheduler.engine.base import EngineRequest, StepOutput
from services.scheduler.engine.config import EngineConfig
from services.scheduler.engine.paged import PagedEngine
from shared.messages import SamplingParams

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
            initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=None)


def tiny_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """A random Llama/Qwen2/Qwen3 with a large init (greedy output varies) and an untied head."""
    import transformers

    cfg_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                          "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                          "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[arch]
    extra = {"head_dim": 16} if arch == "qwen3" else {}
    config = getattr(transformers, cfg_cls)(**TINY, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    return model.eval()


def clone_model(model: torch.nn.Module) -> torch.nn.Module:
    """An independent copy (the engine re-routes its model's attention)."""
    copy = type(model)(model.config.__class__.from_dict(model.config.to_dict()))
    copy.load_state_dict(model.state_dict())
    return copy.eval()


def prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    from transformers import GenerationConfig

    # eos_token_id=[]: no stop token (None would fall back to the checkpoint's, and the demo model ends answers)
    cfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=[], pad_token_id=0)
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         generation_config=cfg)
    return out[0, len(prompt):].tolist()


def engine(model: torch.nn.Module, **kw) -> PagedEngine:
    eos = kw.pop("eos", set())
    adapters = kw.pop("adapters", None)
    cfg = dict(num_pages=256, page_size=4, max_running=16, prefill_budget=32, shuffle_pages=7, seed=0)
    cfg.update(kw)
    return PagedEngine(model, eos, EngineConfig(**cfg), adapters=adapters)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def drain(eng: PagedEngine, arrivals: dict[int, list[EngineRequest]] | None = None,
          max_steps: int = 10_000) -> dict[tuple[str, int], list[StepOutput]]:
    """Step until idle, adding arrivals[k] before step k; outputs grouped by (uid, choice)."""
    arrivals = arrivals or {}
    out: dict[tuple[str, int], list[StepOutput]] = {}
    for step in range(max_steps):
        for req in arrivals.get(step, []):
            eng.add(req)
        if not eng.has_work() and step > max(arrivals, default=-1):
            return out
        for o in eng.step():
            out.setdefault((o.uid, o.index), []).append(o)
    raise AssertionError("engine did not finish")


def tokens(outputs: list[StepOutput]) -> list[int]:
    ids: list[int] = []
    for o in outputs:
        assert o.start == len(ids), "outputs must be contiguous"
        ids.extend(o.ids)
    return ids


def make_adapter(model: torch.nn.Module, folder, seed: int, **lora) -> torch.nn.Module:
    """Write a random PEFT LoRA adapter of `model` (non-zero init: B is random too) to `folder`; return the
    adapter merged into a copy of the model (the reference: transformers on W + s B A)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(clone_model(model), LoraConfig(init_lora_weights=False, **lora))
    peft_model.save_pretrained(str(folder))
    return peft_model.merge_and_unload().eval()
