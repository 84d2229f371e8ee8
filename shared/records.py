"""The request record's old helpers, as thin wrappers over shared/request_store.py `RequestStore` and the names of
shared/request_states.py, for the modules not ported yet (services/scheduler/, services/api/request.py,
services/api/app.py); to go once they use a `RequestStore` of their own. Nothing new goes here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from shared import streams
from shared.keys import Keys
from shared.messages import ReplyError
from shared.request_states import TERMINAL as _TERMINAL
from shared.request_states import Status
from shared.request_store import ABORTS_MAXLEN, RequestStore, deadline_error  # noqa: F401  (their old home)

STATUSES = tuple(Status)
TERMINAL = tuple(s for s in Status if s in _TERMINAL)


def _store(target: Any, keys: Keys, ttl: int = 0, maxlen: int = 0,
           appender: streams.Appender | None = None) -> RequestStore:
    return RequestStore(target, keys, ttl, maxlen, appender)


def set_status(pipe: Pipeline, keys: Keys, uid: str, ttl: int, status: str | None = None,
               **fields: Any) -> None:
    _store(pipe, keys, ttl).set_status(pipe, uid, status, **fields)


def replies(pipe: Pipeline, appender: streams.Appender, keys: Keys, events: list[tuple[str, msgspec.Struct, bool]],
            ttl: int, maxlen: int) -> None:
    _store(pipe, keys, ttl, maxlen, appender).replies(pipe, events)


def reply(pipe: Pipeline, keys: Keys, uid: str, msg: msgspec.Struct, ttl: int, maxlen: int,
          refresh_ttl: bool = True) -> None:
    _store(pipe, keys, ttl, maxlen).reply(pipe, uid, msg, refresh_ttl)


def attach(pipe: Pipeline | Redis, keys: Keys, uid: str, delta: int) -> Any:
    return _store(pipe, keys).attach(pipe, uid, delta)


def abort(pipe: Pipeline, keys: Keys, uid: str, reason: str, ttl: int, model: str | None) -> None:
    _store(pipe, keys, ttl).abort(pipe, uid, reason, model)


async def abort_now(redis: Redis, keys: Keys, uid: str, reason: str, ttl: int, model: str | None) -> None:
    await _store(redis, keys, ttl).abort_now(uid, reason, model)


def stop_choice(pipe: Pipeline, keys: Keys, uid: str, index: int, ttl: int, model: str) -> None:
    _store(pipe, keys, ttl).stop_choice(pipe, uid, index, model)


async def ended_elsewhere(redis: Redis, keys: Keys, uids: Iterable[str], choices: Iterable[tuple[str, int]]
                          ) -> tuple[dict[str, str], set[tuple[str, int]]]:
    return await _store(redis, keys).ended_elsewhere(uids, choices)


async def abort_reasons(redis: Redis, keys: Keys, uids: Iterable[str]) -> dict[str, str]:
    return await _store(redis, keys).abort_reasons(uids)


def end_aborted(pipe: Pipeline, keys: Keys, uid: str, n: int, reason: str, ttl: int, maxlen: int,
                prompt_tokens: int = 0) -> None:
    _store(pipe, keys, ttl, maxlen).end_aborted(pipe, uid, n, reason, prompt_tokens)


def end_failed(pipe: Pipeline, keys: Keys, uid: str, error: ReplyError, ttl: int, maxlen: int) -> None:
    _store(pipe, keys, ttl, maxlen).end_failed(pipe, uid, error)
