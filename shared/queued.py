"""A model's queue, counted in Redis per tenant: the jobs the API admitted that no scheduler has started yet
(docs/operator-guide.md, "Fair queueing"; docs/design.md, "Fair queueing").

The API enters a request's jobs (one per prompt) in one script (`enter`), which admits them only within
--max-queued and the tenant's share of it, so that no two API processes can both take the last place:

- a tenant's share is `max_queued × its weight / the weights of the tenants with jobs queued` (itself
  included), at least 1: within it, a tenant is admitted even past --max-queued (a tenant arriving while
  another filled the queue is not refused), up to `CEILING × max_queued`;
- beyond its share, a tenant is admitted only while the whole queue stays within --max-queued (it borrows
  what the others leave).

A job leaves the count (`leave`, queued on a pipeline the stage sends anyway) when a scheduler takes it (run or
ended there) or a tokenizer ends it (aborted, past its deadline, refused, dead-lettered). One whose process died
leaves at its deadline: each job is scored by it, and every `enter` prunes those past it first.

Two keys (shared/keys.py `queued*`, one hash slot per model), few commands per request (issue 34: a script call
each way, ~10 commands executed in all):
- the jobs: a sorted set of `member(job)` ("<uid> <tenant>": a job names its tenant, so that leaving needs no
  lookup) scored by its deadline;
- the tenants: one hash, `c:<tenant>` -> its jobs queued and `w:<tenant>` -> its weight (both removed when it has
  none queued, so the hash holds only the tenants queueing now), and `~exp`: the time (the callers' clock) the
  two keys expire at. `~exp` keeps the hash alive while the queue empties and refills, so an `enter` learns from
  the one HGETALL it reads anyway whether the keys' TTL reaches its deadline, and writes an EXPIRE only when not.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from redis.asyncio import Redis

from shared.keys import Keys
from shared.messages import RequestJob

CEILING = 2  # the queue never holds more than this many times --max-queued (tenants within their shares)
TTL_SLACK_S = 300  # how far past the latest deadline a refresh of the keys' TTL reaches (`ENTER`)

_DROP = """
local function drop(m)
  if redis.call('ZREM', KEYS[1], m) == 0 then return end
  local t = string.sub(m, (string.find(m, ' ', 1, true) or #m) + 1)
  if redis.call('HINCRBY', KEYS[2], 'c:' .. t, -1) <= 0 then redis.call('HDEL', KEYS[2], 'c:' .. t, 'w:' .. t) end
end
"""

# KEYS: jobs, tenants. ARGV: now, deadline, max queued, tenant, weight, ttl, members...
# -> {admitted (1/0), queued in all, the tenant's, its share}
ENTER = _DROP + """
local now, deadline, most = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tenant, weight, ttl = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do drop(m) end
local fields, counts, weights, exp = redis.call('HGETALL', KEYS[2]), {}, {}, 0
for i = 1, #fields, 2 do
  local f, v = fields[i], tonumber(fields[i + 1])
  local kind, t = string.sub(f, 1, 2), string.sub(f, 3)
  if kind == 'c:' then counts[t] = v elseif kind == 'w:' then weights[t] = v elseif f == '~exp' then exp = v end
end
local total, mine, wsum = 0, counts[tenant] or 0, weight
for t, c in pairs(counts) do
  total = total + c
  if t ~= tenant then wsum = wsum + (weights[t] or 1) end
end
local n = #ARGV - 6
local share = math.max(1, math.floor(most * weight / wsum))
if not ((mine + n <= share and total + n <= CEILING * most) or total + n <= most) then
  return {0, total, mine, share}
end
local zadd = {'ZADD', KEYS[1], 'NX'}
for i = 7, #ARGV do zadd[#zadd + 1] = deadline; zadd[#zadd + 1] = ARGV[i] end
local added = redis.call(unpack(zadd))
if added > 0 and mine == 0 then
  redis.call('HSET', KEYS[2], 'c:' .. tenant, added, 'w:' .. tenant, weight)
elseif added > 0 then
  redis.call('HINCRBY', KEYS[2], 'c:' .. tenant, added)
  if weights[tenant] ~= weight then redis.call('HSET', KEYS[2], 'w:' .. tenant, weight) end
end
-- Never shortened: the keys outlive the latest deadline of their jobs, and each refresh reaches SLACK seconds past
-- what is needed, so that most calls find it long enough and write none. The jobs' key is gone whenever the
-- queue emptied (nothing counted): it gets the hash's expiry again.
if exp < now + ttl then
  exp = math.ceil(now + ttl + SLACK)
  redis.call('HSET', KEYS[2], '~exp', exp)
  for i = 1, 2 do redis.call('EXPIRE', KEYS[i], exp - math.floor(now)) end
elseif total == 0 and added > 0 then
  redis.call('EXPIRE', KEYS[1], exp - math.floor(now))
end
return {1, total + added, mine + added, share}
""".replace("CEILING", str(CEILING)).replace("SLACK", str(TTL_SLACK_S))

# KEYS: jobs, tenants. ARGV: members...
LEAVE = _DROP + """
for i = 1, #ARGV do drop(ARGV[i]) end
return 1
"""


class Queued(Protocol):
    """What a queued job is known by: RequestJob and its subclasses (shared/messages.py)."""

    @property
    def uid(self) -> str: ...

    @property
    def tenant(self) -> str: ...


@dataclass(frozen=True)
class Entered:
    """What `enter` found: whether the jobs were admitted, and the queue's figures (theirs counted if so)."""

    admitted: bool
    total: int
    mine: int
    share: int


@dataclass(frozen=True)
class Figures:
    """The model's queue now: jobs and weight per tenant with jobs queued (those past their deadline included until
    the next `enter`)."""

    counts: dict[str, int]
    weights: dict[str, int]


def member(job: Queued) -> str:
    """A job in the jobs' sorted set: its uid (hex, no spaces), then its tenant."""
    return f"{job.uid} {job.tenant}"


def members(jobs: Iterable[Queued]) -> list[str]:
    return [member(j) for j in jobs]


def _keys(keys: Keys, model: str) -> list[str]:
    return [keys.queued(model), keys.queued_tenants(model)]


async def enter(redis: Redis, keys: Keys, jobs: Sequence[RequestJob], most: int) -> Entered:
    """Count a request's jobs (one model's, one tenant's) in their model's queue, if they fit (module doc)."""
    job = jobs[0]
    ttl = max(1, int(job.deadline - time.time()) + 60)
    # EVAL, not EVALSHA, as in shared/streams.py Appender.queue
    ok, total, mine, share = await redis.eval(ENTER, 2, *_keys(keys, job.model), f"{time.time():.3f}",
                                              f"{job.deadline:.3f}", most, job.tenant, max(1, job.weight), ttl,
                                              *members(jobs))
    return Entered(bool(ok), int(total), int(mine), int(share))


def leave(target: Any, keys: Keys, model: str, left: Sequence[str]) -> Any:
    """Take jobs (`member`s) out of the model's queue count (those not in it are left alone). On a pipeline it is
    queued."""
    if not left:
        return None
    return target.eval(LEAVE, 2, *_keys(keys, model), *left)


def parse_figures(raw: dict[Any, Any]) -> Figures:
    """The tenants' hash as HGETALL returns it, read (module doc)."""
    counts: dict[str, int] = {}
    weights: dict[str, int] = {}
    for f, v in raw.items():
        f = f.decode() if isinstance(f, bytes) else f
        if f.startswith("c:"):
            counts[f[2:]] = int(v)
        elif f.startswith("w:"):
            weights[f[2:]] = int(v)
    return Figures(counts, weights)


async def figures(redis: Any, keys: Keys, model: str) -> Figures:
    """The model's queue per tenant now."""
    return parse_figures(await redis.hgetall(keys.queued_tenants(model)))
