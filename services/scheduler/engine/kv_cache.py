"""The paged KV cache: per-layer page pools in flashinfer's NHD layout, and the page allocator.

Every layer holds `k, v: [num_pages, page_size, num_kv_heads, head_dim]`; a request's KV lives in the
pages its page table lists, in order. Page 0 is never handed out: it is the scratch page that padded
rows (CUDA-graph batches) write into, so a pad can never corrupt a live request.

Pages are reference counted because several sequences may read one page: the n choices of one
request share their prompt's full pages, and the prefix cache shares full pages between requests.
Only full pages are ever shared, and a full page is never written again, so no copy-on-write is needed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.scheduler.engine.prefix_cache import PrefixCache
from services.scheduler.engine.transfer import to_device

SCRATCH_PAGE = 0


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


class KVCache:
    """The page pools of every layer (one tensor each for K and V, viewed per layer)."""

    def __init__(self, shape: KVShape, num_pages: int, dtype: torch.dtype, device: torch.device | str):
        self.shape = shape
        self.num_pages = num_pages
        self.page_size = shape.page_size
        dims = (shape.num_layers, num_pages, shape.page_size, shape.num_kv_heads, shape.head_dim)
        # torch.empty: on CPU the OS maps memory lazily, so an unused pool costs address space only.
        self._k = torch.empty(dims, dtype=dtype, device=device)
        self._v = torch.empty(dims, dtype=dtype, device=device)
        self.k = list(self._k.unbind(0))
        self.v = list(self._v.unbind(0))
        self.on_zero: Callable[[list[int]], None] | None = None  # tensor parallelism: the other ranks clear theirs
        self.zero_pages([SCRATCH_PAGE])

    @property
    def nbytes(self) -> int:
        return self._k.nbytes + self._v.nbytes

    def zero_pages(self, pages: list[int]) -> None:
        """Clear pages before use by a backend that reads whole pages (torch): a masked key still
        multiplies its value by 0, and never-written memory may hold NaN."""
        (idx,) = to_device([pages], torch.int64, self._k.device)
        self._k.index_fill_(1, idx, 0)
        self._v.index_fill_(1, idx, 0)
        if self.on_zero is not None:
            self.on_zero(pages)


class PagePool:
    """Free pages, reference counts and the prefix cache's evictable pages.

    `available()` counts pages that an allocation can get now: free ones plus cached pages nobody
    references (evicted on demand, least recently used first, a prefix from its tail).
    """

    def __init__(self, num_pages: int, prefix_cache: PrefixCache | None = None, shuffle_seed: int | None = None,
                 on_alloc: Callable[[list[int]], None] | None = None):
        if num_pages < 2:
            raise ValueError(f"the KV cache needs at least 2 pages, got {num_pages}")
        self.num_pages = num_pages
        self.usable = num_pages - 1  # minus the scratch page
        self.refs = [0] * num_pages
        self.free = list(range(num_pages - 1, SCRATCH_PAGE, -1))  # pop() hands out low ids first
        if shuffle_seed is not None:  # tests: prove nothing assumes contiguous pages
            random.Random(shuffle_seed).shuffle(self.free)
        self.cache = prefix_cache
        self.on_alloc = on_alloc

    def available(self) -> int:
        return len(self.free) + (self.cache.num_evictable() if self.cache else 0)

    def used(self) -> int:
        return self.usable - self.available()

    def alloc(self, n: int) -> list[int] | None:
        """n fresh pages (reference count 1), or None (and nothing taken) if there are not enough."""
        if n > self.available():
            return None
        pages = []
        for _ in range(n):
            if not self.free:
                assert self.cache is not None
                self.free.append(self.cache.evict())
            page = self.free.pop()
            self.refs[page] = 1
            pages.append(page)
        if self.on_alloc and pages:
            self.on_alloc(pages)
        return pages

    def share(self, pages: list[int]) -> None:
        """One more reader of each page (a cache hit or a sibling choice)."""
        for page in pages:
            if self.refs[page] == 0 and self.cache is not None:
                self.cache.touch(page)  # no longer evictable
            self.refs[page] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reader of each page. `pages` is in sequence order; they are released tail first so
        that a cached page turns evictable before its parent (prefix_cache.py: eviction takes leaves)."""
        for page in reversed(pages):
            self.refs[page] -= 1
            assert self.refs[page] >= 0, f"page {page} released twice"
            if self.refs[page] == 0:
                if self.cache is not None and self.cache.holds(page):
                    self.cache.make_evictable(page)
                else:
                    self.free.append(page)


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)
