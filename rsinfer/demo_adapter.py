"""`rsinfer demo-adapter DIR`: a random PEFT LoRA adapter of a checkpoint (by default the demo model `rsinfer up`
serves), so that the LoRA examples of docs/user-guide.md run offline without training one. The folder is what PEFT's
`save_pretrained` writes (adapter_config.json, adapter_model.safetensors with PEFT's tensor names), written
directly, so neither peft nor a training run is needed: peft loads it as any adapter
(tests/unit/rsinfer/test_demo_adapter.py), and rsinfer serves it as any (shared/lora_folder.py). Its weights are
random: it changes the model's answers, which is all a demo adapter is for."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from shared.lora_folder import CONFIG_FILE, LORA_TARGETS, WEIGHTS_FILE

DEFAULT_TARGETS = ("q_proj", "v_proj")


def make_adapter(out_dir: str | os.PathLike, model_dir: str | os.PathLike | None = None, rank: int = 8,
                 targets: Sequence[str] = DEFAULT_TARGETS, seed: int = 0) -> Path:
    """Write a rank-`rank` adapter of `model_dir` (the demo model when None, made if missing) on `targets` of every
    layer to `out_dir`; the same arguments write the same bytes."""
    import torch
    from safetensors.torch import save_file

    from shared.demo_model import ensure_demo_model

    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if unknown or not targets or rank < 1:
        raise ValueError(f"targets must be some of {', '.join(LORA_TARGETS)} and rank at least 1 "
                         f"(got {', '.join(unknown) or 'none'}, rank {rank})")
    base = Path(model_dir) if model_dir else ensure_demo_model()
    if not (base / "config.json").is_file():
        raise ValueError(f"{base} is not a checkpoint folder (no config.json)")
    projections = _projections(base, set(targets))
    missing = set(targets) - {name.split(".")[-1] for name in projections}
    if missing:
        raise ValueError(f"{base} has no {', '.join(sorted(missing))} projections to adapt")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (fan_in, fan_out) in projections.items():
        # A x has about x's scale over the rank's directions; B a tenth of it, so the answers change, not drown
        tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
        tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.1
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base), "r": rank,
              "lora_alpha": 2 * rank, "lora_dropout": 0.0, "target_modules": sorted(targets), "bias": "none",
              "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False, "use_dora": False}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _replace(out / WEIGHTS_FILE, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    _replace(out / CONFIG_FILE, lambda tmp: tmp.write_text(json.dumps(config, indent=2) + "\n"))
    return out


def _projections(base: Path, targets: set[str]) -> dict[str, tuple[int, int]]:
    """The model's linear projections named in `targets`: module name -> (in, out) features, read from its config
    alone (the model is built on the meta device: no weight is read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: (m.in_features, m.out_features) for name, m in model.named_modules()
            if name.split(".")[-1] in targets and isinstance(m, torch.nn.Linear)}


def _replace(path: Path, write: Callable[[Path], object]) -> None:
    """Write through a temp file renamed into place: a scheduler reading the folder never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # readable by schedulers running as another user, as PEFT's files are
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
