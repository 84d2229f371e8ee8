"""A batch's line results in the object store, and its output and error files built from them by streaming
(services/api/batch_api/batch_run.py), so that an API process holds a bounded part of a batch's output however large it
is.

Each line's result is its row of the output file (status 200) or the error file, exactly as the file will hold it
(JSON and a newline), under `batches/<id>/lines/<line>.ok` or `.err`: the listing alone tells a runner which lines
ended, how, and how large each file will be; the files are then written by `put_stream` from the rows read back in
order, at most `READ_AHEAD` at once.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

from shared.object_store import ObjectStore

READ_AHEAD = 8  # line results read at once while a file is written


def lines_prefix(batch_id: str) -> str:
    return f"batches/{batch_id}/lines/"


def result_key(batch_id: str, index: int, ok: bool) -> str:
    return f"{lines_prefix(batch_id)}{index:08d}.{'ok' if ok else 'err'}"


@dataclass(frozen=True)
class Result:
    """A stored line result: which file its row goes to, and its size there."""

    ok: bool
    size: int


async def stored_results(store: ObjectStore, batch_id: str) -> dict[int, Result]:
    """The lines whose results are stored, from the listing (nothing is read)."""
    out: dict[int, Result] = {}
    async for info in store.list_objects(lines_prefix(batch_id)):
        name = info.key.rsplit("/", 1)[1]
        index, _, kind = name.partition(".")
        if index.isdigit() and kind in ("ok", "err"):
            out[int(index)] = Result(kind == "ok", info.size)
    return out


async def ordered_rows(store: ObjectStore, items: Iterable[str | bytes], ahead: int = READ_AHEAD
                       ) -> AsyncIterator[bytes]:
    """Each item's bytes in order: a key's object (read `ahead` at once), or the bytes given. What is read ahead
    is cancelled if the consumer stops early."""
    pending: deque[asyncio.Task[bytes] | bytes] = deque()
    try:
        for item in items:
            pending.append(asyncio.create_task(store.get(item)) if isinstance(item, str) else item)
            if len(pending) >= ahead:
                yield await _take(pending)
        while pending:
            yield await _take(pending)
    finally:
        for left in pending:
            if isinstance(left, asyncio.Task):
                left.cancel()


async def _take(pending: deque[asyncio.Task[bytes] | bytes]) -> bytes:
    first = pending.popleft()
    return first if isinstance(first, bytes) else await first


async def delete_results(store: ObjectStore, batch_id: str) -> int:
    """Every stored line result of the batch deleted (`READ_AHEAD` at once); how many."""
    keys = [info.key async for info in store.list_objects(lines_prefix(batch_id))]
    for at in range(0, len(keys), READ_AHEAD):
        await asyncio.gather(*(store.delete(key) for key in keys[at:at + READ_AHEAD]))
    return len(keys)
