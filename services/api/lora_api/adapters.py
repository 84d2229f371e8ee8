"""LoRA adapters: vLLM's `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (routed by
services/api/edge/routes.py), the adapters' cards in `/v1/models`, `--lora-modules` at start, and the schedulers'
adapter counts on `/metrics`. Which base model and adapter a request names is the answer path's
(services/api/answer/adapter_target.py).

The registry is in Redis (shared/adapter_registry.py), so every API process and scheduler sees the same adapters: an
adapter loaded or unloaded through another API process is seen at once. A load checks the folder first
(shared/lora_folder.py: its config and its safetensors header, against the projections and the rank the model's
schedulers declared), so a bad folder is a 400 naming the field, and never reaches a scheduler. The routes are
guarded by the API key like every other (tenants and admin roles are another issue's).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict
from redis.exceptions import RedisError

from services.api.errors import ApiError
from services.api.operations.registry import Snapshot, StageRegistry
from shared import adapter_registry as registry
from shared.lora_folder import (
    CONFIG_FILE,
    LORA_TARGETS,
    MAX_CONFIG_BYTES,
    WEIGHTS_FILE,
    AdapterError,
    LoraCard,
    check_folder,
    check_target_modules,
    check_tensors,
    header_length,
    parse_config_bytes,
    parse_header,
    rank_and_scaling,
)
from shared.messages import AdapterRecord

if TYPE_CHECKING:
    from services.api.answer.collaborators import ApiContext

log = logging.getLogger(__name__)


def not_found(name: str, param: str = "model") -> ApiError:
    return ApiError(404, f"The model `{name}` does not exist.", param=param, code="model_not_found")


class LoadLoraAdapter(BaseModel):
    """vLLM's LoadLoRAAdapterRequest, plus `base_model_name` (which served model it adapts: needed only when the
    server serves several)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    base_model_name: str | None = None
    load_inplace: bool = False  # vLLM: replace a loaded adapter of that name


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names are what identify an adapter here


class Adapters:
    def __init__(self, ctx: ApiContext):
        self.ctx, self.settings = ctx, ctx.settings
        self._store = None

    # -- load and unload ----------------------------------------------------------------------------------
    def _refuse_oversized(self, **values: str | None) -> None:
        """A 400 naming the first field past its limit, before anything is looked up: names (`lora_name`,
        `base_model_name`) --max-lora-name-chars, `lora_path` --max-lora-path-chars."""
        for field, value in values.items():
            limit, flag = ((self.settings.max_lora_path_chars, "--max-lora-path-chars") if field == "lora_path"
                           else (self.settings.max_lora_name_chars, "--max-lora-name-chars"))
            if value is not None and len(value) > limit:
                raise ApiError(400, f"{field} has {len(value)} characters; at most {limit} ({flag})", param=field)

    async def load(self, body: LoadLoraAdapter, mode: str = "new") -> AdapterRecord:
        """Check and register an adapter; 400 naming the field for a bad one (404 for an unknown base model)."""
        self._refuse_oversized(lora_name=body.lora_name, base_model_name=body.base_model_name,
                               lora_path=body.lora_path)
        problem = registry.name_problem(body.lora_name, self.settings.max_lora_name_chars)
        if problem:
            raise ApiError(400, problem, param="lora_name")
        snap = self.ctx.stages.snapshot
        base = body.base_model_name or self._only_model(snap)
        if base not in snap.models:
            snap = await self.ctx.stages.refresh()
        if base not in snap.models:
            raise ApiError(404, f"no served model `{base}` for LoRA adapter `{body.lora_name}` to adapt",
                           param="base_model_name", code="model_not_found")
        if body.lora_name in snap.models:
            raise ApiError(400, f"`{body.lora_name}` is a served model's name; an adapter needs another",
                           param="lora_name")
        try:
            path, stored = registry.locate(body.lora_path, self.settings.storage_url, self.settings.max_lora_path_chars,
                                           self.settings.lora_roots, configured=mode == "config")
        except ValueError as e:
            raise ApiError(400, str(e), param="lora_path") from None
        rank, targets = await self._checked(snap.model_info(base), path, stored, body.lora_path)
        record = registry.new_record(body.lora_name, base, path, stored, rank=rank, targets=targets)
        if body.load_inplace:
            mode = "config"
        try:
            written, now = await registry.register(self.ctx.redis, self.ctx.keys, record, self.settings.max_adapters,
                                                   mode)
        except registry.RegistryFull as e:
            raise ApiError(400, str(e), param="lora_name", code="too_many_adapters") from None
        if not written and mode == "new":
            raise ApiError(400, f"The lora adapter '{body.lora_name}' has already been loaded.", param="lora_name",
                           code="adapter_exists")
        log.info("LoRA adapter %r on %s registered from %s (rank %d, %s)", record.name, base, body.lora_path, rank,
                 ", ".join(targets))
        return now or record

    async def unload(self, body: UnloadLoraAdapter) -> AdapterRecord:
        self._refuse_oversized(lora_name=body.lora_name)
        gone = await registry.unregister(self.ctx.redis, self.ctx.keys, body.lora_name)
        if gone is None:
            raise ApiError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                           code="model_not_found")
        log.info("LoRA adapter %r unregistered", body.lora_name)
        return gone

    def _only_model(self, snap: Snapshot) -> str:
        models = snap.known()
        if len(models) != 1:
            raise ApiError(400, "give `base_model_name`: this server serves " + (", ".join(models) or "no model"),
                           param="base_model_name")
        return models[0]

    async def _checked(self, info: dict, path: str, stored: str, given: str) -> tuple[int, list[str]]:
        """(rank, targets) of a folder that the model's schedulers can serve; 400 `lora_path` saying why not."""
        if info.get("lora_slots") == 0:
            raise ApiError(400, "this model's schedulers serve no LoRA adapters (their --max-loras is 0)",
                           param="lora_path", code="invalid_lora_adapter")
        card = LoraCard.from_json(info.get("lora"))
        try:
            if path:
                return await asyncio.to_thread(check_folder, Path(path), card)
            return await self._checked_stored(stored, card)
        except AdapterError as e:
            raise ApiError(400, f"LoRA adapter at {given} cannot be served: {e}", param="lora_path",
                           code="invalid_lora_adapter") from None

    async def _checked_stored(self, prefix: str, card: LoraCard | None) -> tuple[int, list[str]]:
        from shared.object_store import NotFound, StorageError

        store = self.store()
        try:
            config = parse_config_bytes(await store.get(f"{prefix}/{CONFIG_FILE}", max_bytes=MAX_CONFIG_BYTES))
            rank, _ = rank_and_scaling(config, card.max_rank if card is not None else None)
            check_target_modules(config, card.targets if card is not None else LORA_TARGETS)
            tensors = await _stored_header(store, f"{prefix}/{WEIGHTS_FILE}")
        except NotFound as e:
            raise AdapterError(f"{e.key} is missing") from None
        except StorageError as e:
            raise AdapterError(f"the object store cannot read it: {e}") from None
        return rank, check_tensors(tensors, card, rank)

    def store(self):
        if self._store is None:
            from shared.storage import open_store

            self._store = open_store(self.settings)
        return self._store

    async def register_configured(self) -> None:
        """`--lora-modules`: registered at start (an equal registration is kept). A bad entry is logged and left
        out: the API serves the rest."""
        if not self.settings.lora_modules:
            return
        for module in registry.parse_lora_modules(self.settings.lora_modules):
            try:
                await self.load(LoadLoraAdapter(lora_name=module.name, lora_path=module.path,
                                                base_model_name=module.base), mode="config")
            except ApiError as e:
                log.error("--lora-modules %s=%s left out: %s", module.name, module.path, e.message)
            except (RedisError, OSError) as e:  # the API serves without them (a scheduler may register them)
                log.error("--lora-modules %s=%s not registered: Redis unreachable (%s)", module.name, module.path, e)

    # -- /v1/models ---------------------------------------------------------------------------------------
    async def cards(self, snap: Snapshot) -> list[dict]:
        records = await registry.registered(self.ctx.redis, self.ctx.keys)
        return [self.card(snap, r) for _, r in sorted(records.items())]

    async def model_card(self, snap: Snapshot, name: str) -> dict | None:
        """`GET /v1/models/<name>`: a base model's card, or an adapter's, or None."""
        if name in snap.models:
            return snap.model_card(name)
        if len(name) > self.settings.max_lora_name_chars:
            return None
        record = (await registry.lookup(self.ctx.redis, self.ctx.keys, [name])).get(name)
        return self.card(snap, record) if record is not None else None

    @staticmethod
    def card(snap: Snapshot, record: AdapterRecord) -> dict:
        """An adapter as an OpenAI Model object (vLLM's: `root` its path, `parent` its base), with its base's
        `state`, and `resident`: how many live schedulers hold it loaded."""
        base = snap.model_card(record.base) if record.base in snap.models else {}
        resident = sum(1 for w in snap.workers if w.role == "scheduler" and w.model == record.base
                       and record.identity in w.load.get("lora_adapters", ()))
        return {"id": record.name, "object": "model", "created": int(record.created_at), "owned_by": "rsinfer",
                "root": record.path or f"store:{record.stored}", "parent": record.base,
                "max_model_len": base.get("max_model_len"), "state": base.get("state", "scaled_to_zero"),
                "workers": base.get("workers"), "rank": record.rank, "targets": record.targets,
                "resident": resident}

    async def close(self) -> None:
        if self._store is not None:
            await self._store.close()


async def _stored_header(store, key: str) -> dict[str, dict]:
    """The tensor entries of a stored safetensors file's header, read from its first bytes only."""
    reader = await store.get_stream(key)
    data = b""
    try:
        async for chunk in reader:
            data += chunk
            if len(data) >= 8 and len(data) >= 8 + header_length(data[:8]):
                break
    finally:
        await reader.aclose()
    n = header_length(data[:8])
    if len(data) < 8 + n:
        raise AdapterError(f"{WEIGHTS_FILE} is cut short (its header is incomplete)")
    return parse_header(data[8:8 + n])


class LoraCollector:
    """The schedulers' adapter counts, from their heartbeats (the engine's `stats()`): slots, resident, loading,
    loads and evictions, per scheduler."""

    def __init__(self, stages: StageRegistry):
        self.stages = stages

    def collect(self):
        labels = ["model", "worker"]
        slots = GaugeMetricFamily("rsinfer_lora_slots", "LoRA adapter slots of the scheduler (--max-loras)",
                                  labels=labels)
        resident = GaugeMetricFamily("rsinfer_lora_resident", "LoRA adapters loaded in the scheduler's slots",
                                     labels=labels)
        loading = GaugeMetricFamily("rsinfer_lora_loading", "LoRA adapters being read by the scheduler", labels=labels)
        loads = CounterMetricFamily("rsinfer_lora_loads", "LoRA adapters loaded into a slot", labels=labels)
        evictions = CounterMetricFamily("rsinfer_lora_evictions", "LoRA adapters evicted from a slot", labels=labels)
        for w in self.stages.snapshot.workers:
            if w.role != "scheduler" or "lora_slots" not in w.load:
                continue
            at = [w.model, w.id]
            slots.add_metric(at, w.load.get("lora_slots", 0))
            resident.add_metric(at, w.load.get("lora_resident", 0))
            loading.add_metric(at, w.load.get("lora_loading", 0))
            loads.add_metric(at, w.load.get("lora_loads", 0))
            evictions.add_metric(at, w.load.get("lora_evictions", 0))
        yield from (slots, resident, loading, loads, evictions)


def card_for(card: dict, admin: bool) -> dict:
    """A model's or an adapter's card as a key sees it: an admin's with the server's paths (`root`: the model's
    folder, the adapter's folder or object), anyone else's with names only (`root`: the card's own name, as
    vLLM's is for a model served by name)."""
    return card if admin else {**card, "root": card["id"]}
