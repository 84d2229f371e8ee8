"""shared/lora_folder.py: a PEFT folder checked without torch, from its config and its safetensors header only,
against a model's card; what it refuses names the reason."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from shared.lora_folder import (
    AdapterError,
    LoraCard,
    check_folder,
    parse_header,
    rank_and_scaling,
)

CARD = LoraCard(max_rank=16, layers=2, targets={"q_proj": (32, 64), "v_proj": (32, 16), "down_proj": (48, 32)})
GOOD = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}


def header_file(path: Path, tensors: dict[str, dict], trailing: bytes = b"") -> None:
    raw = json.dumps({"__metadata__": {"format": "pt"}, **tensors}).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + trailing)


def tensors(rank: int = 8, layers=(0, 1), targets=("q_proj", "v_proj"), dtype: str = "F32") -> dict[str, dict]:
    out = {}
    for i in layers:
        for t in targets:
            fan_in, fan_out = CARD.targets[t]
            module = f"base_model.model.model.layers.{i}.self_attn.{t}"
            out[f"{module}.lora_A.weight"] = {"dtype": dtype, "shape": [rank, fan_in], "data_offsets": [0, 0]}
            out[f"{module}.lora_B.weight"] = {"dtype": dtype, "shape": [fan_out, rank], "data_offsets": [0, 0]}
    return out


def folder(tmp_path: Path, config: dict | None = None, weights: dict | None = None) -> Path:
    (tmp_path / "adapter_config.json").write_text(json.dumps(GOOD if config is None else config))
    header_file(tmp_path / "adapter_model.safetensors", tensors() if weights is None else weights)
    return tmp_path


def test_a_good_folder_gives_its_rank_and_targets(tmp_path):
    assert check_folder(folder(tmp_path), CARD) == (8, ["q_proj", "v_proj"])
    assert check_folder(tmp_path, None) == (8, ["q_proj", "v_proj"])  # no card yet: names and dtypes


def test_the_card_round_trips_through_json():
    assert LoraCard.from_json(json.loads(json.dumps(CARD.as_json()))) == CARD
    assert LoraCard.from_json(None) is None and LoraCard.from_json({"max_rank": 1}) is None


@pytest.mark.parametrize(("config", "weights", "says"), [
    ({**GOOD, "r": 32}, None, "rank 32 exceeds --max-lora-rank 16"),
    ({**GOOD, "r": 0}, None, "r must be a positive integer"),
    ({**GOOD, "peft_type": "IA3"}, None, "only LORA adapters"),
    ({**GOOD, "use_dora": True}, None, "use_dora"),
    ({**GOOD, "bias": "all"}, None, "bias terms"),
    ({**GOOD, "lora_alpha": "big"}, None, "lora_alpha must be a number"),
    ({**GOOD, "target_modules": ["q_proj", "lm_head"]}, None, "target_modules ['lm_head']"),
    ({**GOOD, "r": 4}, None, "expected [4, 32] (rank 4)"),
    (None, tensors(dtype="I8"), "weights must be F32, F16 or BF16"),
    (None, tensors(layers=(0, 5)), "not a projection of this model"),
    (None, tensors(targets=("q_proj", "down_proj")), None),  # down_proj of layer... of self_attn: still fine
    (None, {k: v for k, v in tensors().items() if "lora_B" not in k}, "lora_A without lora_B"),
    (None, {}, "holds no LoRA weights"),
    (None, {"base_model.model.lm_head.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 0]}},
     "not a LoRA A/B weight"),
])
def test_what_cannot_be_served_is_refused_with_why(tmp_path, config, weights, says):
    path = folder(tmp_path, config, weights)
    if says is None:
        assert check_folder(path, CARD)[0] == 8
        return
    with pytest.raises(AdapterError) as err:
        check_folder(path, CARD)
    assert says in str(err.value)


def test_files_missing_or_not_what_they_say(tmp_path):
    with pytest.raises(AdapterError, match="no adapter folder"):
        check_folder(tmp_path / "nowhere", CARD)
    path = folder(tmp_path)
    (path / "adapter_config.json").write_text("{oops")
    with pytest.raises(AdapterError, match="is not JSON"):
        check_folder(path, CARD)
    (path / "adapter_config.json").write_text("[1]")
    with pytest.raises(AdapterError, match="not a JSON object"):
        check_folder(path, CARD)
    (path / "adapter_config.json").write_text(json.dumps(GOOD))
    (path / "adapter_model.safetensors").write_bytes(b"\x01\x00")
    with pytest.raises(AdapterError, match="not a safetensors file"):
        check_folder(path, CARD)
    (path / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(AdapterError, match="a header of"):
        check_folder(path, CARD)
    (path / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 100) + b"{}")
    with pytest.raises(AdapterError, match="cut short"):
        check_folder(path, CARD)
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors is missing"):
        check_folder(path, CARD)
    (path / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match=r"adapter_config\.json is missing"):
        check_folder(path, CARD)


def test_scaling_is_alpha_over_rank_or_its_root():
    assert rank_and_scaling({"r": 8, "lora_alpha": 16}, 16) == (8, 2.0)
    assert rank_and_scaling({"r": 16, "lora_alpha": 8, "use_rslora": True}, 16) == (16, 2.0)
    assert rank_and_scaling({"r": 64, "lora_alpha": 64}, None) == (64, 1.0)  # no bound given


def test_a_header_that_is_not_tensors_is_refused():
    with pytest.raises(AdapterError, match="not JSON"):
        parse_header(b"\xff")
    with pytest.raises(AdapterError, match="not an object"):
        parse_header(b"[]")
    with pytest.raises(AdapterError, match="tensor entry"):
        parse_header(b'{"a": 1}')
