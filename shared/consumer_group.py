"""One consumer in a consumer group, and the lanes beside its stream: reading, claiming, touching, handing back,
dead-lettering, acknowledging and the group's upkeep, over the commands of shared/streams.py (this module issues
none itself).

The scheduler reads with `GroupConsumer` directly: it pulls new work only while its KV cache has room and holds
an entry for its request's whole life, which a push subscriber cannot express
(docs/design.md, "Measured facts behind the design"). The tokenizer and detokenizer are delivered entries by FastStream
(shared/faststream_glue.py) and use a `GroupConsumer` for everything else: creating the group, decoding,
acknowledging, touching, dead letters, upkeep.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared import streams
from shared.messages import decode
from shared.streams import Rows, Target

log = logging.getLogger(__name__)

M = TypeVar("M")
DEAD_LETTERS_MAXLEN = 10_000


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

    def __init__(self, redis: Redis, key: str, member: streams.Member, typ: type[M], dead_key: str, *,
                 lane_key: Callable[[str], str] | None = None):
        self.redis, self.key, self.member = redis, key, member
        self.group, self.consumer = member.group, member.consumer
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
        await streams.create_group(self.redis, self.key, self.group, mkstream=True)
        for key, lane in list(self._lane_at.items()):
            if not await streams.create_group(self.redis, key, self.group, mkstream=self.lanes[lane]):
                self.drop_lane(lane)

    async def add_lane(self, lane: str, create: bool) -> bool:
        """Read `lane` too (before the main stream, after earlier lanes); `create`: make its stream if missing,
        else a lane whose stream is gone is not added. Whether it is read now."""
        if lane in self.lanes:
            return True
        assert self.lane_key is not None, "this consumer has no lanes"
        key = self.lane_key(lane)
        if not await streams.create_group(self.redis, key, self.group, mkstream=create):
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
            rows = await streams.read_group(self.redis, (self.key,), self.member, count, block_ms)
        except ResponseError as e:
            # UNBLOCKED: a stream a blocked read waited on was deleted (a peer ended a lane we drained too)
            if "NOGROUP" not in str(e) and "UNBLOCKED" not in str(e):
                raise
            log.warning("group %s on %s missing; recreating", self.group, self.key)
            await self.ensure_group()
            return []
        return await self.decode_all([(eid, f) for _, eid, f in rows])

    async def _read_lanes(self, count: int, block_ms: int | None) -> list[Delivery[M]]:
        """Up to `count` entries, lanes first (one script); if none and `block_ms`, one XREADGROUP BLOCK over all
        streams, at most count / streams from each, so that it never takes more than `count` either."""
        keys = self.streams()
        rows, missing = await streams.read_group_in_order(self.redis, keys, self.member, count)
        if missing:
            log.warning("group %s missing on %s; recreating", self.group, ", ".join(missing))
            await self.ensure_group()
        if not rows and block_ms is not None and not missing:
            rows = await streams.read_group(self.redis, keys, self.member, max(1, count // len(keys)), block_ms)
        return await self.decode_all([(self.ref(key, eid), f) for key, eid, f in rows])

    async def claim(self, min_idle_ms: int, count: int) -> list[Delivery[M]]:
        """Take over entries another consumer has held longer than min_idle_ms (it died or hung), up to `count`
        from each stream (one round trip for all).

        XAUTOCLAIM scans at most count x 10 pending entries per call, so the cursor it returns is where the
        next call goes on: starting every call at 0-0 would never get past live peers' many entries to a dead
        one's behind them. It comes back to 0-0 when the scan has gone round."""
        cursors = {key: self.cursors.get(key, "0-0") for key in self.streams()}
        results = await streams.autoclaim(self.redis, cursors, self.member, min_idle_ms, count)
        live: Rows = []
        for key, result in results.items():
            if isinstance(result, ResponseError):
                if "NOGROUP" not in str(result):
                    raise result
                await self.ensure_group()
                continue
            self.cursors[key], entries = result
            live += [(self.ref(key, eid), f) for eid, f in entries]
        return await self.decode_all(live)

    async def touch(self, ids: Sequence[str]) -> list[str]:
        """Reset the idle time of the entries we hold and still work on, so that peers claim only the entries
        of a consumer that died or hung; returns those of `ids` no longer ours (a peer claimed them while we
        were stalled). Only entries still ours are touched, checked and claimed in one script per stream:
        XCLAIM would take a peer's entry back (a SIGSTOP between a check and a claim is enough), and the two
        owners would take it from each other for ever."""
        if not ids:
            return []
        lost = await streams.touch_own(self.redis, self.by_stream(ids), self.member)
        return [self.ref(key, i) for key, gone in lost.items() for i in gone]

    async def hand_back(self, ids: Sequence[str], to_consumer: str) -> None:
        """Give pending entries to another consumer name with idle time maxed, so a peer's claim
        takes them at once (graceful shutdown)."""
        for key, entry_ids in self.by_stream(ids).items():
            await streams.hand_over(self.redis, key, self.group, to_consumer, entry_ids)

    # -- upkeep
    async def remove_departed(self, alive: set[str], idle_ms: int) -> list[str]:
        """XGROUP DELCONSUMER every consumer that holds nothing and is not alive (its process is gone; the
        hand-back consumer once emptied), idle for `idle_ms` at least, on every stream this consumer reads:
        group metadata would otherwise grow with every process ever started. A consumer with pending entries
        is kept: deleting it would drop them."""
        gone: list[str] = []
        for key in self.streams():
            try:
                found = await streams.consumers(self.redis, key, self.group)
            except ResponseError:
                continue
            names = [streams.as_str(c["name"]) for c in found if not c["pending"]
                     and streams.as_str(c["name"]) not in alive and int(c["idle"]) >= idle_ms]
            if names:
                # Checked again in the script that deletes: a consumer that took an entry since XINFO (a frozen
                # process let go) would lose it from the pending list with the consumer, and nobody would claim it.
                gone += await streams.delete_consumers_if_empty(self.redis, key, self.group, names)
        return gone

    async def holders(self) -> set[str]:
        """The consumers holding entries of the main stream."""
        try:
            found = await streams.consumers(self.redis, self.key, self.group)
        except ResponseError:
            return set()
        return {streams.as_str(c["name"]) for c in found if c["pending"]}

    async def claim_from(self, consumers: Sequence[str], min_idle_ms: int, count: int) -> list[Delivery[M]]:
        """Take over up to `count` entries of the main stream that `consumers` (processes known to be gone) hold,
        each idle at least `min_idle_ms`: one a peer claimed a moment ago stays the peer's."""
        ids: list[str] = []
        for name in consumers:
            ids += await streams.pending(self.redis, self.key, self.group, count - len(ids), consumer=name,
                                         idle_ms=min_idle_ms)
            if len(ids) >= count:
                break
        if not ids:
            return []
        return await self.decode_all(await streams.claim(self.redis, self.key, self.member, min_idle_ms, ids))

    async def pending_ids(self, count: int = 1000) -> list[str]:
        """References of the entries this consumer holds, on every stream it reads."""
        out = []
        for key in self.streams():
            ids = await streams.pending(self.redis, key, self.group, count, consumer=self.consumer)
            out += [self.ref(key, i) for i in ids]
        return out

    async def trim_acknowledged(self) -> None:
        """XTRIM MINID below the oldest entry any group still needs (its oldest pending entry, else its
        last delivered one), on every stream this consumer reads: acknowledged entries would otherwise stay in
        the stream forever."""
        for key in self.streams():
            await streams.trim_acknowledged(self.redis, key)

    def ack_in(self, target: Target, ids: Sequence[str]) -> Any:
        if not ids:
            return None
        return [streams.ack(target, key, self.group, entry_ids) for key, entry_ids in self.by_stream(ids).items()]

    def ack_own_in(self, target: Target, ids: Sequence[str]) -> Any:
        """`ack_in` of only the entries this consumer still holds (shared/streams.py `ack_own`)."""
        if not ids:
            return None
        return [streams.ack_own(target, key, self.member, entry_ids) for key, entry_ids in self.by_stream(ids).items()]

    async def ack(self, ids: Sequence[str]) -> None:
        for key, entry_ids in self.by_stream(ids).items():
            await streams.ack(self.redis, key, self.group, entry_ids)

    async def delivery_counts(self, ids: Sequence[str]) -> dict[str, int]:
        """entry reference -> times delivered, for pending entries among `ids` (one XPENDING per id, pipelined)."""
        counts = await streams.delivery_counts(self.redis, self.group, [self.locate(ref) for ref in ids])
        return {ref: c for ref, c in zip(ids, counts, strict=True) if c is not None}

    async def decode_all(self, entries: Rows, typ: Any = None) -> list[Delivery[M]]:
        """Each entry as a `typ` (default: this consumer's), the undecodable ones dead-lettered."""
        out: list[Delivery[M]] = []
        poison: list[tuple[str, dict[bytes, bytes], str]] = []
        for eid, fields in entries:
            try:
                out.append(Delivery(eid, decode(streams.payload(fields), typ or self.typ)))
            except (KeyError, msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as e:
                poison.append((eid, fields, f"{type(e).__name__}: {e}"))
        if poison:
            await self.dead_letter(poison)
        return out

    async def dead_letter(self, bad: list[tuple[str, dict[bytes, bytes], str]]) -> None:
        """Move entries that cannot be processed to the dead-letter stream, then acknowledge them."""
        async with self.redis.pipeline(transaction=False) as pipe:
            self.queue_dead_letter(pipe, bad)
            await pipe.execute()

    def queue_dead_letter(self, pipe: Target, bad: list[tuple[str, dict[bytes, bytes], str]]) -> None:
        """`dead_letter`'s commands, queued on `pipe`."""
        for ref, fields, error in bad:
            key, entry_id = self.locate(ref)
            log.error("dead-lettering %s %s: %s", key, entry_id, error)
            raw = {f"raw_{streams.as_str(k)}": v for k, v in fields.items()}
            streams.add_fields(pipe, self.dead_key, {**raw, "stream": key, "group": self.group,
                                                     "entry_id": entry_id, "error": error[:2000],
                                                     "at": f"{time.time():.3f}"}, maxlen=DEAD_LETTERS_MAXLEN)
        self.ack_in(pipe, [ref for ref, _, _ in bad])
