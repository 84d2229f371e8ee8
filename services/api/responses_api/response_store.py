"""Stored responses of the Responses API (services/api/responses_api/responses.py) in Redis, and what each tenant
stores.

A stored response is one hash (`Keys.response`, a TTL of --response-ttl-s): `tenant`, its owner, checked in Redis
before any other field is read (`READ`), so another tenant's request is answered without reading the document;
`meta` (the fields its object echoes, how its answers are parsed, `prev`: the response it continues); `input`
(its own input items only: a conversation is kept by reference, each response naming its predecessor, and read
link by link); `final` (its final object, once it ended). It is written with the request that produces it, on the
pipeline that opens it (services/api/answer/request/single.py), after its tenant was admitted, and counted against its
tenant's bounds (--max-stored-responses-per-tenant, --max-stored-response-bytes-per-tenant):

- `reserve` (`RESERVE`, on the tenant's keys) drops what expired, refuses past a bound (a 400), else counts the
  response: its uid in the tenant's sorted set, scored by when it expires (soon, PENDING_S, until it is written),
  and its bytes;
- `writes`, on the opening pipeline, writes the hash and moves the count's expiry to the hash's;
- `finish` adds the final object (once, `FINISH`) and its bytes; `delete` removes the hash and its count.

A response's expiry is refreshed when it ends and whenever a later response continues its conversation, in the
hash and in the count alike, so the count follows what Redis holds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client import Counter
from redis.asyncio import Redis

from services.api.errors import ApiError
from shared.keys import Keys
from shared.settings import ApiSettings

log = logging.getLogger(__name__)

PENDING_S = 120  # a reservation whose response was never written (its request did not open) expires after this
TOTAL = "#total"  # the field of the bytes hash holding their sum (no uid has a `#`)

# KEYS: the response. ARGV: sees every tenant's (1/0), the reader's tenant, fields... -> {} if there is none,
# {owner} if it is another tenant's, else {owner, the fields' values}
READ = """
local owner = redis.call('HGET', KEYS[1], 'tenant')
if not owner then return {} end
if ARGV[1] ~= '1' and owner ~= ARGV[2] then return {owner} end
if #ARGV < 3 then return {owner} end
local out = redis.call('HMGET', KEYS[1], unpack(ARGV, 3))
table.insert(out, 1, owner)
return out
"""

# KEYS: the tenant's sorted set, its bytes hash. ARGV: uid, bytes, pending seconds, most responses, most bytes,
# the keys' TTL. -> {refused (0 no, 1 responses, 2 bytes), responses, bytes}
RESERVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, uid in ipairs(gone) do
  local b = redis.call('HGET', KEYS[2], uid)
  if b then
    redis.call('HDEL', KEYS[2], uid)
    redis.call('HINCRBY', KEYS[2], 'TOTAL', -tonumber(b))
  end
end
if #gone > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now) end
local count = redis.call('ZCARD', KEYS[1])
local total = tonumber(redis.call('HGET', KEYS[2], 'TOTAL') or '0')
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return {0, count, total} end
local size = tonumber(ARGV[2])
if count + 1 > tonumber(ARGV[4]) then return {1, count, total} end
if total + size > tonumber(ARGV[5]) then return {2, count, total} end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], size)
redis.call('HINCRBY', KEYS[2], 'TOTAL', size)
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('EXPIRE', KEYS[2], ARGV[6])
return {0, count + 1, total + size}
""".replace("TOTAL", TOTAL)

# KEYS: the response. ARGV: the final object, TTL, most bytes. -> 1 stored, 0 already ended or gone, -1 too large
FINISH = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], 'final') == 1 then return 0 end
local size = redis.call('HSTRLEN', KEYS[1], 'meta') + redis.call('HSTRLEN', KEYS[1], 'input') + string.len(ARGV[1])
if size > tonumber(ARGV[3]) then return -1 end
redis.call('HSET', KEYS[1], 'final', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: the tenant's sorted set, its bytes hash. ARGV: uid, bytes to add, its new expiry, the keys' TTL.
GROW = """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('HINCRBY', KEYS[2], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[2], 'TOTAL', ARGV[2])
redis.call('ZADD', KEYS[1], 'XX', ARGV[3], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return 1
""".replace("TOTAL", TOTAL)

# KEYS: the tenant's sorted set, its bytes hash. ARGV: uid.
UNCOUNT = """
local b = redis.call('HGET', KEYS[2], ARGV[1])
if b then
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('HINCRBY', KEYS[2], 'TOTAL', -tonumber(b))
end
return redis.call('ZREM', KEYS[1], ARGV[1])
""".replace("TOTAL", TOTAL)


@dataclass(frozen=True)
class Stored:
    """What was read of one stored response: its owner and the fields asked for (raw JSON, None if absent)."""

    uid: str
    owner: str
    fields: dict[str, bytes | None]

    def json(self, name: str) -> Any:
        raw = self.fields.get(name)
        return orjson.loads(raw) if raw else None


class ResponseStore:
    """Stored responses and each tenant's count of them (module doc); `ended` counts the final objects stored,
    by status."""

    def __init__(self, redis: Redis, keys: Keys, settings: ApiSettings, ended: Counter | None = None):
        self.redis, self.keys, self.ended = redis, keys, ended
        self.ttl_s, self.max_bytes = settings.response_ttl_s, settings.max_stored_response_bytes
        self.max_count = settings.max_stored_responses_per_tenant
        self.max_tenant_bytes = settings.max_stored_response_bytes_per_tenant
        self.keys_ttl_s = self.ttl_s + PENDING_S  # a tenant's count outlives every response it counts

    def _counted(self, tenant: str) -> list[str]:
        return [self.keys.stored_responses(tenant), self.keys.stored_response_bytes(tenant)]

    # -- read ------------------------------------------------------------------------------------------------
    async def read(self, uid: str, tenant: str, sees_all: bool, *fields: str) -> Stored | None:
        """`fields` of a response `tenant` may read (its own, or any when `sees_all`); None for another tenant's
        or none, whose fields are never read."""
        out = await self.redis.eval(READ, 1, self.keys.response(uid), int(sees_all), tenant, *fields)
        if len(out) < 1 + len(fields) or (not sees_all and out[0].decode() != tenant):
            return None
        return Stored(uid, out[0].decode(), dict(zip(fields, out[1:], strict=True)))

    # -- write -----------------------------------------------------------------------------------------------
    def encoded(self, meta: dict[str, Any], items: list[dict[str, Any]]) -> dict[str, bytes]:
        """The fields of a new response, within --max-stored-response-bytes (a 400 naming `input`)."""
        fields = {"meta": orjson.dumps(meta), "input": orjson.dumps(items)}
        size = sum(len(v) for v in fields.values())
        if size > self.max_bytes:
            raise ApiError(400, f"the stored response would be {size} bytes; at most {self.max_bytes} "
                           "(--max-stored-response-bytes): send a shorter input, or `store: false`",
                           param="input", code="request_too_large")
        return fields

    async def reserve(self, tenant: str, uid: str, size: int) -> None:
        """Count a response of `size` bytes against `tenant`'s bounds before it is written, or a 400."""
        refused, count, total = await self.redis.eval(
            RESERVE, 2, *self._counted(tenant), uid, size, PENDING_S, self.max_count, self.max_tenant_bytes,
            self.keys_ttl_s)
        if int(refused) == 1:
            why = f"{count} stored responses, at most {self.max_count} (--max-stored-responses-per-tenant)"
        elif int(refused) == 2:
            why = (f"{total} bytes of stored responses and this one adds {size}, at most {self.max_tenant_bytes} "
                   "(--max-stored-response-bytes-per-tenant)")
        else:
            return
        raise ApiError(400, f"this tenant has {why}: delete stored responses (DELETE /v1/responses/{{id}}), let "
                       "them expire (--response-ttl-s), or send `store: false`", param="store",
                       code="stored_responses_limit")

    def writes(self, tenant: str, uid: str, fields: dict[str, bytes], chain: list[tuple[str, str]]
               ) -> Callable[[Any], None]:
        """What the request that produces the response writes on the pipeline that opens it: the hash, its
        count's expiry, and that of every response of the conversation it continues (`chain`: uid, owner)."""

        def queue(pipe: Any) -> None:
            expires = time.time() + self.ttl_s
            pipe.hset(self.keys.response(uid), mapping={"tenant": tenant, **fields})
            for at, owner in [(uid, tenant), *chain]:
                pipe.expire(self.keys.response(at), self.ttl_s)
                pipe.zadd(self.keys.stored_responses(owner), {at: expires}, xx=True)
            for owner in {tenant, *(owner for _, owner in chain)}:
                for key in self._counted(owner):
                    pipe.expire(key, self.keys_ttl_s)

        return queue

    async def finish(self, uid: str, owner: str, final: dict[str, Any]) -> None:
        """Keep the final object with the response (once; one too large to store is left to the reply
        stream) and count it."""
        raw = orjson.dumps(final)
        stored = await self.redis.eval(FINISH, 1, self.keys.response(uid), raw, self.ttl_s, self.max_bytes)
        if int(stored) == -1:
            log.warning("uid=%s final response over --max-stored-response-bytes: not stored", uid)
        if int(stored) != 1:
            return
        await self.redis.eval(GROW, 2, *self._counted(owner), uid, len(raw), time.time() + self.ttl_s,
                              self.keys_ttl_s)
        if self.ended is not None:
            self.ended.labels(final["status"]).inc()

    async def delete(self, uid: str, owner: str) -> bool:
        """Remove the response and its count (whether it was written or only reserved)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(self.keys.response(uid))
            pipe.eval(UNCOUNT, 2, *self._counted(owner), uid)
            deleted, _ = await pipe.execute()
        return bool(deleted)
