"""Per-request keys every stage writes: the request record (`rsinfer:req:{<uid>}`), the reply stream and
the abort flag. Every write refreshes the key's TTL, so nothing outlives its request.

The helpers queue commands on a pipeline; the caller executes it once for a whole batch.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import msgspec
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from shared import streams
from shared.keys import Keys
from shared.messages import ReplyError, ReplyEvent

STATUSES = ("queued", "tokenized", "running", "finished", "aborted", "failed")


def set_status(pipe: Pipeline, keys: Keys, uid: str, ttl: int, status: str | None = None,
               **fields: Any) -> None:
    """HSET the request record (status plus any fields, e.g. prompt_tokens) and refresh its TTL."""
    mapping = {k: _field(v) for k, v in fields.items() if v is not None}
    if status:
        mapping["status"] = status
    mapping["updated_at"] = f"{time.time():.3f}"
    pipe.hset(keys.request(uid), mapping=mapping)
    pipe.expire(keys.request(uid), ttl)


def _field(v: Any) -> str | int | float:
    return v if isinstance(v, str | int | float) and not isinstance(v, bool) else str(v)


def replies(pipe: Pipeline, appender: streams.Appender, keys: Keys, events: list[tuple[str, msgspec.Struct, bool]],
            ttl: int, maxlen: int) -> None:
    """Many requests' reply entries, (uid, message, refresh the TTL), in one call (shared/streams.py Appender)."""
    appender.queue(pipe, [(keys.reply(uid), msg, refresh) for uid, msg, refresh in events], maxlen, ttl)


def reply(pipe: Pipeline, keys: Keys, uid: str, msg: msgspec.Struct, ttl: int, maxlen: int,
          refresh_ttl: bool = True) -> None:
    """XADD to the request's reply stream; EXPIRE with it because XADD alone neither sets nor keeps one."""
    streams.add(pipe, keys.reply(uid), msg, maxlen=maxlen)
    if refresh_ttl:
        pipe.expire(keys.reply(uid), ttl)


def attach(pipe: Pipeline | Redis, keys: Keys, uid: str, delta: int) -> Any:
    """Count a client stream joining (+1) or leaving (-1) the request (record field `attached`), so that
    any API process can tell whether someone still follows it."""
    return pipe.hincrby(keys.request(uid), "attached", delta)


TERMINAL = ("finished", "aborted", "failed")


ABORTS_MAXLEN = 10_000


def abort(pipe: Pipeline, keys: Keys, uid: str, reason: str, ttl: int, model: str | None) -> None:
    """Set the abort flag (every stage drops the request at its next look; the value is the reason) and tell
    the schedulers of `model` at once through its aborts stream. They also read the flags of their requests
    once a second, which is how an operator's `SET rsinfer:abort:{<uid>}` takes effect."""
    pipe.set(keys.abort(uid), reason, ex=ttl)
    if model:
        streams.add_fields(pipe, keys.aborts(model), {"uid": uid, "reason": reason}, maxlen=ABORTS_MAXLEN)


async def abort_now(redis: Redis, keys: Keys, uid: str, reason: str, ttl: int, model: str | None) -> None:
    async with redis.pipeline(transaction=False) as pipe:
        abort(pipe, keys, uid, reason, ttl, model)
        await pipe.execute()


def stop_choice(pipe: Pipeline, keys: Keys, uid: str, index: int, ttl: int, model: str) -> None:
    """A stop string ended choice `index` of an n > 1 request: its own flag, and a notification."""
    pipe.set(keys.choice_stop(uid, index), "stop", ex=ttl)
    streams.add_fields(pipe, keys.aborts(model), {"uid": uid, "reason": "stop", "choice": index},
                       maxlen=ABORTS_MAXLEN)


async def ended_elsewhere(redis: Redis, keys: Keys, uids: Iterable[str], choices: Iterable[tuple[str, int]]
                          ) -> tuple[dict[str, str], set[tuple[str, int]]]:
    """Abort reasons of `uids` (as abort_reasons) and which of `choices` a stop string ended, in one round
    trip."""
    uids, choices = list(uids), list(choices)
    if not uids and not choices:
        return {}, set()
    async with redis.pipeline(transaction=False) as pipe:
        for uid in uids:
            pipe.get(keys.abort(uid))
        for uid, index in choices:
            pipe.exists(keys.choice_stop(uid, index))
        values = await pipe.execute()
    reasons = {uid: v.decode() for uid, v in zip(uids, values, strict=False) if v is not None}
    stopped = {c for c, v in zip(choices, values[len(uids):], strict=True) if v}
    return reasons, stopped


async def abort_reasons(redis: Redis, keys: Keys, uids: Iterable[str]) -> dict[str, str]:
    """uid -> reason for each uid whose abort flag is set, in one round trip (cluster-safe pipeline)."""
    uids = list(uids)
    if not uids:
        return {}
    async with redis.pipeline(transaction=False) as pipe:
        for uid in uids:
            pipe.get(keys.abort(uid))
        values = await pipe.execute()
    return {uid: v.decode() for uid, v in zip(uids, values, strict=True) if v is not None}


def deadline_error() -> ReplyError:
    return ReplyError(message="the request passed its deadline", status=504, type="timeout",
                      code="request_timeout")


def end_aborted(pipe: Pipeline, keys: Keys, uid: str, n: int, reason: str, ttl: int, maxlen: int,
                prompt_tokens: int = 0, completed: dict[int, int] | None = None) -> None:
    """Finish every choice of a request with finish_reason "abort" (the reason goes to the record)."""
    for i in range(n):
        end = (completed or {}).get(i, 0)
        reply(pipe, keys, uid, ReplyEvent(start=end, end=end, text="", prompt_tokens=prompt_tokens, index=i,
                                          finish_reason="abort"), ttl, maxlen)
    set_status(pipe, keys, uid, ttl, "aborted", finish_reason="abort", error=f"aborted: {reason}")
    pipe.expire(keys.abort(uid), ttl)  # an operator's `SET ... EX 300` need not outlive the request


def end_failed(pipe: Pipeline, keys: Keys, uid: str, error: Any, ttl: int, maxlen: int) -> None:
    """Send a ReplyError to the client and mark the request failed."""
    reply(pipe, keys, uid, error, ttl, maxlen)
    set_status(pipe, keys, uid, ttl, "failed", finish_reason="error", error=error.message[:500])
