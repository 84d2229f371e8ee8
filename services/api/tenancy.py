"""Tenants at the API (README, "Tenants"): who a request comes from, what its key's policy lets it do, whose
requests it may see, and its quotas, shared by every API process through Redis. Every route asks one object,
`ApiService.tenancy`:

- `tenant_of(request)`: the tenant services/api/app.py `Guard` found for the request's key (`OPEN` without keys);
- `authorize(tenant, model, lora_path=, priority=, background=)`: a 403 naming the field the policy does not allow
  (`authorize_adapter` for the adapter a request resolved to);
- `check_owner(tenant, record, uid)`: a 404, as if it did not exist, for another tenant's request (admins see all);
- `admit(tenant)`: the quota's admission, one script in Redis (`ADMIT`), a 429 with Retry-After and OpenAI's
  x-ratelimit-* headers past a limit; it returns the request's `Lease`, released (`Lease.release`) when the
  request closes on whatever path (services/api/request.py: the request holds it, `hold`); a route
  answered within its handler (e.g. a tokenizer or embeddings route) takes `async with admitted(tenant)` instead.

A lease holds a concurrency slot: a member of the tenant's sorted set whose score is when it expires. Every
--usage-flush-s (and a third of --quota-lease-s at the most) this process refreshes its leases and adds the tokens
its open requests counted since (prompt, cached, generated) to their tenants' minute windows and usage counters,
in one pipeline for all of them: no round trip per token. A crashed process's slots expire within
--quota-lease-s; a closed request's slot is removed at once, with its last tokens.

Requests per minute and tokens per minute count in fixed one-minute windows of Redis's clock; a request is
admitted while its tenant's window has room (the tokens of requests already running are counted as they come,
so a window may end above its limit: the next requests wait for the next window).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
from fastapi import Request
from prometheus_client import CollectorRegistry, Counter
from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.api.errors import ApiError
from services.api.tenants import OPEN, KeyRing, Policy, Tenant
from shared.keys import Keys
from shared.messages import TokenizeJob
from shared.settings import ApiSettings

log = logging.getLogger(__name__)

NOBODY = Tenant("", Policy(models=frozenset()))  # keys configured but none presented: no model, no admin
TENANT = "rsinfer.tenant"  # scope key: the request's Tenant (services/api/app.py Guard sets it)
WINDOW_TTL_S = 120
USAGE = ("requests", "prompt_tokens", "cached_tokens", "generated_tokens")

# KEYS: the tenant's slots, its window. ARGV: lease id, lease seconds, max concurrent, requests and tokens per
# minute (-1: none). -> {refused (0 none, 1 concurrent, 2 requests, 3 tokens), open slots, requests and tokens in
# the window (this one counted if admitted), seconds until the window resets}
ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local minute = math.floor(now / 60)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local open = redis.call('ZCARD', KEYS[1])
local w = redis.call('HMGET', KEYS[2], 'w', 'req', 'tok')
local req, tok = 0, 0
if tonumber(w[1]) == minute then req = tonumber(w[2]) or 0; tok = tonumber(w[3]) or 0 end
local conc, rpm, tpm = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local refused = 0
if conc >= 0 and open >= conc then refused = 1
elseif rpm >= 0 and req >= rpm then refused = 2
elseif tpm >= 0 and tok >= tpm then refused = 3 end
if refused == 0 then
  local lease = tonumber(ARGV[2])
  if conc >= 0 then
    redis.call('ZADD', KEYS[1], now + lease, ARGV[1])
    redis.call('EXPIRE', KEYS[1], math.ceil(lease) * 2)
    open = open + 1
  end
  req = req + 1
  redis.call('HSET', KEYS[2], 'w', minute, 'req', req, 'tok', tok)
  redis.call('EXPIRE', KEYS[2], WINDOW_TTL)
end
return {refused, open, req, tok, math.ceil(60 * (minute + 1) - now)}
""".replace("WINDOW_TTL", str(WINDOW_TTL_S))

# KEYS: the tenant's slots, its window. ARGV: lease seconds, tokens to count, lease ids to refresh...
REFRESH = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local minute = math.floor(now / 60)
local tokens = tonumber(ARGV[2])
if tokens > 0 then
  if tonumber(redis.call('HGET', KEYS[2], 'w')) ~= minute then
    redis.call('HSET', KEYS[2], 'w', minute, 'req', 0, 'tok', 0)
  end
  redis.call('HINCRBY', KEYS[2], 'tok', tokens)
  redis.call('EXPIRE', KEYS[2], WINDOW_TTL)
end
if #ARGV > 2 then
  local lease = tonumber(ARGV[1])
  for i = 3, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + lease, ARGV[i]) end
  redis.call('EXPIRE', KEYS[1], math.ceil(lease) * 2)
end
return 1
""".replace("WINDOW_TTL", str(WINDOW_TTL_S))


@dataclass
class Lease:
    """One admitted request's hold on its tenant's quota, and what of its usage is not yet counted in Redis."""

    tenant: Tenant
    id: str
    slot: bool  # holds a concurrency slot (the tenant has max_concurrent)
    counts: Any = None  # the request's counts (services/api/formats.py Counts), once it is open
    counted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(USAGE, 0))
    released: bool = False
    owner: Quotas | None = None

    def unflushed(self) -> dict[str, int]:
        """The usage since the last flush, now marked as counted."""
        c = self.counts
        now = {"requests": 1, "prompt_tokens": c.prompt_tokens if c else 0,
               "cached_tokens": c.cached_tokens if c else 0, "generated_tokens": c.completion_tokens if c else 0}
        delta = {k: now[k] - self.counted[k] for k in USAGE}
        self.counted = now
        return delta

    async def release(self) -> None:
        if not self.released and self.owner is not None:
            self.released = True
            await self.owner.release(self)


def rate_headers(policy, result: list) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers of the limits the tenant has (and ours for its concurrency)."""
    _, open_, req, tok, reset = (int(x) for x in result)
    headers: dict[str, str] = {}
    if policy.max_concurrent is not None:
        headers["x-ratelimit-limit-concurrent"] = str(policy.max_concurrent)
        headers["x-ratelimit-remaining-concurrent"] = str(max(0, policy.max_concurrent - open_))
    for kind, limit, used in (("requests", policy.requests_per_minute, req), ("tokens", policy.tokens_per_minute,
                                                                             tok)):
        if limit is not None:
            headers[f"x-ratelimit-limit-{kind}"] = str(limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, limit - used))
            headers[f"x-ratelimit-reset-{kind}"] = f"{reset}s"
    return headers


def refusal(tenant: Tenant, result: list) -> ApiError:
    """The 429 of an admission the script refused."""
    refused, open_, req, tok, reset = (int(x) for x in result)
    p = tenant.policy
    if refused == 1:
        why, retry = (f"{open_} requests open, at most {p.max_concurrent} at once (max_concurrent): retry when one "
                      "ends"), 1
    elif refused == 2:
        why, retry = f"{req} requests this minute, at most {p.requests_per_minute} (requests_per_minute)", reset
    else:
        why, retry = f"{tok} tokens this minute, at most {p.tokens_per_minute} (tokens_per_minute)", reset
    return ApiError(429, f"rate limit reached for tenant `{tenant.name}`: {why}", code="rate_limit_exceeded",
                    retry_after=retry, headers=rate_headers(p, result))


class Quotas:
    """Admission, leases and usage of every tenant, for this process (module doc)."""

    def __init__(self, redis: Redis, keys: Keys, settings: ApiSettings, registry: CollectorRegistry):
        self.redis, self.keys = redis, keys
        self.lease_s = settings.quota_lease_s
        self.tick_s = min(settings.usage_flush_s, settings.quota_lease_s / 3)
        self.leases: dict[str, Lease] = {}
        self.usage = {name: Counter(f"rsinfer_tenant_{name}", f"{name.replace('_', ' ')} per tenant, counted by "
                                    "this API process", ["tenant"], registry=registry) for name in USAGE}
        self.task: asyncio.Task | None = None

    async def admit(self, tenant: Tenant) -> Lease:
        """The request's lease, or a 429 (one script call when the tenant has a limit; none when it has not)."""
        p = tenant.policy
        lease = Lease(tenant, secrets.token_hex(8), slot=p.max_concurrent is not None, owner=self)
        if p.limited:
            limits = [-1 if v is None else v for v in (p.max_concurrent, p.requests_per_minute, p.tokens_per_minute)]
            result = await self.redis.eval(ADMIT, 2, self.keys.quota_slots(tenant.name),
                                           self.keys.quota_window(tenant.name), lease.id, self.lease_s, *limits)
            if int(result[0]):
                raise refusal(tenant, result)
        self.leases[lease.id] = lease
        return lease

    def _queue(self, pipe, leases: list[Lease], refresh: bool) -> None:
        """Each tenant's tokens since the last flush (and its leases' new expiry when `refresh`) and the usage
        counters, on `pipe`; this process's counters too."""
        by_tenant: dict[str, list[Lease]] = defaultdict(list)
        for lease in leases:
            by_tenant[lease.tenant.name].append(lease)
        for name, group in by_tenant.items():
            deltas = [lease.unflushed() for lease in group]
            total = {k: sum(d[k] for d in deltas) for k in USAGE}
            ids = [lease.id for lease in group if lease.slot] if refresh else []
            tokens = total["prompt_tokens"] + total["generated_tokens"]
            if (tokens or ids) and group[0].tenant.policy.limited:
                pipe.eval(REFRESH, 2, self.keys.quota_slots(name), self.keys.quota_window(name), self.lease_s,
                          tokens, *ids)
            for k, v in total.items():
                if v:
                    pipe.hincrby(self.keys.usage(), f"{name}:{k}", v)
                    self.usage[k].labels(name).inc(v)

    async def release(self, lease: Lease) -> None:
        """The request closed: its slot freed and its last tokens counted, in one round trip (shielded)."""
        self.leases.pop(lease.id, None)
        with anyio.CancelScope(shield=True):
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    if lease.slot:
                        pipe.zrem(self.keys.quota_slots(lease.tenant.name), lease.id)
                    self._queue(pipe, [lease], refresh=False)
                    await pipe.execute()
            except (RedisError, OSError) as e:
                log.warning("tenant=%s could not release its quota lease (it expires within %.0fs): %s",
                            lease.tenant.name, self.lease_s, e)

    async def flush(self) -> None:
        leases = list(self.leases.values())
        if not leases:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            self._queue(pipe, leases, refresh=True)
            if len(pipe):
                await pipe.execute()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                await self.flush()
            except (RedisError, OSError) as e:
                log.warning("could not refresh quota leases and usage: %s", e)

    def start(self) -> None:
        self.task = asyncio.create_task(self.run())

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        with contextlib.suppress(RedisError, OSError):
            await self.flush()


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
        """A 403 unless the key's `models` names the LoRA adapter a request resolved to (services/api/adapters.py
        `target`): an adapter is allowed by its own name, never by its base model's."""
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
        endpoint passes here (services/api/admission.py `Admission.leased`), so none runs outside its key's
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

    async def admit(self, tenant: Tenant) -> Lease | None:
        """The request's lease (None in open mode), or a 429."""
        if not self.on:
            return None
        return await self.quotas.admit(tenant)

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
