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
    so an entry is never acknowledged while its result is lost."""
    barrier(target)
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
    """One consumer in one consumer group of one stream, decoding entries into `typ`.

    An entry that cannot be decoded goes to the dead-letter stream with the error and is acknowledged:
    the worker goes on.
    """

    def __init__(self, redis: Redis, key: str, group: str, consumer: str, typ: type[M], dead_key: str):
        self.redis, self.key, self.group, self.consumer = redis, key, group, consumer
        self.typ, self.dead_key = typ, dead_key
        self.claim_cursor = "0-0"

    async def ensure_group(self) -> None:
        """Create the group at 0, not `$`, so a backlog written before the first worker is read."""
        try:
            await self.redis.xgroup_create(self.key, self.group, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def read(self, count: int, block_ms: int | None) -> list[Delivery[M]]:
        """New entries (`>`). Recreates the group if it vanished (Redis restarted or key deleted)."""
        try:
            resp = await self.redis.xreadgroup(self.group, self.consumer, {self.key: ">"},
                                               count=count, block=block_ms)
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            log.warning("group %s on %s missing; recreating", self.group, self.key)
            await self.ensure_group()
            return []
        entries = resp[0][1] if resp else []
        return await self.decode_all([(_s(eid), f) for eid, f in entries])

    async def claim(self, min_idle_ms: int, count: int) -> list[Delivery[M]]:
        """Take over entries another consumer has held longer than min_idle_ms (it died or hung).

        XAUTOCLAIM scans at most count x 10 pending entries per call, so the cursor it returns is where the
        next call goes on: starting every call at 0-0 would never get past live peers' many entries to a dead
        one's behind them. It comes back to 0-0 when the scan has gone round."""
        try:
            nxt, entries, _deleted = await self.redis.xautoclaim(
                self.key, self.group, self.consumer, min_idle_time=min_idle_ms, start_id=self.claim_cursor,
                count=count)
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            await self.ensure_group()
            return []
        self.claim_cursor = _s(nxt)
        live = [(_s(eid), f) for eid, f in entries if f is not None]
        return await self.decode_all(live)

    async def touch(self, ids: Sequence[str]) -> list[str]:
        """Reset the idle time of the entries we hold and still work on, so that peers claim only the entries
        of a consumer that died or hung; returns those of `ids` no longer ours (a peer claimed them while we
        were stalled). Only entries still ours are touched, checked and claimed in one script: XCLAIM would
        take a peer's entry back (a SIGSTOP between a check and a claim is enough), and the two owners would
        take it from each other for ever."""
        if not ids:
            return []
        # EVAL, not EVALSHA, as in Appender.queue
        lost = await self.redis.eval(_TOUCH, 1, self.key, self.group, self.consumer, *ids)
        return [_s(i) for i in lost]

    async def hand_back(self, ids: Sequence[str], to_consumer: str) -> None:
        """Give pending entries to another consumer name with idle time maxed, so a peer's claim
        takes them at once (graceful shutdown)."""
        if ids:
            await self.redis.xclaim(self.key, self.group, to_consumer, min_idle_time=0,
                                    message_ids=list(ids), idle=10**9, justid=True)

    async def remove_departed(self, alive: set[str], idle_ms: int) -> list[str]:
        """XGROUP DELCONSUMER every consumer that holds nothing and is not alive (its process is gone; the
        hand-back consumer once emptied), idle for `idle_ms` at least: group metadata would otherwise grow with
        every process ever started. A consumer with pending entries is kept: deleting it would drop them."""
        try:
            consumers = await self.redis.xinfo_consumers(self.key, self.group)
        except ResponseError:
            return []
        gone = [_s(c["name"]) for c in consumers
                if not c["pending"] and _s(c["name"]) not in alive and int(c["idle"]) >= idle_ms]
        if gone:
            async with self.redis.pipeline(transaction=False) as pipe:
                for name in gone:
                    pipe.xgroup_delconsumer(self.key, self.group, name)
                await pipe.execute()
        return gone

    async def pending_ids(self, count: int = 1000) -> list[str]:
        rows = await self.redis.xpending_range(self.key, self.group, "-", "+", count,
                                               consumername=self.consumer)
        return [_s(r["message_id"]) for r in rows]

    async def trim_acknowledged(self) -> None:
        """XTRIM MINID below the oldest entry any group still needs (its oldest pending entry, else its
        last delivered one): acknowledged entries would otherwise stay in the stream forever."""
        try:
            groups = await self.redis.xinfo_groups(self.key)
        except ResponseError:
            return  # no such stream yet
        floors = []
        for g in groups:
            pending = await self.redis.xpending(self.key, g["name"])
            floors.append(_s(pending["min"]) if pending["pending"] else _s(g["last-delivered-id"]))
        if floors:
            floor = min(floors, key=_id_tuple)
            if floor != "0-0":
                await self.redis.xtrim(self.key, minid=floor, approximate=True)

    def ack_in(self, target: Target, ids: Sequence[str]) -> Any:
        return ack(target, self.key, self.group, ids) if ids else None

    async def ack(self, ids: Sequence[str]) -> None:
        if ids:
            await ack(self.redis, self.key, self.group, ids)

    async def delivery_counts(self, ids: Sequence[str]) -> dict[str, int]:
        """entry id -> times delivered, for pending entries among `ids` (one XPENDING per id, pipelined)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for eid in ids:
                pipe.xpending_range(self.key, self.group, eid, eid, 1)
            rows = await pipe.execute()
        return {_s(r[0]["message_id"]): int(r[0]["times_delivered"]) for r in rows if r}

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
            for eid, fields, error in bad:
                log.error("dead-lettering %s %s: %s", self.key, eid, error)
                raw = {f"raw_{_s(k)}": v for k, v in fields.items()}
                add_fields(pipe, self.dead_key, {**raw, "stream": self.key, "group": self.group,
                                                 "entry_id": eid, "error": error[:2000],
                                                 "at": f"{time.time():.3f}"}, maxlen=10_000)
            ack(pipe, self.key, self.group, [eid for eid, _, _ in bad])
            await pipe.execute()


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
