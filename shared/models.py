"""Which checkpoint a stage serves and under which name."""

from __future__ import annotations

import json
import os
import sys

from shared.settings import DEMO_MODEL_NAME, StageSettings


def resolve_model(settings: StageSettings) -> tuple[str, str]:
    """(checkpoint path or hub id, served model name). No --model means the locally made demo model."""
    if not settings.model:
        from shared.demo_model import ensure_demo_model

        return str(ensure_demo_model()), settings.served_model_name or DEMO_MODEL_NAME
    path = settings.model
    # A hub id keeps its full name, as other servers do.
    name = os.path.basename(os.path.normpath(path)) if os.path.isdir(path) else path
    return path, settings.served_model_name or name


def default_max_tokens(path: str, setting: int | None) -> int | None:
    """The completion tokens of a request that sets none: the setting (0: none), else the checkpoint's
    generation_config.json `max_new_tokens` (as vLLM takes it for its default), else None (up to the context)."""
    if setting is not None:
        return setting or None
    try:
        with open(os.path.join(path, "generation_config.json")) as f:
            value = json.load(f).get("max_new_tokens")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def transformers_without_torch() -> None:
    """For a process that only tokenizes (the tokenizer and detokenizer stages): transformers then loads
    tokenizers and configs without importing torch, as its `USE_TORCH=0` did before transformers 5. Loading the
    demo tokenizer and config takes 0.7 s of CPU and 70 MB instead of 1.8 s and 266 MB. Call it before anything
    in the process imports torch or a transformers model; it changes nothing where torch is already imported."""
    if "torch" in sys.modules:
        return
    import transformers.utils
    import transformers.utils.import_utils

    def torch_unavailable() -> bool:
        return False

    # Modules transformers imports from here on bind the name from one of these two (`from .utils import ...`).
    transformers.utils.is_torch_available = torch_unavailable
    transformers.utils.import_utils.is_torch_available = torch_unavailable


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def context_length(path: str, trust_remote_code: bool = False) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    text = getattr(config, "text_config", None) or config
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def sentence_transformers_pooling(path: str) -> dict:
    """How the checkpoint's sentence-transformers config pools its embeddings, as vLLM reads it (`modules.json`,
    its Pooling module's `config.json`, a Normalize module): {"embedding_pooling": "last" | "mean",
    "embedding_normalize": bool}, or {} where it says nothing (or asks for a pooling the engine does not run)."""
    import json

    try:
        with open(os.path.join(path, "modules.json")) as f:
            modules = json.load(f)
    except (OSError, ValueError):
        return {}
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pooling = kinds.get("Pooling")
    if pooling is None:
        return {}
    try:
        with open(os.path.join(path, str(pooling.get("path", "")), "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    mode = ("last" if config.get("pooling_mode_lasttoken") else
            "mean" if config.get("pooling_mode_mean_tokens") else None)
    return {"embedding_pooling": mode, "embedding_normalize": "Normalize" in kinds} if mode else {}
