"""Which base model and LoRA adapter a request names (`AdapterTargets.target`): its `model`, or a base model and
SGLang's `lora_path`. Admission asks it for every generating body and every tokenizer query
(services/api/answer/admission.py); the adapters themselves are loaded and unloaded through
services/api/lora_api/adapters.py.

The registry is in Redis (shared/adapter_registry.py), so every API process sees the same adapters: a request's
adapter is looked up there (one HMGET) when its `model` is not a base model, so an adapter loaded or unloaded
through another API process is seen at once."""

from __future__ import annotations

from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from services.api.errors import ApiError
from shared import adapter_registry as registry
from shared.messages import AdapterRecord

if TYPE_CHECKING:
    from services.api.answer.collaborators import ApiContext


class AdapterTargets:
    def __init__(self, ctx: ApiContext):
        self.settings, self.stages, self.redis, self.keys = ctx.settings, ctx.stages, ctx.redis, ctx.keys

    async def target(self, model: str, lora_path: str | None = None) -> tuple[str, str | None]:
        """(the base model, the adapter or None) that a request's `model` and `lora_path` (SGLang's: an adapter's
        name) name. A `model` that is neither a base model nor an adapter is left to admission (its 404)."""
        snap = self.stages.snapshot
        if model in snap.models:
            if lora_path is None:
                return model, None
            record = await self._record(lora_path, "lora_path")
            if record.base != model:
                raise ApiError(400, f"LoRA adapter `{lora_path}` adapts `{record.base}`, not `{model}`",
                               param="lora_path")
            return model, record.name
        if len(model) > self.settings.max_lora_name_chars:
            return model, None
        try:
            found = await registry.lookup(self.redis, self.keys, [model])
        except (RedisError, OSError):  # admission answers for an unreachable Redis (503)
            return model, None
        record = found.get(model)
        if record is None:
            return model, None
        if lora_path is not None and lora_path != model:
            raise ApiError(400, f"`model` names LoRA adapter `{model}` and `lora_path` names `{lora_path}`: name one",
                           param="lora_path")
        return record.base, record.name

    async def _record(self, name: str, param: str) -> AdapterRecord:
        found = await registry.lookup(self.redis, self.keys, [name]) if len(name) <= (
            self.settings.max_lora_name_chars) else {}
        if name not in found:
            raise ApiError(404, f"no LoRA adapter named `{name}`", param=param, code="model_not_found")
        return found[name]
