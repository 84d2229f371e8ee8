"""`rsinfer demo-adapter DIR` (rsinfer/demo_adapter.py): a random LoRA adapter of the demo model, written without
peft, that peft loads as its own (the same merged weights as its tensors say) and that rsinfer's folder checks
take against the card the scheduler's engine declares of the model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rsinfer.cli import main
from rsinfer.demo_adapter import make_adapter
from shared.lora_folder import LoraCard, check_folder

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def base(random_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(random_model_dir), dtype=torch.float32).eval()


def card_of(model) -> LoraCard:
    """What a scheduler of this model declares (services/scheduler/registered_adapters.py `card`)."""
    from services.scheduler.engine.lora_weights import LoraLayout

    layout = LoraLayout.of(model)
    return LoraCard(16, layout.num_layers, {t: (s.in_features, s.out_features) for t, s in layout.shapes.items()})


def test_the_folder_passes_rsinfers_checks(random_model_dir, base, tmp_path):
    folder = make_adapter(tmp_path / "a", random_model_dir, rank=4, targets=["q_proj", "down_proj"], seed=3)
    assert check_folder(folder, card_of(base)) == (4, ["down_proj", "q_proj"])
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        random_model_dir)
    again = make_adapter(tmp_path / "b", random_model_dir, rank=4, targets=["q_proj", "down_proj"], seed=3)
    assert (again / "adapter_model.safetensors").read_bytes() == (folder / "adapter_model.safetensors").read_bytes()


def test_peft_loads_it_as_its_own_and_it_changes_the_answers(random_model_dir, base, tmp_path):
    from peft import PeftModel

    from tests.unit.engine.util import clone_model

    folder = make_adapter(tmp_path / "a", random_model_dir)
    merged = PeftModel.from_pretrained(clone_model(base), str(folder)).merge_and_unload().eval()
    weights = load_file(str(folder / "adapter_model.safetensors"))
    name = "model.layers.1.self_attn.v_proj"
    a, b = weights[f"base_model.model.{name}.lora_A.weight"], weights[f"base_model.model.{name}.lora_B.weight"]
    want = base.get_submodule(name).weight + 2.0 * b @ a  # lora_alpha / r = 2
    torch.testing.assert_close(merged.get_submodule(name).weight, want)
    ids = torch.tensor([[5, 80, 300, 41, 17]])
    with torch.no_grad():
        assert not torch.allclose(merged(ids).logits, base(ids).logits, atol=1e-3)


def test_the_command_writes_each_folder_and_refuses_what_the_model_lacks(random_model_dir, tmp_path, capsys):
    dirs = [str(tmp_path / "x"), str(tmp_path / "y")]
    args = ["demo-adapter", *dirs, "--model", str(random_model_dir)]
    done = subprocess.run([sys.executable, "-m", "rsinfer.cli", *args], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert done.returncode == 0 and done.stdout.split() == dirs, done.stderr
    weights = [(Path(d) / "adapter_model.safetensors").read_bytes() for d in dirs]
    assert weights[0] != weights[1]  # each folder its own adapter (seeds 0 and 1)
    # the refusals in this process (the exit status is what main returns): a process start each costs seconds
    assert main([*args, "--targets", "lm_head"]) == 2
    assert "targets must be some of q_proj" in capsys.readouterr().err
    assert main([*args[:-1], str(tmp_path / "none")]) == 2
    assert "is not a checkpoint folder" in capsys.readouterr().err
