"""The end-of-sequence ids of a checkpoint: its config's and its generation config's. Both engine builders
read them (factory.py for the models it runs, synthetic.py for the ids its draws leave out), so they live apart
from either."""

from __future__ import annotations


def eos_token_ids(model_path: str, config) -> set[int]:
    from transformers import GenerationConfig

    ids: set[int] = set()
    for source in (config, _generation_config(GenerationConfig, model_path)):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(eos)
    return ids


def _generation_config(cls, path: str):
    try:
        return cls.from_pretrained(path)
    except (OSError, ValueError):
        return None
