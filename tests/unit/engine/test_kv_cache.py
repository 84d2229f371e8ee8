"""Page pool and prefix cache bookkeeping."""

from __future__ import annotations

from services.scheduler.engine.kv_cache import SCRATCH_PAGE, PagePool, pages_for
from services.scheduler.engine.prefix_cache import PrefixCache, chain_digest, extend_digests


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
    pool.release(pages)  # all evictable now, oldest first
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
