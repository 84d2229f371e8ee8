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

Keys (shared/keys.py `queued*`, one hash slot per model): the jobs (sorted set uid -> deadline), their tenants
(hash uid -> tenant), the count per tenant and each queued tenant's weight (hashes).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from shared.keys import Keys
from shared.messages import RequestJob

CEILING = 2  # the queue never holds more than this many times --max-queued (tenants within their shares)
TTL_SLACK_S = 300  # how far past the latest deadline a refresh of the keys' TTL reaches (`ENTER`)

_DROP = """
local function drop(uid)
  if redis.call('ZREM', KEYS[1], uid) == 0 then return end
  local t = redis.call('HGET', KEYS[2], uid)
  redis.call('HDEL', KEYS[2], uid)
  if t and redis.call('HINCRBY', KEYS[3], t, -1) <= 0 then
    redis.call('HDEL', KEYS[3], t)
    redis.call('HDEL', KEYS[4], t)
  end
end
"""

# KEYS: jobs, owners, counts, weights. ARGV: now, deadline, max queued, tenant, weight, ttl, uids...
# -> {admitted (1/0), queued in all, the tenant's, its share}
ENTER = _DROP + """
local now, deadline, most = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tenant, weight, ttl = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
for _, uid in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do drop(uid) end
local counts, weights = redis.call('HGETALL', KEYS[3]), {}
local w = redis.call('HGETALL', KEYS[4])
for i = 1, #w, 2 do weights[w[i]] = tonumber(w[i + 1]) end
local total, mine, wsum = 0, 0, weight
for i = 1, #counts, 2 do
  local c = tonumber(counts[i + 1])
  total = total + c
  if counts[i] == tenant then mine = c else wsum = wsum + (weights[counts[i]] or 1) end
end
local n = #ARGV - 6
local share = math.max(1, math.floor(most * weight / wsum))
if not ((mine + n <= share and total + n <= CEILING * most) or total + n <= most) then
  return {0, total, mine, share}
end
for i = 7, #ARGV do
  if redis.call('ZADD', KEYS[1], 'NX', deadline, ARGV[i]) == 1 then
    redis.call('HSET', KEYS[2], ARGV[i], tenant)
    redis.call('HINCRBY', KEYS[3], tenant, 1)
    mine, total = mine + 1, total + 1
  end
end
if weights[tenant] ~= weight then redis.call('HSET', KEYS[4], tenant, weight) end
-- Never shortened: the keys outlive the latest deadline of their jobs. They are created and emptied together (a
-- job's uid, its tenant and its count go in and out as one), so the jobs' TTL stands for all four, and each
-- refresh reaches SLACK seconds past what is needed, so that most calls find it long enough and write none.
if redis.call('TTL', KEYS[1]) < ttl then
  for i = 1, 4 do redis.call('EXPIRE', KEYS[i], ttl + SLACK) end
end
return {1, total, mine, share}
""".replace("CEILING", str(CEILING)).replace("SLACK", str(TTL_SLACK_S))

# KEYS: jobs, owners, counts, weights. ARGV: uids...
LEAVE = _DROP + """
for i = 1, #ARGV do drop(ARGV[i]) end
return 1
"""


@dataclass(frozen=True)
class Entered:
    """What `enter` found: whether the jobs were admitted, and the queue's figures (theirs counted if so)."""

    admitted: bool
    total: int
    mine: int
    share: int


def _keys(keys: Keys, model: str) -> list[str]:
    return [keys.queued(model), keys.queued_owners(model), keys.queued_tenants(model), keys.queued_weights(model)]


async def enter(redis: Redis, keys: Keys, jobs: Sequence[RequestJob], most: int) -> Entered:
    """Count a request's jobs (one model's, one tenant's) in their model's queue, if they fit (module doc)."""
    job = jobs[0]
    ttl = max(1, int(job.deadline - time.time()) + 60)
    # EVAL, not EVALSHA, as in shared/streams.py Appender.queue
    ok, total, mine, share = await redis.eval(ENTER, 4, *_keys(keys, job.model), f"{time.time():.3f}",
                                              f"{job.deadline:.3f}", most, job.tenant, max(1, job.weight), ttl,
                                              *(j.uid for j in jobs))
    return Entered(bool(ok), int(total), int(mine), int(share))


def leave(target: Any, keys: Keys, model: str, uids: Sequence[str]) -> Any:
    """Take `uids` out of the model's queue count (those not in it are left alone). On a pipeline it is queued."""
    if not uids:
        return None
    return target.eval(LEAVE, 4, *_keys(keys, model), *uids)


async def figures(redis: Redis, keys: Keys, model: str) -> dict[str, int]:
    """The model's queue per tenant now (jobs past their deadline included until the next `enter`)."""
    counts = await redis.hgetall(keys.queued_tenants(model))
    return {(t.decode() if isinstance(t, bytes) else t): int(c) for t, c in counts.items()}
