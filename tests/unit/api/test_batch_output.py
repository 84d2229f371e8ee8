"""services/api/batch_api/batch_output.py on a real local object store: a batch's output file is written by streaming
its line results, with a bounded number of them (so of bytes) in memory whatever the number of lines."""

from __future__ import annotations

import asyncio

from services.api.batch_api.batch_output import READ_AHEAD, delete_results, ordered_rows, result_key, stored_results
from shared.local_store import LocalStore
from tests.support.helpers import async_wait_for


class CountingStore(LocalStore):
    """The local store, counting the reads in flight (what the writer holds in memory at most)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reading = self.most = self.reads = 0
        self.held: set[str] = set()  # keys whose reads never end unless cancelled

    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        self.reading += 1
        self.reads += 1
        self.most = max(self.most, self.reading)
        try:
            await asyncio.sleep(0)
            if key in self.held:
                await asyncio.Event().wait()
            return await super().get(key, max_bytes=max_bytes)
        finally:
            self.reading -= 1


async def test_the_output_is_streamed_from_the_results_in_order_reading_a_few_at_once(tmp_path):
    store = CountingStore(tmp_path / "store", max_bytes=1 << 30, cache_dir=tmp_path / "cache")
    rows = {k: (b'{"line": %d, "pad": "%s"}\n' % (k, b"x" * (k % 50))) for k in range(600)}
    for k, row in rows.items():
        await store.put(result_key("b1", k, k % 7 != 0), row)
    results = await stored_results(store, "b1")
    assert len(results) == 600 and not results[14].ok and results[15].size == len(rows[15])
    items: list[str | bytes] = []
    for k in range(600):
        if results[k].ok:
            items.append(result_key("b1", k, True))
        if k == 3:
            items.append(b"an invalid line's row\n")
    chunks: list[int] = []

    async def sizes():
        async for chunk in ordered_rows(store, items):
            chunks.append(len(chunk))
            yield chunk

    size = await store.put_stream("files/out", sizes())
    expected = b"".join(rows[k] + (b"an invalid line's row\n" if k == 3 else b"") for k in range(600) if k % 7)
    assert store.reads == len(items) - 1  # each stored result read once
    assert await store.get("files/out") == expected and size == len(expected)
    assert store.most <= READ_AHEAD  # however many lines: a few results in memory, never the whole output
    assert max(chunks) <= max(len(r) for r in rows.values())
    assert await delete_results(store, "b1") == 600
    assert await stored_results(store, "b1") == {}
    await store.close()


async def test_a_writer_that_stops_early_cancels_what_it_read_ahead(tmp_path):
    store = CountingStore(tmp_path / "store", max_bytes=1 << 30, cache_dir=tmp_path / "cache")
    for k in range(40):
        await store.put(result_key("b2", k, True), b"x" * 100 + b"\n")
    store.held = {result_key("b2", k, True) for k in range(1, 40)}
    rows = ordered_rows(store, [result_key("b2", k, True) for k in range(40)])
    assert len(await anext(rows)) == 101
    assert store.reading > 0  # reads ahead, held
    await rows.aclose()
    await async_wait_for(lambda: store.reading == 0, 5, 0.01)  # they end only when cancelled
    await store.close()
