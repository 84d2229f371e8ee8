"""The scheduler's LoRA adapters from the registry (shared/adapter_registry.py): the engine's `AdapterSource`
(services/scheduler/engine/lora.py) over the registrations of this scheduler's model.

A job names its adapter by the name clients use; at admission (`resolved`, one HMGET for the read's adapter
names) the name becomes the registration's identity, `name@version`, which is what the engine loads, binds and
names its prefix-cache pages after. A registration's folder is a local path (read as it is: the engine's
`AdapterFolders`) or a prefix in the object store (fetched into the local cache: the engine's `StoredAdapters`).
Once a second (`sync`) the registry is read whole: an adapter unregistered, or registered again under another
version, is evicted from the engine (requests running with it finish; new ones get the new one or a 404).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from shared import adapter_registry as registry
from shared.consumer_group import Delivery
from shared.lora_folder import AdapterError, LoraCard, check_folder
from shared.messages import AdapterRecord, ScheduleJob
from shared.settings import SchedulerSettings

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from services.scheduler.engine.base import Engine
    from services.scheduler.engine.lora_weights import StoredAdapters
    from shared.keys import Keys

log = logging.getLogger(__name__)

SYNC_EVERY_S = 1.0
FETCH_TIMEOUT_S = 600.0


class RegisteredAdapters:
    """An AdapterSource whose names are registrations' identities (`AdapterRecord.identity`). `knows` runs on the
    step thread and `fetch` on the engine's loader thread: both read `records`, which the event loop replaces
    whole (never mutates), so they see one registry or the next."""

    def __init__(self, settings: SchedulerSettings, model: str):
        self.settings, self.model = settings, model
        self.records: dict[str, AdapterRecord] = {}  # identity -> registration, of this model
        self.paths: dict[str, str] = {}  # identity -> local folder (AdapterFolders reads it)
        self.prefixes: dict[str, str] = {}  # identity -> object store prefix (StoredAdapters reads it)
        self.redis: Redis | None = None
        self.keys: Keys | None = None
        self.engine: Engine | None = None
        self._store = None
        self._stored: StoredAdapters | None = None

    def attach(self, redis: Redis, keys: Keys, engine: Engine) -> None:
        self.redis, self.keys, self.engine = redis, keys, engine

    # -- the engine's AdapterSource ------------------------------------------------------------------------
    def knows(self, name: str) -> bool:
        return name in self.records

    def fetch(self, name: str) -> Path:
        # lora_weights imports torch: a scheduler that serves no adapter (the synthetic engine's) starts without it
        from services.scheduler.engine.lora_weights import AdapterFolders

        if name in self.paths:
            return AdapterFolders(self.paths).fetch(name)
        if self._stored is None:
            raise KeyError(name)  # never resolved here: nothing registered it for this process
        return self._stored.fetch(name)

    # -- admission and the registry ------------------------------------------------------------------------
    async def resolved(self, batch: list[Delivery[ScheduleJob]]) -> list[Delivery[ScheduleJob]]:
        """The read with each adapter name turned into its registration's identity (a name not registered for
        this model stays as it is: the engine refuses it, 404 model_not_found)."""
        names = sorted({d.msg.adapter for d in batch if d.msg.adapter})
        if not names:
            return batch
        found = await registry.lookup(self.redis, self.keys, names)  # type: ignore[arg-type]
        self._learn([r for r in found.values() if r.base == self.model], forget=False)
        out = []
        for d in batch:
            record = found.get(d.msg.adapter) if d.msg.adapter else None
            if record is not None and record.base == self.model:
                d = Delivery(d.entry_id, msgspec.structs.replace(d.msg, adapter=record.identity))
            out.append(d)
        return out

    async def sync(self) -> None:
        """The registry, read whole (at most --max-adapters): what left it is evicted from the engine."""
        current = await registry.registered(self.redis, self.keys)  # type: ignore[arg-type]
        self._learn([r for r in current.values() if r.base == self.model], forget=True)

    def _learn(self, records: list[AdapterRecord], forget: bool) -> None:
        """Take `records` in; evict what they replace (the same name, another version) and, with `forget`, what
        is not among them. Called between engine steps only."""
        names = {r.name for r in records}
        keep = {i: r for i, r in self.records.items()
                if r.name not in names and not forget} | {r.identity: r for r in records}
        for identity in set(self.records) - set(keep):
            if self.engine is not None and self.engine.evict_adapter(identity):
                log.info("LoRA adapter %s evicted: unregistered or replaced", identity)
        self.paths = {i: r.path for i, r in keep.items() if r.path}
        self.prefixes = {i: r.stored for i, r in keep.items() if r.stored}
        if self.prefixes and self._stored is None:
            from services.scheduler.engine.lora_weights import StoredAdapters

            self._stored = StoredAdapters(self.store(), asyncio.get_running_loop(), self.prefixes, FETCH_TIMEOUT_S)
        if self._stored is not None:
            self._stored.prefixes = self.prefixes
        self.records = keep

    def store(self):
        if self._store is None:
            from shared.storage import open_store

            self._store = open_store(self.settings)
        return self._store

    # -- start -------------------------------------------------------------------------------------------
    def card(self) -> dict:
        """What the model's `model_info` says of its adapters: the slots, and the projections and rank the API
        checks a folder against at load (shared/lora_folder.py `LoraCard`)."""
        lora = getattr(self.engine, "lora", None)
        if lora is None:
            return {"lora_slots": 0}
        shapes = {t: (s.in_features, s.out_features) for t, s in lora.layout.shapes.items()}
        return {"lora_slots": lora.max_loras,
                "lora": LoraCard(lora.max_rank, lora.layout.num_layers, shapes).as_json()}

    async def register_configured(self) -> None:
        """`--lora-modules` of this scheduler's model, checked against its engine and registered (an equal
        registration is kept). A bad entry is logged and left out: the scheduler serves on."""
        if not self.settings.lora_modules:
            return
        card = LoraCard.from_json(self.card().get("lora"))
        for module in registry.parse_lora_modules(self.settings.lora_modules):
            if (module.base or self.model) != self.model:
                continue
            try:
                await self._register(module, card)
            except (AdapterError, ValueError, registry.RegistryFull) as e:
                log.error("--lora-modules %s=%s left out: %s", module.name, module.path, e)

    async def _register(self, module: registry.Module, card: LoraCard | None) -> None:
        problem = registry.name_problem(module.name, self.settings.max_lora_name_chars)
        if problem:
            raise ValueError(problem)
        path, stored = registry.locate(module.path, self.settings.storage_url, self.settings.max_lora_path_chars,
                                       self.settings.lora_roots, configured=True)
        folder = Path(path) if path else await self.store().fetch_folder(stored, max_bytes=self.settings.max_file_bytes)
        rank, targets = await asyncio.to_thread(check_folder, folder, card)
        record = registry.new_record(module.name, self.model, path, stored, rank=rank, targets=targets)
        _, now = await registry.register(self.redis, self.keys, record, self.settings.max_adapters,  # type: ignore
                                         mode="config")
        log.info("LoRA adapter %r registered from --lora-modules (%s)", module.name, (now or record).identity)

    async def close(self) -> None:
        if self._store is not None:
            await self._store.close()
