"""What a PEFT LoRA folder must be for rsinfer to serve it, checked without torch: its adapter_config.json and
the header of its adapter_model.safetensors (tensor names, shapes and dtypes; no weight is read).

The engine (services/scheduler/engine/lora.py) reads a folder with these checks before it reads the weights; the
API (services/api/lora_api/adapters.py) runs them when an adapter is loaded (`POST /v1/load_lora_adapter`), against what
the model's schedulers declared of the projections adapters may target (`LoraCard`, in their `model_info`), so that a
bad folder is a 400 naming the field at load, not a failure of the requests that name it.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 16 << 20  # a safetensors header of a LoRA adapter is kilobytes; safetensors itself allows 100 MB
WEIGHT_DTYPES = ("F32", "F16", "BF16")
TENSOR_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
# adapter_config.json features that change the math beyond W + s B A; a folder with any of them set is refused
UNSUPPORTED = ("use_dora", "lora_bias", "fan_in_fan_out", "modules_to_save", "rank_pattern", "alpha_pattern",
               "layer_replication", "target_parameters", "trainable_token_indices", "alora_invocation_tokens",
               "use_qalora", "use_bdlora", "arrow_config")


class AdapterError(ValueError):
    """An adapter folder that cannot be served; the message says why (it is what the client reads)."""


@dataclass(frozen=True)
class LoraCard:
    """What a model's schedulers declare of its LoRA support (their `model_info["lora"]`): the projections adapters
    may target with their (in, out) features, the layers, and the largest rank (--max-lora-rank)."""

    max_rank: int
    layers: int
    targets: Mapping[str, tuple[int, int]]

    def as_json(self) -> dict:
        return {"max_rank": self.max_rank, "layers": self.layers,
                "targets": {t: list(shape) for t, shape in self.targets.items()}}

    @classmethod
    def from_json(cls, data: object) -> LoraCard | None:
        if not isinstance(data, dict):
            return None
        try:
            targets = {str(t): (int(s[0]), int(s[1])) for t, s in data["targets"].items()}
            return cls(int(data["max_rank"]), int(data["layers"]), targets)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError):
            return None


def parse_config_bytes(raw: bytes) -> dict:
    if len(raw) > MAX_CONFIG_BYTES:
        raise AdapterError(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise AdapterError(f"{CONFIG_FILE} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} is not a JSON object")
    return config


def config_json(folder: Path) -> dict:
    """adapter_config.json of a local folder, parsed (AdapterError if missing, too large or not a JSON object)."""
    path = folder / CONFIG_FILE
    if not folder.is_dir():
        raise AdapterError(f"no adapter folder at {folder}")
    if not path.is_file():
        raise AdapterError(f"{CONFIG_FILE} is missing")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        return parse_config_bytes(path.read_bytes())
    except OSError as e:
        raise AdapterError(f"{CONFIG_FILE} cannot be read: {e}") from None


def rank_and_scaling(config: dict, max_rank: int | None) -> tuple[int, float]:
    """The rank and scaling (lora_alpha / r, or / sqrt(r) with rsLoRA) of a config the engine serves."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type is {config.get('peft_type')!r}; only LORA adapters are served")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"r must be a positive integer, got {rank!r}")
    if max_rank is not None and rank > max_rank:
        raise AdapterError(f"rank {rank} exceeds --max-lora-rank {max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"lora_alpha must be a number, got {alpha!r}")
    on = [k for k in UNSUPPORTED if config.get(k)]
    if on:
        raise AdapterError(f"uses {', '.join(on)}, which the engine does not serve")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"bias={config.get('bias')!r}: adapters with bias terms are not served")
    return rank, float(alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank)


def check_target_modules(config: dict, targets: Mapping[str, object] | tuple[str, ...]) -> None:
    """`target_modules`, when a list, names only projections in `targets`."""
    wanted = config.get("target_modules")
    if isinstance(wanted, list):
        other = [t for t in wanted if not isinstance(t, str) or t.split(".")[-1] not in targets]
        if other:
            raise AdapterError(f"target_modules {other} are not projections this model lets adapters target "
                               f"({', '.join(targets)})")


def header_length(first8: bytes) -> int:
    if len(first8) < 8:
        raise AdapterError(f"{WEIGHTS_FILE} is not a safetensors file (shorter than its header)")
    (n,) = struct.unpack("<Q", first8[:8])
    if n < 2 or n > MAX_HEADER_BYTES:
        raise AdapterError(f"{WEIGHTS_FILE} is not a safetensors file (a header of {n} bytes)")
    return n


def parse_header(raw: bytes) -> dict[str, dict]:
    """The tensors a safetensors header describes: name -> {"dtype", "shape", ...} ("__metadata__" left out)."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise AdapterError(f"{WEIGHTS_FILE} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{WEIGHTS_FILE} is not a safetensors file (its header is not an object)")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if any(not isinstance(v, dict) for v in tensors.values()):
        raise AdapterError(f"{WEIGHTS_FILE} is not a safetensors file (a tensor entry is not an object)")
    return tensors


def read_header(path: Path) -> dict[str, dict]:
    """The tensor entries of a local safetensors file's header (its weights are not read)."""
    if not path.is_file():
        raise AdapterError(f"{WEIGHTS_FILE} is missing (only safetensors weights are served)")
    try:
        with path.open("rb") as f:
            n = header_length(f.read(8))
            raw = f.read(n)
    except OSError as e:
        raise AdapterError(f"{WEIGHTS_FILE} cannot be read: {e}") from None
    if len(raw) < n:
        raise AdapterError(f"{WEIGHTS_FILE} is cut short (its header is incomplete)")
    return parse_header(raw)


def check_tensors(tensors: Mapping[str, dict], card: LoraCard | None, rank: int) -> list[str]:
    """Every tensor is a LoRA A or B weight of a projection the card lets adapters target, of the right shape and
    dtype, each A with its B; returns the projections targeted, sorted. Without a card (no scheduler of the model
    declared one yet), names and dtypes only."""
    pairs: dict[tuple[str, int], set[str]] = {}
    for key, entry in tensors.items():
        target, layer, ab = _tensor_place(key, card)
        if entry.get("dtype") not in WEIGHT_DTYPES:
            raise AdapterError(f"tensor {key!r} is {entry.get('dtype')}; weights must be F32, F16 or BF16")
        if card is not None:
            fan_in, fan_out = card.targets[target]
            want = [rank, fan_in] if ab == "A" else [fan_out, rank]
            if list(entry.get("shape") or []) != want:
                raise AdapterError(f"tensor {key!r} has shape {entry.get('shape')}, expected {want} (rank {rank})")
        pairs.setdefault((target, layer), set()).add(ab)
    if not pairs:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
    half = [f"{t} of layer {i}" for (t, i), ab in pairs.items() if len(ab) != 2]
    if half:
        raise AdapterError(f"lora_A without lora_B (or the reverse) for {', '.join(half[:4])}")
    return sorted({t for t, _ in pairs})


def _tensor_place(key: str, card: LoraCard | None) -> tuple[str, int, str]:
    """(projection, layer, "A" or "B") of a tensor's key."""
    m = TENSOR_KEY.match(key)
    if m is None:
        raise AdapterError(f"tensor {key!r} is not a LoRA A/B weight of a projection (embeddings, heads and "
                           "biases are not served)")
    parts = m["module"].split(".")
    layer = next((int(p) for p in parts if p.isdigit()), None)
    allowed = card.targets if card is not None else LORA_TARGETS
    if parts[-1] not in allowed or layer is None or (card is not None and layer >= card.layers):
        raise AdapterError(f"tensor {key!r} targets {m['module']}, which is not a projection of this model "
                           f"adapters may target ({', '.join(allowed)})")
    return parts[-1], layer, m["ab"]


def check_folder(folder: Path, card: LoraCard | None, max_rank: int | None = None) -> tuple[int, list[str]]:
    """A local PEFT folder checked against a model's card: (its rank, the projections it targets)."""
    config = config_json(folder)
    rank, _ = rank_and_scaling(config, card.max_rank if card is not None else max_rank)
    check_target_modules(config, card.targets if card is not None else LORA_TARGETS)
    return rank, check_tensors(read_header(folder / WEIGHTS_FILE), card, rank)
