"""Redis Streams, the commands: the only module that calls XADD, XREAD, XREADGROUP, XACK, XAUTOCLAIM, XCLAIM,
XPENDING, XINFO, XGROUP and XTRIM, and the Lua scripts that combine them (shared/data/*.lua). Each function here
is one command, one pipeline of the same command over several streams, or one script; on a pipeline it is queued.
What to do with the entries is the layers above: shared/consumer_group.py (a consumer group with lanes, claims,
touch, hand-back and dead letters) and shared/faststream_glue.py (FastStream as the tokenizer's and detokenizer's
consume loop: it reads through FastStream's own calls, and writes and acknowledges through these).

Every entry is one field, `data`, holding the JSON of one message of shared/messages.py, so `redis-cli
XRANGE` shows it as it is (FastStream's own publishing would write its binary envelope; we only read with it).
An entry is acknowledged in the pipeline that writes its output (`ack`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import ResponseError

from shared.messages import encode
from shared.redis_conn import barrier, scripts_flagged

FIELD = b"data"
Target = Redis | Pipeline
Rows = list[tuple[str, dict[bytes, bytes]]]  # (entry id, fields), in stream order
KeyedRows = list[tuple[str, str, dict[bytes, bytes]]]  # (stream key, entry id, fields)


@dataclass(frozen=True, slots=True)
class Member:
    """One consumer of one consumer group: the two names every group command that reads, claims or touches takes
    together."""

    group: str
    consumer: str


def as_str(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def _script(name: str) -> str:
    """The Lua script shared/data/<name>.lua, without its comment lines (EVAL sends the text on every call)."""
    text = (Path(__file__).parent / "data" / f"{name}.lua").read_text()
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith("--"))


# -- writing ---------------------------------------------------------------------------------------------------
def add(target: Target, key: str, msg: msgspec.Struct, maxlen: int | None = None) -> Any:
    """XADD one message. On a pipeline it is queued; on a client it returns an awaitable of the id."""
    return target.xadd(key, {FIELD: encode(msg)}, maxlen=maxlen, approximate=True)


def add_data(target: Target, key: str, data: bytes, maxlen: int | None = None) -> Any:
    """XADD one message its caller has encoded already (`encode(msg)`: e.g. to know its size)."""
    return target.xadd(key, {FIELD: data}, maxlen=maxlen, approximate=True)


def add_fields(target: Target, key: str, fields: dict[str, Any], maxlen: int | None = None) -> Any:
    """XADD an untyped entry (dead letters, abort notifications and control wake-ups, which are not messages)."""
    return target.xadd(key, fields, maxlen=maxlen, approximate=True)


# The Lua scripts that combine stream commands live beside this module (shared/data/*.lua), each with the
# why of it in its comments.
_APPEND = _script("append")
_TOUCH = _script("touch_own")
_ACK_OWN = _script("ack_own")
_READ_IN_ORDER = _script("read_in_order")
_END_IF_DRAINED = _script("end_if_drained")
_DELETE_IF_EMPTY = _script("delete_consumers_if_empty")
# Flagged (without `allow-oom`): Redis 7+ refuses such a script whole when it is at its maxmemory (`ack`)
_ACK_FLAGGED = "#!lua\nreturn redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 2))\n"
_ACK_OWN_FLAGGED = "#!lua\n" + _ACK_OWN


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


# -- acknowledging ---------------------------------------------------------------------------------------------
def ack(target: Target, key: str, group: str, ids: Sequence[str]) -> Any:
    """XACK; on a pipeline, after everything queued before it has landed (on a cluster too: redis_conn.barrier),
    so an entry is never acknowledged while its result is lost.

    On a standalone Redis's pipeline the XACK goes in a MULTI/EXEC of its own. A Redis at its maxmemory
    (noeviction) refuses the writes before it (XADD, HSET) with OOM, but not a plain XACK: the entry would be
    acknowledged with its result refused. A command queued in MULTI is refused under OOM too, so the entry stays
    pending and is handled again once Redis has room (its writes, if they did land, are written again: every
    stage drops such duplicates, as after a crash). A cluster's pipeline stops at the barrier already.
    On a Redis that takes script flags the XACK goes in a flagged script instead, refused under OOM as the MULTI
    is: one command sent, not three (shared/redis_conn.py `scripts_flagged`)."""
    return _in_own_transaction(target, lambda t: t.xack(key, group, *ids),
                               lambda t: t.eval(_ACK_FLAGGED, 1, key, group, *ids))


def ack_own(target: Target, key: str, member: Member, ids: Sequence[str]) -> Any:
    """`ack` of only those of `ids` that `member` still holds. A worker that was stalled (SIGSTOP) past the claim
    idle time can end a request a peer has since taken over, and a plain XACK would end the peer's entry too:
    the peer would then drop the request as taken from it, and nobody would finish it."""
    args = (1, key, member.group, member.consumer, *_id_range(ids), *ids)
    return _in_own_transaction(target, lambda t: t.eval(_ACK_OWN, *args), lambda t: t.eval(_ACK_OWN_FLAGGED, *args))


def _in_own_transaction(target: Target, queue: Callable[[Any], Any], flagged: Callable[[Any], Any]) -> Any:
    """`queue` on `target` after a barrier, in a MULTI/EXEC of its own on a standalone Redis's pipeline, or there
    `flagged` (a script refused whole under OOM too) where the server takes script flags."""
    barrier(target)
    if isinstance(target, Pipeline) and not target.is_transaction:
        if scripts_flagged():
            return flagged(target)
        target.execute_command("MULTI")
        queue(target)
        return target.execute_command("EXEC")
    return queue(target)


async def ack_delete(redis: Redis, key: str, group: str, ids: Sequence[str]) -> None:
    """XACK, then XDEL, for a stream that one group reads: what it acknowledged nobody needs, so the stream holds
    only what is still to do (an entry acknowledged but not deleted, by a crash between the two, is left to
    `trim_acknowledged`)."""
    await redis.xack(key, group, *ids)
    await redis.xdel(key, *ids)


# -- reading without a group -----------------------------------------------------------------------------------
def lean_reads(client: Any) -> None:
    """Have `client`'s XREAD replies come as `read` returns them, each entry's payload taken straight from the
    reply: redis-py would build a dict of every entry's fields and `read` a list of each. Only for a client
    of its own that reads nothing but `read` (the reply hub's shards)."""
    client.set_response_callback("XREAD", _payloads)


def _payloads(resp: Any, **_options: Any) -> list[tuple[str, list[tuple[str, bytes]]]]:
    """XREAD's reply as RESP3 ({key: entries}) or RESP2 ([[key, entries]]) gives it, each entry [id, [field,
    value, ...]], as [(key, [(entry_id, payload)])]; an entry without the `data` field has an empty payload."""
    rows = resp.items() if isinstance(resp, dict) else resp or ()
    return [(as_str(key), [(as_str(eid), _field(flat)) for eid, flat in entries]) for key, entries in rows]


def _field(flat: list) -> bytes:
    if len(flat) == 2 and flat[0] == FIELD:  # every entry but a control stream's
        return flat[1]
    return dict(zip(flat[::2], flat[1::2], strict=True)).get(FIELD, b"")


async def read(redis: Redis, positions: dict[str, str], count: int, block_ms: int | None
               ) -> list[tuple[str, list[tuple[str, bytes]]]]:
    """XREAD over many streams from the given ids, on a client set up by `lean_reads`; returns [(key,
    [(entry_id, payload)])]."""
    return await redis.xread(positions, count=count, block=block_ms) or []


async def read_range(redis: Redis, key: str, after: str = "-", count: int | None = None
                     ) -> list[tuple[str, dict[bytes, bytes]]]:
    """XRANGE from `after` (exclusive when it is an id) to the end."""
    start = "-" if after in ("-", "0", "0-0") else f"({after}"
    return [(as_str(eid), fields) for eid, fields in await redis.xrange(key, start, "+", count=count)]


def queue_read(pipe: Pipeline, positions: dict[str, str], count: int) -> Any:
    """XREAD (not blocking) queued on a pipeline; its reply is redis-py's: [[key, [(entry_id, fields)]]]."""
    return pipe.xread(positions, count=count)


def queue_range(pipe: Pipeline, key: str) -> Any:
    """XRANGE of a whole stream queued on a pipeline; its reply is [(entry_id, fields)]."""
    return pipe.xrange(key)


def queue_info(pipe: Pipeline, key: str) -> Any:
    """XINFO STREAM queued on a pipeline (see `was_trimmed`)."""
    return pipe.xinfo_stream(key)


def queue_groups(pipe: Pipeline, key: str) -> Any:
    """XINFO GROUPS queued on a pipeline (see `unfinished`); a missing stream's reply is a ResponseError (run the
    pipeline with raise_on_error=False)."""
    return pipe.xinfo_groups(key)


def unfinished(groups_reply: Any, group: str) -> int:
    """From an XINFO GROUPS reply: the entries `group` holds unacknowledged (pending) or has yet to read (its lag;
    nil after an XDEL in the range: counted 0); 0 for a missing stream or group."""
    if isinstance(groups_reply, Exception):
        return 0
    mine = next((g for g in groups_reply if as_str(g["name"]) == group), None)
    return 0 if mine is None else int(mine.get("pending") or 0) + int(mine.get("lag") or 0)


async def last_id(redis: Redis, key: str) -> str | None:
    """The id of a stream's newest entry (XREVRANGE COUNT 1); None if it has none."""
    tip = await redis.xrevrange(key, count=1)
    return as_str(tip[0][0]) if tip else None


async def length(redis: Redis, key: str) -> int:
    """XLEN."""
    return int(await redis.xlen(key))


def id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _id_range(ids: Sequence[str]) -> tuple[str, str]:
    """The lowest and the highest of some entry ids (shared/data/ack_own.lua and touch_own.lua read what a
    consumer holds between them in one XPENDING)."""
    return min(ids, key=id_tuple), max(ids, key=id_tuple)


def id_after(entry_id: str, other: str) -> bool:
    """`entry_id` comes later in a stream than `other` (which, unreadable, counts as before everything)."""
    try:
        return id_tuple(entry_id) > id_tuple(other)
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
    return as_str(info["first-entry"][0])


def was_trimmed(info: dict) -> bool:
    """From XINFO STREAM: entries were removed from the stream (MAXLEN trimmed its head)."""
    return int(info["entries-added"]) > int(info["length"])


def payload(fields: dict[bytes, bytes]) -> bytes:
    return fields[FIELD]


def fields_of(flat: list) -> dict[bytes, bytes]:
    """An entry's fields as a script returns them (a flat list) as XREADGROUP's reply gives them."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


# -- consumer groups -------------------------------------------------------------------------------------------
async def create_group(redis: Redis, key: str, group: str, mkstream: bool) -> bool:
    """XGROUP CREATE at 0, not `$`, so a backlog written before the first consumer is read. Whether `key` has the
    group now (False: the stream is gone and `mkstream` was not asked)."""
    try:
        await redis.xgroup_create(key, group, id="0", mkstream=mkstream)
    except ResponseError as e:
        if "BUSYGROUP" in str(e):
            return True
        if not mkstream:  # "requires the key to exist": the stream is gone
            return False
        raise
    return True


async def groups(redis: Redis, key: str) -> list[dict]:
    """XINFO GROUPS; raises ResponseError if the stream does not exist."""
    return await redis.xinfo_groups(key)


async def undelivered(redis: Redis, keys: Sequence[str], group: str, cap: int) -> int:
    """Entries of `keys` that `group` has not been delivered yet (its lag), each stream's counted up to `cap`:
    one pipeline of XINFO GROUPS, and an XRANGE after the group's last delivered id, at most `cap` long, for a
    stream whose lag Redis cannot tell (nil after an XDEL in the range) or that has no such group yet (all of it
    waits). A missing stream counts 0."""
    async with redis.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.xinfo_groups(key)
        infos = await pipe.execute(raise_on_error=False)
    total, unknown = 0, []
    for key, info in zip(keys, infos, strict=True):
        if isinstance(info, ResponseError):  # no such key
            continue
        mine = next((g for g in info if as_str(g["name"]) == group), None)
        if mine is not None and mine.get("lag") is not None:
            total += min(cap, int(mine["lag"]))
        else:
            unknown.append((key, "-" if mine is None else as_str(mine["last-delivered-id"])))
    for key, after in unknown:
        total += len(await read_range(redis, key, after, cap))
    return total


async def read_group(redis: Redis, keys: Sequence[str], member: Member, count: int, block_ms: int | None
                     ) -> KeyedRows:
    """XREADGROUP of new entries (`>`) over `keys`, up to `count` from each; [(key, entry_id, fields)]."""
    resp = await redis.xreadgroup(member.group, member.consumer, dict.fromkeys(keys, ">"), count=count,
                                  block=block_ms)
    return [(as_str(key), as_str(eid), fields) for key, entries in resp or [] for eid, fields in entries]


async def read_group_each(redis: Redis, counts: dict[str, int], member: Member) -> dict[str, Rows | ResponseError]:
    """XREADGROUP of new entries of each stream, up to its own count, in one round trip (never blocking): per key,
    its entries or its error (NOGROUP: the stream was made again, or its group is gone)."""
    async with redis.pipeline(transaction=False) as pipe:
        for key, count in counts.items():
            pipe.xreadgroup(member.group, member.consumer, {key: ">"}, count=count)
        results = await pipe.execute(raise_on_error=False)
    return {key: r if isinstance(r, ResponseError) else [(as_str(e), f) for _, entries in r or [] for e, f in entries]
            for key, r in zip(counts, results, strict=True)}


async def read_group_in_order(redis: Redis, keys: Sequence[str], member: Member, count: int
                              ) -> tuple[KeyedRows, list[str]]:
    """New entries of `keys` read in that order, up to `count` in all (one script, never blocking), and the keys
    whose group is missing."""
    got, missing = await redis.eval(_READ_IN_ORDER, len(keys), *keys, member.group, member.consumer, count)
    rows = [(as_str(key), as_str(eid), fields_of(f)) for key, entries in got for eid, f in entries]
    return rows, [as_str(k) for k in missing]


async def autoclaim(redis: Redis, cursors: dict[str, str], member: Member, min_idle_ms: int, count: int
                    ) -> dict[str, tuple[str, Rows] | ResponseError]:
    """XAUTOCLAIM on each stream from its cursor, in one round trip: per key, the next cursor and the entries
    claimed (those deleted meanwhile left out), or the error (NOGROUP: the group is gone)."""
    async with redis.pipeline(transaction=False) as pipe:
        for key, cursor in cursors.items():
            pipe.xautoclaim(key, member.group, member.consumer, min_idle_time=min_idle_ms, start_id=cursor,
                            count=count)
        results = await pipe.execute(raise_on_error=False)
    out: dict[str, tuple[str, Rows] | ResponseError] = {}
    for key, result in zip(cursors, results, strict=True):
        out[key] = result if isinstance(result, ResponseError) else \
            (as_str(result[0]), [(as_str(eid), f) for eid, f in result[1] if f is not None])
    return out


async def touch_own(redis: Redis, ids_by_key: dict[str, list[str]], member: Member) -> dict[str, list[str]]:
    """Reset the idle time of those of the entries that `member` still holds (one script per stream, pipelined);
    per key, the ids it no longer holds."""
    # EVAL, not EVALSHA, as in Appender.queue
    async with redis.pipeline(transaction=False) as pipe:
        for key, entry_ids in ids_by_key.items():
            pipe.eval(_TOUCH, 1, key, member.group, member.consumer, *_id_range(entry_ids), *entry_ids)
        lost = await pipe.execute()
    return {key: [as_str(i) for i in gone] for key, gone in zip(ids_by_key, lost, strict=True)}


async def hand_over(redis: Redis, key: str, group: str, to_consumer: str, ids: Sequence[str]) -> None:
    """XCLAIM entries for another consumer name with their idle time maxed (JUSTID)."""
    await redis.xclaim(key, group, to_consumer, min_idle_time=0, message_ids=list(ids), idle=10**9, justid=True)


async def claim(redis: Redis, key: str, member: Member, min_idle_ms: int, ids: Sequence[str]) -> Rows:
    """XCLAIM the entries among `ids` idle at least `min_idle_ms`; those deleted meanwhile left out."""
    entries = await redis.xclaim(key, member.group, member.consumer, min_idle_ms, list(ids))
    return [(as_str(eid), f) for eid, f in entries if f]


async def pending(redis: Redis, key: str, group: str, count: int, *, consumer: str | None = None,
                  idle_ms: int | None = None) -> list[str]:
    """XPENDING (extended form): ids of up to `count` pending entries, of `consumer` if given, idle at least
    `idle_ms` if given."""
    rows = await redis.xpending_range(key, group, "-", "+", count, consumername=consumer, idle=idle_ms)
    return [as_str(r["message_id"]) for r in rows]


async def delivery_counts(redis: Redis, group: str, entries: Sequence[tuple[str, str]]) -> list[int | None]:
    """Times delivered of each (key, entry id) (one XPENDING per entry, pipelined); None for one not pending."""
    async with redis.pipeline(transaction=False) as pipe:
        for key, entry_id in entries:
            pipe.xpending_range(key, group, entry_id, entry_id, 1)
        rows = await pipe.execute()
    return [int(r[0]["times_delivered"]) if r else None for r in rows]


async def consumers(redis: Redis, key: str, group: str) -> list[dict]:
    """XINFO CONSUMERS; raises ResponseError if the stream or the group does not exist."""
    return await redis.xinfo_consumers(key, group)


async def delete_consumers_if_empty(redis: Redis, key: str, group: str, names: Sequence[str]) -> list[str]:
    """XGROUP DELCONSUMER each of `names` that holds no entry, checked in the same script; those deleted."""
    return [as_str(n) for n in await redis.eval(_DELETE_IF_EMPTY, 1, key, group, *names)]


async def trim_acknowledged(redis: Redis, key: str) -> None:
    """XTRIM MINID below the oldest entry any group of `key` still needs (its oldest pending entry, else its last
    delivered one)."""
    try:
        found = await groups(redis, key)
    except ResponseError:
        return  # no such stream yet
    floors = []
    for g in found:
        pending = await redis.xpending(key, g["name"])
        floors.append(as_str(pending["min"]) if pending["pending"] else as_str(g["last-delivered-id"]))
    if floors:
        floor = min(floors, key=id_tuple)
        if floor != "0-0":
            await redis.xtrim(key, minid=floor, approximate=True)


def end_if_drained(target: Target, key: str, group: str, *, companion: str, registry: str, member: str) -> Any:
    """Delete a stream no one should write to any more once nothing in it is left to run (no entry pending in
    `group`, none undelivered), with its `companion` key, and remove `member` from the `registry` set; all in one
    script (the three keys share a slot), so an entry XADDed meanwhile is never deleted with it. Its reply is 1
    if the stream was ended (one already gone counts), else 0. On a pipeline it is queued."""
    return target.eval(_END_IF_DRAINED, 3, key, companion, registry, group, member)
