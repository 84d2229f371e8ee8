"""Tenants' quotas, shared by every API process through Redis (docs/operator-guide.md, "Tenants";
services/api/multitenancy/tenancy.py asks this module): a request is admitted by one script (`ADMIT`) that checks all of
its tenant's limits at once and takes what the request will hold, and it holds it for as long as the request lives,
whoever follows it.

- **Concurrency** (`max_concurrent`): a slot, a member of the tenant's sorted set named after the request's uid
  (`<uid>@<unix second of admission>`), scored by the request's deadline: every stage ends a request by then, so a
  slot cannot outlive its request even if every API process that knew of it died. The process that admitted it
  releases it once the request's record turns terminal (`Quotas.watch`), not when its client leaves: a stream
  whose client dropped, a background response, a reattached follower on another pod all keep their slot until the
  request ends. An admission refused for concurrency first drops the slots of requests that already ended (their
  records say so, `Quotas.reap`), so a slot whose holder died with it is freed at the next refusal.
- **Requests per minute**: a fixed one-minute window of Redis's clock.
- **Tokens per minute**: a token bucket of `tokens_per_minute` that refills continuously. Admission reserves what
  the request may generate (`max_tokens` × choices × prompts; the model's context where `max_tokens` is omitted)
  and is refused while the bucket cannot cover it; when the request ends, what it did not use is refunded and
  what it used beyond (its prompt) is taken, so the bucket may go below zero and the overshoot is carried into
  the next minutes. The tokens are the stages' counts in the request's record (`prompt_tokens`, and
  `generated_tokens`, which the detokenizer adds as each choice ends), not what a client read.

A route answered within its handler (the tokenizer routes) takes a `handler` lease: a random member that its
process refreshes every tick and releases when the block ends; a crashed process's expire within --quota-lease-s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

import anyio
from prometheus_client import CollectorRegistry, Counter
from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.api.errors import ApiError
from services.api.multitenancy.tenants import Policy, Tenant
from shared.keys import Keys
from shared.request_states import TERMINAL
from shared.settings import ApiSettings
from shared.tasks import stop_task

log = logging.getLogger(__name__)

WINDOW_TTL_S = 120
USAGE = ("requests", "prompt_tokens", "cached_tokens", "generated_tokens")
HANDLER = "h:"  # the member prefix of a handler's lease (no record: refreshed, never reaped)
SLOT_GRACE_S = 30  # past its deadline a request's last stage writes its end: its slot outlives it by this much
REAP_AFTER_S = 10  # a slot whose record is missing is an ended request only once its record had time to be written
SLOTS_TTL_SLACK_S = 300  # how far past its latest slot's expiry a refresh of a tenant's slots' TTL reaches

# The token bucket's level now, refilled since `tb_at` (full when the tenant has none yet), from the window's `tb`
# and `tb_at`; and the level kept, with `fields` (more of the window's) in the same HSET and one EXPIRE. Shared by
# both scripts.
LEVEL = """
local function level_now(tb, tb_at, tpm, now)
  if not tb then return tpm end
  return math.min(tpm, tonumber(tb) + (now - tonumber(tb_at)) * tpm / 60)
end
local function keep_level(window, tpm, now, level, fields)
  redis.call('HSET', window, 'tb', tostring(level), 'tb_at', tostring(now), unpack(fields))
  local refill = 0
  if tpm > 0 then refill = math.ceil((tpm - level) * 60 / tpm) end
  redis.call('EXPIRE', window, math.max(WINDOW_TTL, refill + 60))
end
""".replace("WINDOW_TTL", str(WINDOW_TTL_S))

# KEYS: the tenant's slots, its window. ARGV: slot member, slot expiry (unix s; -1: now + lease seconds), lease
# seconds, max concurrent, requests per minute, tokens per minute (-1: none), tokens to reserve.
# -> {refused (0 none, 1 concurrent, 2 requests, 3 tokens now, 4 tokens ever), open slots, requests in the window
# (this one counted if admitted), the bucket's level (after this one), seconds until the window resets, seconds
# until the bucket could cover the reserve}
ADMIT = LEVEL + """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local minute = math.floor(now / 60)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local open = redis.call('ZCARD', KEYS[1])
local w = redis.call('HMGET', KEYS[2], 'w', 'req', 'tb', 'tb_at')
local req = 0
if tonumber(w[1]) == minute then req = tonumber(w[2]) or 0 end
local conc, rpm, tpm, reserve = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local level, wait = 0, 0
if tpm >= 0 then
  level = level_now(w[3], w[4], tpm, now)
  if tpm > 0 and level < reserve then wait = math.ceil((reserve - level) * 60 / tpm) end
end
local refused = 0
if conc >= 0 and open >= conc then refused = 1
elseif rpm >= 0 and req >= rpm then refused = 2
elseif tpm >= 0 and reserve > tpm then refused = 4
elseif tpm >= 0 and (level < reserve or level <= 0 and tpm == 0) then refused = 3 end
if refused == 0 then
  if conc >= 0 then
    local expiry = tonumber(ARGV[2])
    if expiry < 0 then expiry = now + tonumber(ARGV[3]) end
    redis.call('ZADD', KEYS[1], expiry, ARGV[1])
    -- never shortened; a refresh reaches SLACK seconds further, so that most admissions write no EXPIRE
    local ttl = math.ceil(expiry - now) + 60
    if redis.call('TTL', KEYS[1]) < ttl then redis.call('EXPIRE', KEYS[1], ttl + SLACK) end
    open = open + 1
  end
  req = req + 1
  if tpm >= 0 then
    level = level - reserve
    keep_level(KEYS[2], tpm, now, level, {'w', minute, 'req', req})
  else
    redis.call('HSET', KEYS[2], 'w', minute, 'req', req)
    redis.call('EXPIRE', KEYS[2], WINDOW_TTL)
  end
end
return {refused, open, req, math.floor(level), math.ceil(60 * (minute + 1) - now), wait}
""".replace("WINDOW_TTL", str(WINDOW_TTL_S)).replace("SLACK", str(SLOTS_TTL_SLACK_S))

# KEYS: the tenant's slots, its window. ARGV: slot member ('' for none), tokens per minute (-1: none), tokens to
# give back to the bucket (what was reserved less what was used; below zero takes the overshoot).
SETTLE = LEVEL + """
if ARGV[1] ~= '' then redis.call('ZREM', KEYS[1], ARGV[1]) end
local tpm, refund = tonumber(ARGV[2]), tonumber(ARGV[3])
if tpm >= 0 and refund ~= 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  local b = redis.call('HMGET', KEYS[2], 'tb', 'tb_at')
  keep_level(KEYS[2], tpm, now, math.min(tpm, level_now(b[1], b[2], tpm, now) + refund), {})
end
return 1
"""


def _limit(value: int | None) -> int:
    return -1 if value is None else value


@dataclass
class Lease:
    """One admitted request's hold on its tenant's quota: its slot (`member`, when the tenant has max_concurrent),
    the tokens it reserved, and, once its request opened, the uids whose records say when it ended (`follow`)."""

    tenant: Tenant
    member: str
    slot: bool
    reserved: int = 0
    uids: tuple[str, ...] = ()
    counts: Any = None  # what the follower that opened it read (services/api/answer/formats.py Counts)
    owner: Quotas | None = None
    released: bool = False
    orphan: bool = False  # its follower left before it ended: its record says when it does (`Quotas.watch`)

    @property
    def handler(self) -> bool:
        return self.member.startswith(HANDLER)

    def follow(self, uids: tuple[str, ...], counts: Any) -> None:
        self.uids, self.counts = uids, counts

    async def end(self, done: bool) -> None:
        """Its follower closed: release it now if the request finished (all of it read) or never opened; else keep
        it until the request's record turns terminal (`Quotas.watch`)."""
        if self.released or self.owner is None:
            return
        if done or not self.uids:
            await self.release()
        else:
            self.orphan = True

    async def release(self, usage: dict[str, int] | None = None) -> None:
        """Free the slot and settle the tokens: `usage` (the stages' counts) or what its follower read."""
        if not self.released and self.owner is not None:
            self.released = True
            await self.owner.release(self, usage if usage is not None else self.read_usage())

    def read_usage(self) -> dict[str, int]:
        c = self.counts
        return {"requests": 1, "prompt_tokens": c.prompt_tokens if c else 0,
                "cached_tokens": c.cached_tokens if c else 0, "generated_tokens": c.completion_tokens if c else 0}


def rate_headers(policy: Policy, result: list) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers of the limits the tenant has (and ours for its concurrency)."""
    _, open_, req, level, reset, wait = (int(x) for x in result)
    headers: dict[str, str] = {}
    if policy.max_concurrent is not None:
        headers["x-ratelimit-limit-concurrent"] = str(policy.max_concurrent)
        headers["x-ratelimit-remaining-concurrent"] = str(max(0, policy.max_concurrent - open_))
    if policy.requests_per_minute is not None:
        headers["x-ratelimit-limit-requests"] = str(policy.requests_per_minute)
        headers["x-ratelimit-remaining-requests"] = str(max(0, policy.requests_per_minute - req))
        headers["x-ratelimit-reset-requests"] = f"{reset}s"
    if policy.tokens_per_minute is not None:
        headers["x-ratelimit-limit-tokens"] = str(policy.tokens_per_minute)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, level))
        headers["x-ratelimit-reset-tokens"] = f"{wait}s"
    return headers


def refusal(tenant: Tenant, result: list, reserve: int) -> ApiError:
    """The 429 of an admission the script refused."""
    refused, open_, req, level, reset, wait = (int(x) for x in result)
    p = tenant.policy
    headers = rate_headers(p, result)
    if refused == 1:
        why, retry = (f"{open_} requests open, at most {p.max_concurrent} at once (max_concurrent): retry when one "
                      "ends"), 1
    elif refused == 2:
        why, retry = f"{req} requests this minute, at most {p.requests_per_minute} (requests_per_minute)", reset
    elif refused == 3:
        why, retry = (f"this request may use {reserve} tokens (max_tokens × choices) and {max(level, 0)} of "
                      f"{p.tokens_per_minute} are left (tokens_per_minute; they come back as requests end and "
                      "with time)"), max(wait, 1)
    else:  # no wait makes room: say so, and that a retry cannot help
        headers["x-should-retry"] = "false"
        return ApiError(429, f"rate limit reached for tenant `{tenant.name}`: this request may use {reserve} "
                        f"tokens (max_tokens × choices), more than its tokens_per_minute {p.tokens_per_minute}: ask "
                        "for fewer tokens", param="max_tokens", code="rate_limit_exceeded", headers=headers)
    return ApiError(429, f"rate limit reached for tenant `{tenant.name}`: {why}", code="rate_limit_exceeded",
                    retry_after=retry, headers=headers)


def ended(status: str | None, member: str, now: float) -> bool:
    """Whether a slot's request ended, from its record's status (None: no record)."""
    if status is not None:
        return status in TERMINAL
    _, _, at = member.rpartition("@")
    return not at.isdigit() or now - int(at) > REAP_AFTER_S


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

    async def admit(self, tenant: Tenant, reserve: int = 0, uid: str | None = None,
                    deadline: float | None = None) -> Lease:
        """The lease of a request of `uid` ending by `deadline` (None: a handler's), or a 429; one script call
        when the tenant has a limit, none when it has not."""
        p = tenant.policy
        member = f"{uid}@{int(time.time())}" if uid else HANDLER + secrets.token_hex(8)
        lease = Lease(tenant, member, slot=p.max_concurrent is not None, reserved=reserve, owner=self)
        if p.limited:
            expiry = -1 if deadline is None else deadline + SLOT_GRACE_S
            result = await self._admit(tenant, member, expiry, reserve)
            if int(result[0]) == 1 and await self.reap(tenant):
                result = await self._admit(tenant, member, expiry, reserve)
            if int(result[0]):
                raise refusal(tenant, result, reserve)
        self.leases[member] = lease
        return lease

    async def count(self, tenant: Tenant) -> None:
        """An action that generates nothing (an upload, a batch's creation): counted in the tenant's requests per
        minute (a 429 past it), holding no slot and reserving no token."""
        rpm = tenant.policy.requests_per_minute
        if rpm is not None:
            result = await self.redis.eval(ADMIT, 2, self.keys.quota_slots(tenant.name),
                                           self.keys.quota_window(tenant.name), "", -1, self.lease_s, -1, rpm, -1, 0)
            if int(result[0]):
                raise refusal(tenant, result, 0)

    async def _admit(self, tenant: Tenant, member: str, expiry: float, reserve: int) -> list:
        p = tenant.policy
        return await self.redis.eval(ADMIT, 2, self.keys.quota_slots(tenant.name), self.keys.quota_window(tenant.name),
                                     member, expiry, self.lease_s, _limit(p.max_concurrent),
                                     _limit(p.requests_per_minute), _limit(p.tokens_per_minute), reserve)

    async def reap(self, tenant: Tenant) -> int:
        """Drop the tenant's slots whose requests ended (any process's: it may have died with them); how many."""
        slots = self.keys.quota_slots(tenant.name)
        members = [m.decode() for m in await self.redis.zrange(slots, 0, -1)]
        held = [m for m in members if not m.startswith(HANDLER)]
        statuses = await self._statuses([m.rpartition("@")[0] for m in held])
        now = time.time()
        gone = [m for m, status in zip(held, statuses, strict=True) if ended(status, m, now)]
        if gone:
            await self.redis.zrem(slots, *gone)
            log.info("tenant=%s freed %d slots of requests that had ended", tenant.name, len(gone))
        return len(gone)

    async def _statuses(self, uids: list[str]) -> list[str | None]:
        if not uids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for uid in uids:
                pipe.hget(self.keys.request(uid), "status")
            return [v.decode() if v is not None else None for v in await pipe.execute()]

    async def release(self, lease: Lease, usage: dict[str, int]) -> None:
        """The request ended: its slot freed, its tokens settled and its usage counted, in one round trip
        (shielded)."""
        self.leases.pop(lease.member, None)
        with anyio.CancelScope(shield=True):
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    self._settle(pipe, lease, usage)
                    await pipe.execute()
            except (RedisError, OSError) as e:
                log.warning("tenant=%s could not release its quota lease (its slot ends with the request's "
                            "deadline): %s", lease.tenant.name, e)

    def _settle(self, pipe, lease: Lease, usage: dict[str, int]) -> None:
        name, p = lease.tenant.name, lease.tenant.policy
        if p.limited:
            used = usage["prompt_tokens"] + usage["generated_tokens"]
            pipe.eval(SETTLE, 2, self.keys.quota_slots(name), self.keys.quota_window(name),
                      lease.member if lease.slot else "", _limit(p.tokens_per_minute), lease.reserved - used)
        for k, v in usage.items():
            if v:
                pipe.hincrby(self.keys.usage(), f"{name}:{k}", v)
                self.usage[k].labels(name).inc(v)

    async def watch(self) -> None:
        """One tick: release the leases whose followers left once their requests' records say they ended (with the
        stages' counts), and refresh the handlers' slots."""
        orphans = [lease for lease in self.leases.values() if lease.orphan and not lease.released]
        handlers = [lease for lease in self.leases.values() if lease.handler and lease.slot and not lease.released]
        if handlers:
            async with self.redis.pipeline(transaction=False) as pipe:
                for lease in handlers:
                    pipe.zadd(self.keys.quota_slots(lease.tenant.name), {lease.member: time.time() + self.lease_s},
                              xx=True)
                await pipe.execute()
        if not orphans:
            return
        uids = [uid for lease in orphans for uid in lease.uids]
        async with self.redis.pipeline(transaction=False) as pipe:
            for uid in uids:
                pipe.hmget(self.keys.request(uid), "status", "prompt_tokens", "generated_tokens")
            rows = dict(zip(uids, await pipe.execute(), strict=True))
        for lease in orphans:
            records = [rows[uid] for uid in lease.uids]
            if all(status is None or status.decode() in TERMINAL for status, _, _ in records):
                await lease.release(self._recorded(lease, records))

    @staticmethod
    def _recorded(lease: Lease, records: list[list]) -> dict[str, int]:
        """A request's usage as its stages recorded it (what its follower read where a record is gone)."""
        read = lease.read_usage()
        if any(status is None for status, _, _ in records):
            return read
        prompt = sum(int(p or 0) for _, p, _ in records)
        generated = sum(int(g or 0) for _, _, g in records)
        return {"requests": 1, "prompt_tokens": max(prompt, read["prompt_tokens"]),
                "cached_tokens": read["cached_tokens"], "generated_tokens": max(generated, read["generated_tokens"])}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                await self.watch()
            except (RedisError, OSError) as e:
                log.warning("could not check the requests of quota leases: %s", e)

    def start(self) -> None:
        self.task = asyncio.create_task(self.run())

    async def close(self) -> None:
        """Shutdown: the leases of requests that run on keep their slots (until they end, `reap`, or their
        deadline); a last look releases those that ended."""
        if self.task is not None:  # a Redis call can swallow the cancellation: never wait for ever
            await stop_task(self.task)
        with contextlib.suppress(RedisError, OSError):
            await self.watch()
