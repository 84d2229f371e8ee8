"""The one typed wrapper around Redis Streams: the only code that calls XADD, XREAD, XREADGROUP, XACK,
XAUTOCLAIM and XCLAIM, or asks FastStream to.

Every entry is one field, `data`, holding the JSON of one message of shared/messages.py, so `redis-cli
XRANGE` shows it as it is (FastStream's own publishing would write its binary envelope; we only read with it).

The tokenizer and detokenizer consume through FastStream subscribers (`subscribe`): a batch subscriber reads
new entries (`>`) of the group, and a claiming subscriber (`min_idle_time`, XAUTOCLAIM with the cursor kept
between calls) takes entries a dead or hung peer left pending. FastStream creates groups at `$`, so we create
them at `0` first (`GroupConsumer.ensure_group`) and it finds them there. Acknowledgement is ours (manual), in
the pipeline that writes the output. The scheduler reads with `GroupConsumer` directly: it pulls new work only
while its KV cache has room and holds an entry for its request's whole life, which a push subscriber cannot
express (docs/design.md, "Measured facts behind the design").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import msgspec
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import ResponseError

from shared.messages import decode, encode
from shared.redis_conn import barrier

if TYPE_CHECKING:
    from faststream.redis import RedisBroker

log = logging.getLogger(__name__)

FIELD = b"data"
M = TypeVar("M")
Target = Redis | Pipeline


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def add(target: Target, key: str, msg: msgspec.Struct, maxlen: int | None = None) -> Any:
    """XADD one message. On a pipeline it is queued; on a client it returns an awaitable of the id."""
    return target.xadd(key, {FIELD: encode(msg)}, maxlen=maxlen, approximate=True)


def add_data(target: Target, key: str, data: bytes, maxlen: int | None = None) -> Any:
    """XADD one message its caller has encoded already (`encode(msg)`: e.g. to know its size)."""
    return target.xadd(key, {FIELD: data}, maxlen=maxlen, approximate=True)


# One call appends one entry to each of many streams (and refreshes the TTLs asked for): a detokenizer's read
# writes an entry to the reply stream of every request in it, and as separate pipelined XADDs the client's
# command packing and reply parsing cost it more CPU than everything else it does per token.
_APPEND = """
local maxlen, ttl = ARGV[1], ARGV[2]
for i = 1, #KEYS do
  redis.call('XADD', KEYS[i], 'MAXLEN', '~', maxlen, '*', 'data', ARGV[1 + 2 * i])
  if ARGV[2 + 2 * i] == '1' then redis.call('EXPIRE', KEYS[i], ttl) end
end
return #KEYS
"""


_TOUCH = """
local mine, lost = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}, {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then table.insert(mine, ARGV[i]) else table.insert(lost, ARGV[i]) end
end
if #mine > 5 then
  table.insert(mine, 'JUSTID')
  redis.call(unpack(mine))
end
return lost
"""


# Reads the streams named in KEYS in order, up to ARGV[3] new entries in all: a scheduler's own stream before the
# shared one, never more than its engine has room for. Streams whose group is missing are returned apart, for the
# caller to recreate.
_READ_IN_ORDER = """
local got, missing, left = {}, {}, tonumber(ARGV[3])
for i = 1, #KEYS do
  if left <= 0 then break end
  local r = redis.pcall('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', left, 'STREAMS', KEYS[i], '>')
  if type(r) == 'table' and r.err then
    table.insert(missing, KEYS[i])
  elseif r then
    table.insert(got, r[1])
    left = left - #r[1][2]
  end
end
return {got, missing}
"""

# KEYS: a stream, a key that lives and dies with it, a set; ARGV: the group, the stream's member in the set.
_END_IF_DRAINED = """
local function after(a, b)
  local am, as = string.match(a, '(%d+)-(%d+)')
  local bm, bs = string.match(b, '(%d+)-(%d+)')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am > bm or (am == bm and as > bs)
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)[1]
  if last then
    local delivered = nil
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
      local f = {}
      for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
      if f['name'] == ARGV[1] then
        if f['pending'] > 0 then return 0 end
        delivered = f['last-delivered-id']
      end
    end
    if not delivered or after(last[1], delivered) then return 0 end
  end
  redis.call('DEL', KEYS[1])
end
redis.call('DEL', KEYS[2])
redis.call('SREM', KEYS[3], ARGV[2])
return 1
"""


_DELETE_IF_EMPTY = """
local deleted = {}
for i = 2, #ARGV do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[i]) == 0 then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[i])
    table.insert(deleted, ARGV[i])
  end
end
return deleted
"""


class Appender:
    """Appends entries to many streams in one EVALSHA per hash slot (a standalone Redis has one slot)."""

    def __init__(self, redis: Redis):
        self.slot_of = _slot_function(redis)

    def queue(self, pipe: Pipeline, entries: list[tuple[str, msgspec.Struct, bool]], maxlen: int, ttl: int) -> None:
        """Queue on `pipe` an XADD of each (key, message) and an EXPIRE of the key where asked."""
        groups: dict[int, list[tuple[str, msgspec.Struct, bool]]] = {}
        for e in entries:
            groups.setdefault(self.slot_of(e[0]), []).append(e)
        for group in groups.values():
            args: list[Any] = [maxlen, ttl]
            for _, msg, expire in group:
                args += [encode(msg), b"1" if expire else b"0"]
            # EVAL, not EVALSHA: no NOSCRIPT after a Redis restart, and no SCRIPT EXISTS round trip per pipeline
            # (Redis compiles it once and caches it by its digest); the text costs ~300 bytes a call.
            pipe.eval(_APPEND, len(group), *(k for k, _, _ in group), *args)


def _slot_function(redis: Redis) -> Any:
    from redis.asyncio.cluster import RedisCluster

    if isinstance(redis, RedisCluster):
        from redis.crc import key_slot

        return lambda key: key_slot(key.encode())
    return lambda _key: 0


def add_fields(target: Target, key: str, fields: dict[str, Any], maxlen: int | None = None) -> Any:
    """XADD an untyped entry (dead letters and control wake-ups, which are not messages)."""
    return target.xadd(key, fields, maxlen=maxlen, approximate=True)


def ack(target: Target, key: str, group: str, ids: Sequence[str]) -> Any:
    """XACK; on a pipeline, after everything queued before it has landed (on a cluster too: redis_conn.barrier),
    so an entry is never acknowledged while its result is lost.

    On a standalone Redis's pipeline the XACK goes in a MULTI/EXEC of its own. A Redis at its maxmemory
    (noeviction) refuses the writes before it (XADD, HSET) with OOM, but not a plain XACK: the entry would be
    acknowledged with its result refused. A command queued in MULTI is refused under OOM too, so the entry stays
    pending and is handled again once Redis has room (its writes, if they did land, are written again: every
    stage drops such duplicates, as after a crash). A cluster's pipeline stops at the barrier already."""
    barrier(target)
    if isinstance(target, Pipeline) and not target.is_transaction:
        target.execute_command("MULTI")
        target.xack(key, group, *ids)
        return target.execute_command("EXEC")
    return target.xack(key, group, *ids)


async def read(redis: Redis, positions: dict[str, str], count: int, block_ms: int | None
               ) -> list[tuple[str, list[tuple[str, dict[bytes, bytes]]]]]:
    """XREAD over many streams from the given ids; returns [(key, [(entry_id, fields)])]."""
    resp = await redis.xread(positions, count=count, block=block_ms)
    return [(_s(key), [(_s(eid), fields) for eid, fields in entries]) for key, entries in resp or []]


async def read_range(redis: Redis, key: str, after: str = "-", count: int | None = None
                     ) -> list[tuple[str, dict[bytes, bytes]]]:
    """XRANGE from `after` (exclusive when it is an id) to the end."""
    start = "-" if after in ("-", "0", "0-0") else f"({after}"
    return [(_s(eid), fields) for eid, fields in await redis.xrange(key, start, "+", count=count)]


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def id_after(entry_id: str, other: str) -> bool:
    """`entry_id` comes later in a stream than `other` (which, unreadable, counts as before everything)."""
    try:
        return _id_tuple(entry_id) > _id_tuple(other)
    except ValueError:
        return True


async def trimmed_head(redis: Redis, key: str) -> str | None:
    """The id of the oldest entry a capped stream still has if MAXLEN trimmed entries off its head; None if it
    has every entry ever added (or does not exist)."""
    try:
        info = await redis.xinfo_stream(key)
    except ResponseError:
        return None
    if not was_trimmed(info) or not info.get("first-entry"):
        return None
    return _s(info["first-entry"][0])


def was_trimmed(info: dict) -> bool:
    """From XINFO STREAM: entries were removed from the stream (MAXLEN trimmed its head)."""
    return int(info["entries-added"]) > int(info["length"])


def payload(fields: dict[bytes, bytes]) -> bytes:
    return fields[FIELD]


@dataclass(frozen=True, slots=True)
class Delivery(Generic[M]):
    entry_id: str
    msg: M


class GroupConsumer(Generic[M]):
    """One consumer in one consumer group of one stream, decoding entries into `typ`, and of the lanes beside it.

    An entry that cannot be decoded goes to the dead-letter stream with the error and is acknowledged:
    the worker goes on.

    Lanes are more streams of the same group, read before the main one: a scheduler's own stream and those of
    departed peers it drains (docs/design.md, "Prefix-aware routing"). `lane_key` names a lane's stream, which
    must lie in the main stream's hash slot (one XREADGROUP reads them all). An entry of a lane is known by the
    reference `<lane>/<entry id>` (an entry id has no `/`), of the main stream by its id: whatever takes an id
    here (acknowledge, touch, hand back) takes a reference, so a worker holds entries of several streams as it
    holds those of one.
    """

    def __init__(self, redis: Redis, key: str, group: str, consumer: str, typ: type[M], dead_key: str,
                 lane_key: Callable[[str], str] | None = None):
        self.redis, self.key, self.group, self.consumer = redis, key, group, consumer
        self.typ, self.dead_key = typ, dead_key
        self.lane_key = lane_key
        self.lanes: dict[str, bool] = {}  # lane -> create its stream if missing; in reading order
        self._lane_at: dict[str, str] = {}  # stream key -> lane
        self.cursors: dict[str, str] = {}  # XAUTOCLAIM cursor per stream key

    # -- references: which stream an entry is in
    def ref(self, key: str, entry_id: str) -> str:
        return entry_id if key == self.key else f"{self._lane_at[key]}/{entry_id}"

    def locate(self, ref: str) -> tuple[str, str]:
        """(stream key, entry id) of a reference."""
        lane, sep, entry_id = ref.rpartition("/")
        if not sep or self.lane_key is None:
            return self.key, ref
        return self.lane_key(lane), entry_id

    def by_stream(self, refs: Sequence[str]) -> dict[str, list[str]]:
        """Entry ids per stream key, in the order given."""
        out: dict[str, list[str]] = {}
        for r in refs:
            key, entry_id = self.locate(r)
            out.setdefault(key, []).append(entry_id)
        return out

    def streams(self) -> list[str]:
        """Every stream this consumer reads, lanes first."""
        return [*self._lane_at, self.key]

    # -- groups and lanes
    async def ensure_group(self) -> None:
        """Create the group at 0, not `$`, so a backlog written before the first worker is read (on the main
        stream and every lane; a lane not made here whose stream is gone is let go)."""
        await self._create(self.key, mkstream=True)
        for key, lane in list(self._lane_at.items()):
            if not await self._create(key, mkstream=self.lanes[lane]):
                self.drop_lane(lane)

    async def _create(self, key: str, mkstream: bool) -> bool:
        """Whether `key` has the group now."""
        try:
            await self.redis.xgroup_create(key, self.group, id="0", mkstream=mkstream)
        except ResponseError as e:
            if "BUSYGROUP" in str(e):
                return True
            if not mkstream:  # "requires the key to exist": the stream is gone
                return False
            raise
        return True

    async def add_lane(self, lane: str, create: bool) -> bool:
        """Read `lane` too (before the main stream, after earlier lanes); `create`: make its stream if missing,
        else a lane whose stream is gone is not added. Whether it is read now."""
        if lane in self.lanes:
            return True
        assert self.lane_key is not None, "this consumer has no lanes"
        key = self.lane_key(lane)
        if not await self._create(key, mkstream=create):
            return False
        self.lanes[lane] = create
        self._lane_at[key] = lane
        return True

    def drop_lane(self, lane: str) -> None:
        """Stop reading and claiming a lane (entries already held there stay ours, acknowledged as before)."""
        if self.lanes.pop(lane, None) is not None and self.lane_key is not None:
            key = self.lane_key(lane)
            self._lane_at.pop(key, None)
            self.cursors.pop(key, None)

    # -- reading and claiming
    async def read(self, count: int, block_ms: int | None) -> list[Delivery[M]]:
        """New entries (`>`). Recreates the group if it vanished (Redis restarted or key deleted)."""
        try:
            if self.lanes:
                return await self._read_lanes(count, block_ms)
            resp = await self.redis.xreadgroup(self.group, self.consumer, {self.key: ">"},
                                               count=count, block=block_ms)
        except ResponseError as e:
            # UNBLOCKED: a stream a blocked read waited on was deleted (a peer ended a lane we drained too)
            if "NOGROUP" not in str(e) and "UNBLOCKED" not in str(e):
                raise
            log.warning("group %s on %s missing; recreating", self.group, self.key)
            await self.ensure_group()
            return []
        entries = resp[0][1] if resp else []
        return await self.decode_all([(_s(eid), f) for eid, f in entries])

    async def _read_lanes(self, count: int, block_ms: int | None) -> list[Delivery[M]]:
        """Up to `count` entries, lanes first (one script); if none and `block_ms`, one XREADGROUP BLOCK over all
        streams, at most count / streams from each, so that it never takes more than `count` either."""
        keys = self.streams()
        got, missing = await self.redis.eval(_READ_IN_ORDER, len(keys), *keys, self.group, self.consumer, count)
        if missing:
            log.warning("group %s missing on %s; recreating", self.group, ", ".join(_s(k) for k in missing))
            await self.ensure_group()
        entries = [(self.ref(_s(key), _s(eid)), _fields(f)) for key, rows in got for eid, f in rows]
        if not entries and block_ms is not None and not missing:
            resp = await self.redis.xreadgroup(self.group, self.consumer, dict.fromkeys(keys, ">"),
                                               count=max(1, count // len(keys)), block=block_ms)
            entries = [(self.ref(_s(key), _s(eid)), f) for key, rows in resp or [] for eid, f in rows]
        return await self.decode_all(entries)

    async def claim(self, min_idle_ms: int, count: int) -> list[Delivery[M]]:
        """Take over entries another consumer has held longer than min_idle_ms (it died or hung), up to `count`
        from each stream (one round trip for all).

        XAUTOCLAIM scans at most count x 10 pending entries per call, so the cursor it returns is where the
        next call goes on: starting every call at 0-0 would never get past live peers' many entries to a dead
        one's behind them. It comes back to 0-0 when the scan has gone round."""
        keys = self.streams()
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.xautoclaim(key, self.group, self.consumer, min_idle_time=min_idle_ms,
                                start_id=self.cursors.get(key, "0-0"), count=count)
            results = await pipe.execute(raise_on_error=False)
        live: list[tuple[str, dict[bytes, bytes]]] = []
        for key, result in zip(keys, results, strict=True):
            if isinstance(result, ResponseError):
                if "NOGROUP" not in str(result):
                    raise result
                await self.ensure_group()
                continue
            nxt, entries = result[0], result[1]
            self.cursors[key] = _s(nxt)
            live += [(self.ref(key, _s(eid)), f) for eid, f in entries if f is not None]
        return await self.decode_all(live)

    async def touch(self, ids: Sequence[str]) -> list[str]:
        """Reset the idle time of the entries we hold and still work on, so that peers claim only the entries
        of a consumer that died or hung; returns those of `ids` no longer ours (a peer claimed them while we
        were stalled). Only entries still ours are touched, checked and claimed in one script per stream:
        XCLAIM would take a peer's entry back (a SIGSTOP between a check and a claim is enough), and the two
        owners would take it from each other for ever."""
        if not ids:
            return []
        per_stream = self.by_stream(ids)
        # EVAL, not EVALSHA, as in Appender.queue
        async with self.redis.pipeline(transaction=False) as pipe:
            for key, entry_ids in per_stream.items():
                pipe.eval(_TOUCH, 1, key, self.group, self.consumer, *entry_ids)
            lost = await pipe.execute()
        return [self.ref(key, _s(i)) for key, gone in zip(per_stream, lost, strict=True) for i in gone]

    async def hand_back(self, ids: Sequence[str], to_consumer: str) -> None:
        """Give pending entries to another consumer name with idle time maxed, so a peer's claim
        takes them at once (graceful shutdown)."""
        for key, entry_ids in self.by_stream(ids).items():
            await self.redis.xclaim(key, self.group, to_consumer, min_idle_time=0,
                                    message_ids=entry_ids, idle=10**9, justid=True)

    # -- upkeep
    async def remove_departed(self, alive: set[str], idle_ms: int) -> list[str]:
        """XGROUP DELCONSUMER every consumer that holds nothing and is not alive (its process is gone; the
        hand-back consumer once emptied), idle for `idle_ms` at least, on every stream this consumer reads:
        group metadata would otherwise grow with every process ever started. A consumer with pending entries
        is kept: deleting it would drop them."""
        gone: list[str] = []
        for key in self.streams():
            try:
                consumers = await self.redis.xinfo_consumers(key, self.group)
            except ResponseError:
                continue
            names = [_s(c["name"]) for c in consumers
                     if not c["pending"] and _s(c["name"]) not in alive and int(c["idle"]) >= idle_ms]
            if names:
                # Checked again in the script that deletes: a consumer that took an entry since XINFO (a frozen
                # process let go) would lose it from the pending list with the consumer, and nobody would claim it.
                deleted = await self.redis.eval(_DELETE_IF_EMPTY, 1, key, self.group, *names)
                gone += [_s(n) for n in deleted]
        return gone

    async def holders(self) -> set[str]:
        """The consumers holding entries of the main stream."""
        try:
            consumers = await self.redis.xinfo_consumers(self.key, self.group)
        except ResponseError:
            return set()
        return {_s(c["name"]) for c in consumers if c["pending"]}

    async def claim_from(self, consumers: Sequence[str], min_idle_ms: int, count: int) -> list[Delivery[M]]:
        """Take over up to `count` entries of the main stream that `consumers` (processes known to be gone) hold,
        each idle at least `min_idle_ms`: one a peer claimed a moment ago stays the peer's."""
        ids: list[str] = []
        for name in consumers:
            rows = await self.redis.xpending_range(self.key, self.group, "-", "+", count - len(ids),
                                                   consumername=name, idle=min_idle_ms)
            ids += [_s(r["message_id"]) for r in rows]
            if len(ids) >= count:
                break
        if not ids:
            return []
        entries = await self.redis.xclaim(self.key, self.group, self.consumer, min_idle_ms, ids)
        return await self.decode_all([(_s(eid), f) for eid, f in entries if f])

    async def pending_ids(self, count: int = 1000) -> list[str]:
        """References of the entries this consumer holds, on every stream it reads."""
        out = []
        for key in self.streams():
            rows = await self.redis.xpending_range(key, self.group, "-", "+", count, consumername=self.consumer)
            out += [self.ref(key, _s(r["message_id"])) for r in rows]
        return out

    async def trim_acknowledged(self) -> None:
        """XTRIM MINID below the oldest entry any group still needs (its oldest pending entry, else its
        last delivered one), on every stream this consumer reads: acknowledged entries would otherwise stay in
        the stream forever."""
        for key in self.streams():
            await trim_acknowledged(self.redis, key)

    def ack_in(self, target: Target, ids: Sequence[str]) -> Any:
        if not ids:
            return None
        return [ack(target, key, self.group, entry_ids) for key, entry_ids in self.by_stream(ids).items()]

    async def ack(self, ids: Sequence[str]) -> None:
        for key, entry_ids in self.by_stream(ids).items():
            await ack(self.redis, key, self.group, entry_ids)

    async def delivery_counts(self, ids: Sequence[str]) -> dict[str, int]:
        """entry reference -> times delivered, for pending entries among `ids` (one XPENDING per id, pipelined)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for ref in ids:
                key, entry_id = self.locate(ref)
                pipe.xpending_range(key, self.group, entry_id, entry_id, 1)
            rows = await pipe.execute()
        return {ref: int(r[0]["times_delivered"]) for ref, r in zip(ids, rows, strict=True) if r}

    async def decode_all(self, entries: list[tuple[str, dict[bytes, bytes]]]) -> list[Delivery[M]]:
        out: list[Delivery[M]] = []
        poison: list[tuple[str, dict[bytes, bytes], str]] = []
        for eid, fields in entries:
            try:
                out.append(Delivery(eid, decode(payload(fields), self.typ)))
            except (KeyError, msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as e:
                poison.append((eid, fields, f"{type(e).__name__}: {e}"))
        if poison:
            await self.dead_letter(poison)
        return out

    async def dead_letter(self, bad: list[tuple[str, dict[bytes, bytes], str]]) -> None:
        """Move entries that cannot be processed to the dead-letter stream, then acknowledge them."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for ref, fields, error in bad:
                key, entry_id = self.locate(ref)
                log.error("dead-lettering %s %s: %s", key, entry_id, error)
                raw = {f"raw_{_s(k)}": v for k, v in fields.items()}
                add_fields(pipe, self.dead_key, {**raw, "stream": key, "group": self.group,
                                                 "entry_id": entry_id, "error": error[:2000],
                                                 "at": f"{time.time():.3f}"}, maxlen=10_000)
            self.ack_in(pipe, [ref for ref, _, _ in bad])
            await pipe.execute()


def _fields(flat: list) -> dict[bytes, bytes]:
    """An entry's fields as a script returns them (a flat list) as XREADGROUP's reply gives them."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


async def trim_acknowledged(redis: Redis, key: str) -> None:
    """XTRIM MINID below the oldest entry any group of `key` still needs (its oldest pending entry, else its last
    delivered one)."""
    try:
        groups = await redis.xinfo_groups(key)
    except ResponseError:
        return  # no such stream yet
    floors = []
    for g in groups:
        pending = await redis.xpending(key, g["name"])
        floors.append(_s(pending["min"]) if pending["pending"] else _s(g["last-delivered-id"]))
    if floors:
        floor = min(floors, key=_id_tuple)
        if floor != "0-0":
            await redis.xtrim(key, minid=floor, approximate=True)


def end_if_drained(target: Target, key: str, group: str, companion: str, registry: str, member: str) -> Any:
    """Delete a stream no one should write to any more once nothing in it is left to run (no entry pending in
    `group`, none undelivered), with its `companion` key, and remove `member` from the `registry` set; all in one
    script (the three keys share a slot), so an entry XADDed meanwhile is never deleted with it. Its reply is 1
    if the stream was ended (one already gone counts), else 0. On a pipeline it is queued."""
    return target.eval(_END_IF_DRAINED, 3, key, companion, registry, group, member)


Handler = Callable[[list[tuple[str, dict[bytes, bytes]]], bool], Awaitable[None]]
READ_BLOCK_MS = 1000
CLAIM_POLL_MS = 500  # claims are cheap; polling often is what makes a hand-back "at once"
READ_RETRY_S = 0.5


def _retry_failed_reads_sooner() -> None:
    """FastStream's subscribers wait 5 s after a read that failed before the next: every Redis outage, and every
    cluster failover (a replica takes over within seconds), would leave the tokenizer and
    detokenizer idle 5 s longer than the rest of the pipeline, whose loops retry within 2 s."""
    from faststream.redis.subscriber.usecases import basic, stream_subscriber

    for module in (basic, stream_subscriber):
        if hasattr(module, "CONSUME_ERROR_BACKOFF_SECONDS"):
            module.CONSUME_ERROR_BACKOFF_SECONDS = READ_RETRY_S


def subscribe(broker: RedisBroker, key: str, group: str, consumer: str, batch_size: int, claim_idle_ms: int,
              handler: Handler, title: str, description: str) -> list[Any]:
    """Two FastStream subscribers of one stream in one group: new entries in batches of up to `batch_size`,
    and entries idle past `claim_idle_ms` in other consumers' hands, one at a time. Both call
    `handler(entries, claimed)` with the raw entries [(entry_id, fields)]; nothing is acknowledged for it.
    The broker should have `apply_types=False`: the handlers take the entries as they come (our parser puts
    them in the message body), with no dependency injection or JSON work per read."""
    from faststream import AckPolicy
    from faststream.redis import StreamSub

    _retry_failed_reads_sooner()

    async def fresh(entries: list[tuple[str, dict[bytes, bytes]]]) -> None:
        await handler(entries, False)

    async def claimed(entries: list[tuple[str, dict[bytes, bytes]]]) -> None:
        await handler(entries, True)

    class Sub(StreamSub):
        def add_prefix(self, prefix: str) -> Sub:
            # FastStream asks for the prefixed stream on every read, and builds it by deepcopy (~50 µs).
            return super().add_prefix(prefix) if prefix else self

    reader = Sub(key, group=group, consumer=consumer, batch=True, max_records=batch_size,
                 polling_interval=READ_BLOCK_MS)
    claimer = Sub(key, group=group, consumer=consumer, min_idle_time=claim_idle_ms, polling_interval=CLAIM_POLL_MS)
    subscribers = [broker.subscriber(stream=reader, parser=_entries, decoder=_body, ack_policy=AckPolicy.MANUAL,
                                     title=title, description=description),
                   broker.subscriber(stream=claimer, parser=_entries, decoder=_body, ack_policy=AckPolicy.MANUAL,
                                     include_in_schema=False)]
    for sub, fn in zip(subscribers, (fresh, claimed), strict=True):
        sub(fn)
    return subscribers


async def _entries(msg: Any, _original: Any) -> Any:
    """FastStream's parser minus its JSON work: the body is the raw entries (decoding them is ours)."""
    from faststream.redis.message import RedisBatchStreamMessage, RedisStreamMessage

    ids, data = msg["message_ids"], msg["data"]
    if msg["type"] == "bstream":
        return RedisBatchStreamMessage(raw_message=msg, body=[(_s(i), f) for i, f in zip(ids, data, strict=True)],
                                       consumer=None, group=None)
    return RedisStreamMessage(raw_message=msg, body=[(_s(ids[0]), data)], consumer=None, group=None)


async def _body(msg: Any, _original: Any) -> Any:
    return msg.body
