"""What a request leaves in Redis, written and read through one object: its record (`rsinfer:req:{<uid>}`), its
reply stream and its abort flags with their notifications (docs/design.md, "Request record"). Every key has a
TTL: the record's runs past its deadline from its creation and `ttl` past its end; a reply stream's is refreshed
with its writes.

A process makes one `RequestStore` with its TTL and reply cap. Writes are queued on a pipeline the caller executes
once for a whole batch (no method adds a round trip to it); reads are one round trip however many requests they
ask about.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from shared import streams
from shared.keys import Keys
from shared.messages import ReplyError, ReplyEvent, ReplyFence
from shared.request_states import TERMINAL, EndReason, Finish, Status

ABORTS_MAXLEN = 10_000  # notifications kept per model: schedulers read them within a step
ERROR_CHARS = 500  # of an error message in the record

ReplyEntry = tuple[str, msgspec.Struct, bool]  # (uid, message, refresh the reply stream's TTL)
PRUNE_AFTER_S = 60  # a request in the index this long past its deadline had its end lost (a process died)


def deadline_error() -> ReplyError:
    """The error reply of a request past its deadline."""
    return ReplyError(message="the request passed its deadline", status=504, type="timeout",
                      code="request_timeout")


def _field(v: Any) -> str | int | float:
    return v if isinstance(v, str | int | float) and not isinstance(v, bool) else str(v)


async def prune_inflight(redis: Redis, keys: Keys) -> int:
    """Drop from the index of requests in flight those PRUNE_AFTER_S past their deadline, whose end was lost
    (each API process, once a second: services/api/operations/registry.py); how many."""
    return int(await redis.zremrangebyscore(keys.inflight(), "-inf", time.time() - PRUNE_AFTER_S))


class RequestStore:
    def __init__(self, redis: Redis, keys: Keys, ttl: int, maxlen: int, appender: streams.Appender | None = None):
        """`ttl`: seconds every per-request key lives past its last write; `maxlen`: the approximate cap on
        entries in one reply stream."""
        self.redis, self.keys, self.ttl, self.maxlen = redis, keys, ttl, maxlen
        self._appender = appender

    @property
    def appender(self) -> streams.Appender:
        if self._appender is None:
            self._appender = streams.Appender(self.redis)
        return self._appender

    # -- the record ---------------------------------------------------------------------------------------------
    def create(self, pipe: Pipeline, uid: str, deadline: float, **fields: Any) -> None:
        """Write a new request's record (`queued`, with its deadline and `fields`) and enter it in the index of
        requests in flight (`Keys.inflight`, one ZADD), which it leaves when its record ends (`set_status`) or,
        were that end lost, once past its deadline (`prune_inflight`). Its TTL runs `ttl` past its deadline, so the
        stages' writes before its end need not refresh it: every stage drops a request past its deadline."""
        self.set_status(pipe, uid, Status.QUEUED, deadline=f"{deadline:.3f}", **fields)
        pipe.expire(self.keys.request(uid), max(self.ttl, int(deadline - time.time()) + 1 + self.ttl))
        pipe.zadd(self.keys.inflight(), {uid: deadline})

    async def inflight(self, most: int) -> tuple[int, list[str]]:
        """How many requests are in the index, and the uids of the first `most` by deadline."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zcard(self.keys.inflight())
            pipe.zrange(self.keys.inflight(), 0, most - 1)
            count, uids = await pipe.execute()
        return int(count), [u.decode() if isinstance(u, bytes) else u for u in uids]

    def set_status(self, pipe: Pipeline, uid: str, status: str | None = None, **fields: Any) -> None:
        """HSET the record (status plus any fields, e.g. prompt_tokens; None values are not written). A terminal
        status sets its TTL (`ttl` from now) and takes the request out of the index of requests in flight; a
        write before that leaves the TTL `create` gave it (past the request's deadline)."""
        mapping = {k: _field(v) for k, v in fields.items() if v is not None}
        if status:
            mapping["status"] = status
        mapping["updated_at"] = f"{time.time():.3f}"
        pipe.hset(self.keys.request(uid), mapping=mapping)
        if status in TERMINAL:
            pipe.expire(self.keys.request(uid), self.ttl)
            pipe.zrem(self.keys.inflight(), uid)

    def count_generated(self, pipe: Pipeline, uid: str, tokens: int) -> None:
        """A choice ended after `tokens` tokens: record field `generated_tokens` sums every choice's, which is what
        its tenant's quota is charged (services/api/multitenancy/quotas.py), whoever followed the request."""
        if tokens:
            pipe.hincrby(self.keys.request(uid), "generated_tokens", tokens)

    def attach(self, target: Pipeline | Redis, uid: str, delta: int) -> Any:
        """Count a client stream joining (+1) or leaving (-1) the request (record field `attached`), so that
        any API process can tell whether someone still follows it."""
        return target.hincrby(self.keys.request(uid), "attached", delta)

    async def record(self, uid: str) -> dict[str, str]:
        """The whole record, decoded; empty if there is none."""
        raw = await self.redis.hgetall(self.keys.request(uid))
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def field(self, uids: Sequence[str], name: str) -> dict[str, str | None]:
        """uid -> the value of `name` in its record (None where missing), in one round trip."""
        return {uid: row[0] for uid, row in (await self.fields(uids, name)).items()}

    async def fields(self, uids: Sequence[str], *names: str) -> dict[str, list[str | None]]:
        """uid -> the values of `names` in its record (None where missing), in one round trip."""
        uids = list(uids)
        if not uids:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for uid in uids:
                pipe.hmget(self.keys.request(uid), names)
            rows = await pipe.execute()
        return {u: [v.decode() if v is not None else None for v in row] for u, row in zip(uids, rows, strict=True)}

    async def raise_epoch(self, uid: str) -> int:
        """Count one more takeover of the request (record field `epoch`); its new epoch."""
        return int(await self.redis.hincrby(self.keys.request(uid), "epoch", 1))

    def refresh(self, pipe: Pipeline, uid: str) -> None:
        """Refresh the TTLs of a running request's record and reply stream (without writing either): a choice's
        end (n > 1) set the record's to `ttl` while the others run on."""
        pipe.expire(self.keys.request(uid), self.ttl)
        pipe.expire(self.keys.reply(uid), self.ttl)

    # -- the reply stream ---------------------------------------------------------------------------------------
    def reply(self, pipe: Pipeline, uid: str, msg: msgspec.Struct, refresh_ttl: bool = True) -> None:
        """XADD to the request's reply stream; EXPIRE with it because XADD alone neither sets nor keeps one."""
        streams.add(pipe, self.keys.reply(uid), msg, maxlen=self.maxlen)
        if refresh_ttl:
            pipe.expire(self.keys.reply(uid), self.ttl)

    def replies(self, pipe: Pipeline, entries: list[ReplyEntry]) -> None:
        """Many requests' reply entries in one script call per hash slot (shared/streams.py `Appender`)."""
        self.appender.queue(pipe, [(self.keys.reply(uid), msg, refresh) for uid, msg, refresh in entries],
                            self.maxlen, self.ttl)

    async def fence(self, uid: str, fence: ReplyFence) -> tuple[bool, streams.Rows]:
        """Append `fence` to the reply stream and read what came before it, in one round trip: whether MAXLEN
        trimmed the stream's head, and the entries before the fence (shared/reply_order.py)."""
        key = self.keys.reply(uid)
        async with self.redis.pipeline(transaction=False) as pipe:
            self.reply(pipe, uid, fence)
            streams.queue_info(pipe, key)
            streams.queue_range(pipe, key)
            fence_id, _, info, entries = await pipe.execute()
        before = []
        for entry_id, fields in entries:
            if entry_id == fence_id:
                break
            before.append((streams.as_str(entry_id), fields))
        return streams.was_trimmed(info), before

    # -- ends -----------------------------------------------------------------------------------------------------
    def end_aborted(self, pipe: Pipeline, uid: str, n: int, reason: str, prompt_tokens: int = 0) -> None:
        """Finish every choice of a request with finish_reason "abort" (the reason goes to the record)."""
        for i in range(n):
            self.reply(pipe, uid, ReplyEvent(start=0, end=0, text="", prompt_tokens=prompt_tokens, index=i,
                                             finish_reason=Finish.ABORT))
        self.set_status(pipe, uid, Status.ABORTED, finish_reason=Finish.ABORT, error=f"aborted: {reason}")
        pipe.expire(self.keys.abort(uid), self.ttl)  # an operator's `SET ... EX 300` need not outlive the request

    def end_failed(self, pipe: Pipeline, uid: str, error: ReplyError) -> None:
        """Send a ReplyError to the client and mark the request failed."""
        self.reply(pipe, uid, error)
        self.set_status(pipe, uid, Status.FAILED, finish_reason=Finish.ERROR, error=error.message[:ERROR_CHARS])

    def end_timed_out(self, pipe: Pipeline, uid: str) -> None:
        """Fail a request past its deadline (a 504 to its client)."""
        self.end_failed(pipe, uid, deadline_error())

    def note_abort(self, pipe: Pipeline, uid: str, reason: str) -> None:
        """A request dropped for `reason` whose reply ends elsewhere (its final "abort" deltas go through the
        detokenizer, which writes the status): the reason in the record, and the abort flag's TTL bounded."""
        self.set_status(pipe, uid, error=f"aborted: {reason}")
        pipe.expire(self.keys.abort(uid), self.ttl)  # an operator's flag need not outlive the request

    # -- abort flags and notifications ------------------------------------------------------------------------------
    def abort(self, pipe: Pipeline, uid: str, reason: str, model: str | None) -> None:
        """Set the abort flag (every stage drops the request at its next look; the value is the reason) and tell
        the schedulers of `model` at once through its aborts stream. They also read the flags of their requests
        once a second, which is how an operator's `SET rsinfer:abort:{<uid>}` takes effect."""
        pipe.set(self.keys.abort(uid), reason, ex=self.ttl)
        if model:
            streams.add_fields(pipe, self.keys.aborts(model), {"uid": uid, "reason": reason}, maxlen=ABORTS_MAXLEN)

    async def abort_now(self, uid: str, reason: str, model: str | None) -> None:
        """`abort` in a round trip of its own."""
        async with self.redis.pipeline(transaction=False) as pipe:
            self.abort(pipe, uid, reason, model)
            await pipe.execute()

    def stop_choice(self, pipe: Pipeline, uid: str, index: int, model: str) -> None:
        """A stop string ended choice `index` of an n > 1 request: its own flag, and a notification."""
        pipe.set(self.keys.choice_stop(uid, index), EndReason.STOP, ex=self.ttl)
        streams.add_fields(pipe, self.keys.aborts(model), {"uid": uid, "reason": EndReason.STOP, "choice": index},
                           maxlen=ABORTS_MAXLEN)

    async def abort_reasons(self, uids: Iterable[str]) -> dict[str, str]:
        """uid -> reason for each uid whose abort flag is set, in one round trip (cluster-safe pipeline)."""
        reasons, _ = await self.ended_elsewhere(uids, ())
        return reasons

    async def ended_elsewhere(self, uids: Iterable[str], choices: Iterable[tuple[str, int]]
                              ) -> tuple[dict[str, str], set[tuple[str, int]]]:
        """Abort reasons of `uids` (as abort_reasons) and which of `choices` a stop string ended, in one round
        trip."""
        uids, choices = list(uids), list(choices)
        if not uids and not choices:
            return {}, set()
        async with self.redis.pipeline(transaction=False) as pipe:
            for uid in uids:
                pipe.get(self.keys.abort(uid))
            for uid, index in choices:
                pipe.exists(self.keys.choice_stop(uid, index))
            values = await pipe.execute()
        reasons = {uid: v.decode() for uid, v in zip(uids, values, strict=False) if v is not None}
        stopped = {c for c, v in zip(choices, values[len(uids):], strict=True) if v}
        return reasons, stopped
