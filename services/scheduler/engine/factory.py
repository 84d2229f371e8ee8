"""Build the engine the settings ask for, with the model loaded the way any checkpoint is loaded."""

from __future__ import annotations

import logging
import os

from services.scheduler.engine.base import Engine
from shared.settings import SchedulerSettings

log = logging.getLogger(__name__)


def torch_threads(requested: int) -> int:
    """Half the cores by default: the other processes of a node need the rest (2 cores, 5 processes)."""
    return requested or max(1, (os.cpu_count() or 2) // 2)


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


def build_engine(settings: SchedulerSettings, model_path: str) -> Engine:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(torch_threads(settings.threads))
    dtype = "auto" if settings.dtype == "auto" else getattr(torch, settings.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                                 trust_remote_code=settings.trust_remote_code)
    from services.scheduler.engine.simple import SimpleEngine

    log.info("engine=simple threads=%d model=%s", torch.get_num_threads(), model_path)
    return SimpleEngine(model, eos_token_ids(model_path, model.config), settings.max_running)
