"""Prefix caching by hashed full pages (named as shared/pages.py names them, the same in every process).

A full page is named by a digest chained over every token before its end (the digest of the previous
page plus this page's tokens), so equal digests mean equal prefixes, not just equal pages. A request
that starts with the same tokens as an earlier one (a shared system prompt, another choice, its own
tokens after a preemption) reuses those pages instead of recomputing them.

The cache never owns a page outright: it names pages the pool has handed out, and a page whose
readers have all gone becomes evictable, least recently released first.

Cached pages form a tree (a page's parent names the prefix before it), and eviction must take leaves
only: a page cached without its parent can never match again. Two rules make the least recently
released page always a leaf, so plain LRU order is enough (O(1) per page):
- whoever holds a cached page holds its cached parent too (a sequence's full pages are exactly the
  cache's pages for its digests: `insert` hands back the page that already holds a prefix, and the
  scheduler switches to it);
- a sequence releases its pages tail first (PagePool.release), so a child becomes idle before its parent.

It also keeps what changed since it was last asked (`take_changes`): the scheduler publishes the digests it holds
for the tokenizers' prefix-aware routing (services/scheduler/lanes.py).
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixCache:
    def __init__(self) -> None:
        self.page_of: dict[bytes, int] = {}
        self.digest_of: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.hits = 0  # pages served from the cache, for stats
        # Digests named and evicted since the last take_changes, net: one named then evicted is neither.
        self.named: set[bytes] = set()
        self.evicted: set[bytes] = set()

    def match(self, digests: list[bytes]) -> list[int]:
        """Pages of the longest cached prefix of `digests`."""
        pages = []
        for d in digests:
            page = self.page_of.get(d)
            if page is None:
                break
            pages.append(page)
        self.hits += len(pages)
        return pages

    def insert(self, digest: bytes, page: int) -> int:
        """Name a page that just became full and return it, or the page that already holds this prefix
        (the first wins; the caller then reads that one instead of its duplicate)."""
        held = self.page_of.get(digest)
        if held is not None:
            return held
        assert page not in self.digest_of, f"page {page} is already named"
        self.page_of[digest] = page
        self.digest_of[page] = digest
        if digest in self.evicted:
            self.evicted.discard(digest)  # evicted and named again since last told: as it was
        else:
            self.named.add(digest)
        return page

    def holds(self, page: int) -> bool:
        return page in self.digest_of

    def num_evictable(self) -> int:
        return len(self.evictable)

    def make_evictable(self, page: int) -> None:
        self.evictable[page] = None

    def touch(self, page: int) -> None:
        self.evictable.pop(page, None)

    def evict(self) -> int:
        """Forget the least recently released unreferenced page (a leaf: see the module docstring) and
        return it to the caller."""
        page, _ = self.evictable.popitem(last=False)
        digest = self.digest_of.pop(page)
        del self.page_of[digest]
        if digest in self.named:
            self.named.discard(digest)  # named and gone before anyone was told
        else:
            self.evicted.add(digest)
        return page

    def take_changes(self) -> tuple[list[bytes], list[bytes]]:
        """(digests named, digests evicted) since the last call."""
        named, evicted = list(self.named), list(self.evicted)
        self.named.clear()
        self.evicted.clear()
        return named, evicted

    def digests(self) -> list[bytes]:
        """Every digest held now."""
        return list(self.page_of)

    def __len__(self) -> int:
        return len(self.digest_of)
