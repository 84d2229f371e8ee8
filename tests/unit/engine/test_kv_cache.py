"""Page pool and prefix cache bookkeeping."""

from __future__ import annotations

from services.scheduler.engine.kv_cache import SCRATCH_PAGE, PagePool, pages_for
from services.scheduler.engine.prefix_cache import PrefixCache
from shared.pages import chain_digest, extend_digests


def test_alloc_release_and_scratch_page_never_handed_out():
    pool = PagePool(9)
    assert pool.usable == pool.available() == 8
    pages = pool.alloc(8)
    assert SCRATCH_PAGE not in pages and len(set(pages)) == 8
    assert pool.alloc(1) is None and pool.available() == 0
    pool.release(pages)
    assert pool.available() == 8


def test_shared_pages_free_on_last_release():
    pool = PagePool(5)
    pages = pool.alloc(2)
    pool.share(pages)
    pool.release(pages)
    assert pool.available() == 2
    pool.release(pages)
    assert pool.available() == 4


def test_shuffled_pool_hands_out_scattered_pages():
    pages = PagePool(64, shuffle_seed=3).alloc(10)
    assert pages != sorted(pages)


def test_digests_chain_over_the_whole_prefix():
    a, b = [1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 9, 9, 9, 5, 6, 7, 8]
    da, db = [], []
    extend_digests(da, a, 4, 10)
    extend_digests(db, b, 4, 10)
    assert len(da) == 2 and len(db) == 2  # only full pages
    assert da[1] != db[1]  # same page tokens, different prefix
    assert da[0] == chain_digest(b"", [1, 2, 3, 4])


def test_prefix_cache_match_evict_lru():
    cache = PrefixCache()
    pool = PagePool(4, cache)
    pages = pool.alloc(3)
    digests = [bytes([i]) * 16 for i in range(3)]
    for d, p in zip(digests, pages, strict=True):
        cache.insert(d, p)
    assert cache.match([*digests[:2], b"x" * 16]) == pages[:2]
    pool.release(pages)  # all evictable now, the tail first
    assert pool.available() == 3 and len(cache) == 3
    pool.share([pages[0]])  # a hit takes it out of the evictable set
    assert pool.available() == 2
    fresh = pool.alloc(2)  # evicts the two unreferenced pages
    assert set(fresh) == set(pages[1:]) and len(cache) == 1
    assert cache.match(digests) == [pages[0]]
    pool.release([pages[0], *fresh])
    assert pool.available() == 3


def test_pages_for():
    assert [pages_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def chain(tokens: list[int], page_size: int = 4) -> list[bytes]:
    digests: list[bytes] = []
    extend_digests(digests, tokens, page_size, len(tokens) // page_size)
    return digests


def hold(pool: PagePool, cache: PrefixCache, digests: list[bytes], shared: list[int] | None = None) -> list[int]:
    """What a sequence does: share the cached head `shared`, allocate and name the rest of its full pages."""
    pages = list(shared or [])
    pool.share(pages)
    pages += pool.alloc(len(digests) - len(pages))
    for d, p in zip(digests, pages, strict=True):
        cache.insert(d, p)
        assert cache.page_of[d] == p
    return pages


def cached_head(cache: PrefixCache, digests: list[bytes]) -> int:
    """How many leading pages of a chain are cached; asserts no later page is cached without its parent
    (such a page could never match again, yet would hold memory)."""
    cached = [d in cache.page_of for d in digests]
    k = cached.index(False) if False in cached else len(cached)
    assert not any(cached[k:]), f"orphan pages cached after a gap: {cached}"
    return k


def test_eviction_takes_a_prefix_from_its_tail():
    cache = PrefixCache()
    pool = PagePool(11, cache)  # 10 usable pages
    a = chain(list(range(32)))  # A1..A8
    pages = hold(pool, cache, a)
    pool.release(pages)
    assert pool.available() == 10 and len(cache) == 8
    other = pool.alloc(5)  # 2 free pages, then 3 evictions
    assert len(cache) == 5 and cached_head(cache, a) == 5
    assert cache.match(a) == pages[:5]
    pool.release(other)
    pool.alloc(9)  # everything but one cached page
    assert cache.match(a) == pages[:1] and cached_head(cache, a) == 1


def test_eviction_in_a_tree_of_prefixes_is_lru_over_leaves():
    cache = PrefixCache()
    pool = PagePool(17, cache)  # 16 usable pages
    system = list(range(100, 116))  # 4 shared pages S1..S4
    x, y = chain(system + list(range(12))), chain(system + list(range(50, 62)))  # S + X1..X3, S + Y1..Y3
    xp = hold(pool, cache, x)
    yp = hold(pool, cache, y, shared=xp[:4])
    assert yp[:4] == xp[:4] and len(cache) == 10
    pool.release(xp)  # X ends first: its own pages are the oldest idle ones
    pool.release(yp)
    z = pool.alloc(1)  # a later request that shares the system prompt and ends in a partial page
    pool.share(xp[:4])
    pool.release(xp[:4] + z)
    assert pool.available() == 16
    pool.alloc(6 + 3)  # 6 free pages, then 3 evictions: the X branch, least recently used
    assert cached_head(cache, x) == 4 and cached_head(cache, y) == 7
    pool.alloc(3)  # the Y branch goes next, not the system prompt (used last, by the third request)
    assert cached_head(cache, y) == 4 and cache.match(y) == xp[:4]
    pool.alloc(2)
    assert cached_head(cache, x) == cached_head(cache, y) == 2 and len(cache) == 2
