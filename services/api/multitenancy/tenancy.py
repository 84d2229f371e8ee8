"""Tenants at the API (docs/operator-guide.md, "Tenants"): who a request comes from, what its key's policy lets
it do, whose requests it may see, and its quotas, shared by every API process through Redis. Every route asks one
object, `ApiContext.tenancy` (services/api/answer/collaborators.py):

- `tenant_of(request)`: the tenant services/api/edge/app.py `Guard` found for the request's key (`OPEN` without keys);
- `authorize(tenant, model, lora_path=, priority=, background=)`: a 403 naming the field the policy does not allow
  (`authorize_adapter` for the adapter a request resolved to);
- `check_owner(tenant, record, uid)`: a 404, as if it did not exist, for another tenant's request (admins see all);
- `admit(tenant, reserve=, uid=, deadline=)`: the quota's admission (services/api/multitenancy/quotas.py), a 429 with
  Retry-After and OpenAI's x-ratelimit-* headers past a limit; it returns the request's `Lease`, which the request
  holds (services/api/answer/request/single.py `hold`) and which lives as long as the request does, whoever follows it;
  a route answered within its handler (the tokenizer routes) takes `async with admitted(tenant)` instead.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import Request
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from services.api.errors import ApiError
from services.api.multitenancy.quotas import Lease, Quotas
from services.api.multitenancy.tenants import OPEN, KeyRing, Policy, Tenant
from shared.keys import Keys
from shared.messages import TokenizeJob
from shared.settings import ApiSettings

log = logging.getLogger(__name__)

NOBODY = Tenant("", Policy(models=frozenset()))  # keys configured but none presented: no model, no admin
TENANT = "rsinfer.tenant"  # scope key: the request's Tenant (services/api/edge/app.py Guard sets it)


class Tenancy:
    """The one object every route asks about tenants (module doc)."""

    def __init__(self, settings: ApiSettings, redis: Redis, keys: Keys, registry: CollectorRegistry):
        self.ring = KeyRing(settings.api_keys_file, settings.api_key, settings.api_keys_check_s)
        self.metrics_open = settings.metrics_open
        self.quotas = Quotas(redis, keys, settings, registry)

    @property
    def on(self) -> bool:
        """Keys are configured (else today's open mode: no tenants, no quotas)."""
        return self.ring.configured

    def needs_admin(self, path: str) -> bool:
        return path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter") or (
            path == "/metrics" and not self.metrics_open)

    def sees_tenant_metrics(self, request: Request) -> bool:
        """Whether `/metrics` shows the series labelled with tenants' names and usage: to admin keys only (and in
        open mode, which has no tenants); a keyless scrape of an open /metrics gets every other series."""
        return self.tenant_of(request).admin

    def tenant_of(self, request: Request) -> Tenant:
        """The request's tenant; with keys configured, a request the guard did not key (a probe) may do nothing."""
        tenant = request.scope.get(TENANT)
        if tenant is None:
            return NOBODY if self.on else OPEN
        return tenant

    @staticmethod
    def may_use(tenant: Tenant, model: str) -> bool:
        models = tenant.policy.models
        return models is None or model in models

    def authorize(self, tenant: Tenant, model: str, *, lora_path: str | None = None, priority: int | None = None,
                  background: bool | None = None) -> None:
        """A 403 naming the first field the tenant's policy does not allow. Every name the request gives must be
        in the key's `models`: `model` and SGLang's `lora_path` (an adapter's name) alike, checked before either
        is looked up, so a name outside the policy is a 403 whether or not it exists."""
        p = tenant.policy
        if not self.may_use(tenant, model):
            raise ApiError(403, f"this key may not use model `{model}`", param="model", code="model_not_allowed")
        if lora_path is not None:
            self.authorize_adapter(tenant, lora_path, "lora_path")
        if p.priority is not None and priority is not None and not p.priority[0] <= priority <= p.priority[1]:
            raise ApiError(403, f"`priority` {priority} is outside this key's range [{p.priority[0]}, "
                           f"{p.priority[1]}]", param="priority", code="priority_not_allowed")
        if background and not p.background:
            raise ApiError(403, "this key may not run requests in the background", param="background",
                           code="background_not_allowed")

    def authorize_adapter(self, tenant: Tenant, adapter: str | None, param: str = "model") -> None:
        """A 403 unless the key's `models` names the LoRA adapter a request resolved to
        (services/api/lora_api/adapters.py `target`): an adapter is allowed by its own name, never by its base
        model's."""
        if adapter is not None and not self.may_use(tenant, adapter):
            raise ApiError(403, f"this key may not use LoRA adapter `{adapter}`", param=param,
                           code="model_not_allowed")

    def named(self, name: str) -> Tenant:
        """A tenant by its name (OPEN in open mode); one whose keys were all removed may do nothing."""
        if not self.on:
            return OPEN
        return self.ring.named(name) or Tenant(name, NOBODY.policy)

    def owns(self, tenant: Tenant, record: dict) -> bool:
        return tenant.admin or record.get("tenant") == tenant.name

    def record_fields(self, tenant: Tenant) -> dict[str, str]:
        """What a request's record says of its tenant (its name, never its key)."""
        return {"tenant": tenant.name} if self.on else {}

    def stamp(self, jobs: list[TokenizeJob], tenant: Tenant) -> list[TokenizeJob]:
        """The jobs with their tenant and its weight, whose turn they take in the tokenizers' fair queueing
        (services/tokenizer/fair.py), and a priority within the key's range (`priority_of`): every job of every
        endpoint passes here (services/api/answer/admission.py `Admission.leased`), so none runs outside its key's
        range, whether its body has a `priority` or not; open mode's jobs are all of tenant ""."""
        if not self.on:
            return jobs
        return [msgspec.structs.replace(j, tenant=tenant.name, weight=tenant.policy.weight,
                                        priority=self.priority_of(tenant, j.priority)) for j in jobs]

    @staticmethod
    def priority_of(tenant: Tenant, asked: int) -> int:
        """`asked` brought within the key's `priority` range: its nearest end when outside. A priority the
        client sent outside the range is refused before (`authorize`, a 403); what reaches here outside it is a
        default (0, or --batch-priority): a key of [10, 20] runs what it sends without `priority` at 10."""
        span = tenant.policy.priority
        return asked if span is None else min(max(asked, span[0]), span[1])

    async def admit(self, tenant: Tenant, reserve: int = 0, uid: str | None = None,
                    deadline: float | None = None) -> Lease | None:
        """The lease of a request of `uid` that may use `reserve` tokens and ends by `deadline` (None in open
        mode), or a 429."""
        if not self.on:
            return None
        return await self.quotas.admit(tenant, reserve, uid, deadline)

    async def admit_action(self, tenant: Tenant, what: str) -> None:
        """A non-generating action (`what`: "store files", "run batches"): a 403 for a suspended tenant (its policy
        allows no request: max_concurrent or requests_per_minute 0, or no model), a 429 past its requests per
        minute (`Quotas.count`)."""
        if not self.on:
            return
        if self.suspended(tenant):
            raise ApiError(403, f"this key may not {what}: its policy allows no request (suspended)",
                           code="tenant_suspended")
        await self.quotas.count(tenant)

    @staticmethod
    def suspended(tenant: Tenant) -> bool:
        p = tenant.policy
        return p.max_concurrent == 0 or p.requests_per_minute == 0 or p.models == frozenset()

    @contextlib.asynccontextmanager
    async def admitted(self, tenant: Tenant, counts: Any = None) -> AsyncIterator[Lease | None]:
        """`admit` for a route answered within its handler (no stream outlives it): the lease is released when
        the block ends; `counts` (prompt_tokens, cached_tokens, completion_tokens) is what it charges."""
        lease = await self.admit(tenant)
        if lease is not None:
            lease.counts = counts
        try:
            yield lease
        finally:
            if lease is not None:
                await lease.release()

    def start(self) -> None:
        if self.on:
            self.quotas.start()

    async def close(self) -> None:
        await self.quotas.close()
