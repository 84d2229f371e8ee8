"""A least-recently-used map bounded by entries and by bytes: for caches keyed or filled by client text (a
grammar's spec, a request's stop strings), where a count alone would let a few huge entries hold a lot of
memory. Each entry's size is given when it is put; one larger than the whole budget is not kept."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class ByteLRU(Generic[K, V]):
    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: K) -> bool:
        return key in self._items

    def get(self, key: K, default: V | None = None) -> V | None:
        item = self._items.get(key)
        if item is None:
            return default
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: K, value: V, size: int) -> bool:
        """Keep `value` (of about `size` bytes), dropping the least recently used entries past either bound;
        False if it is larger than the whole budget (then it is not kept)."""
        self.pop(key)
        if size > self.max_bytes:
            return False
        self._items[key] = (value, size)
        self.bytes += size
        while len(self._items) > self.max_entries or self.bytes > self.max_bytes:
            _, (_, dropped) = self._items.popitem(last=False)
            self.bytes -= dropped
        return True

    def pop(self, key: K) -> V | None:
        item = self._items.pop(key, None)
        if item is None:
            return None
        self.bytes -= item[1]
        return item[0]
