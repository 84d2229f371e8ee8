"""How a full KV page is named, the same in every process: the engine's prefix cache names the pages it holds
this way (services/scheduler/engine/prefix_cache.py), and the tokenizer names the pages of a prompt it encoded
to find the scheduler that holds them (shared/routing.py).

A page's digest is chained over every token before its end (the digest of the previous page plus this page's
tokens), so equal digests mean equal prefixes, not just equal pages.
"""

from __future__ import annotations

import hashlib
import sys
from array import array

_BIG_ENDIAN = sys.byteorder == "big"


def chain_digest(parent: bytes, tokens: list[int]) -> bytes:
    """Digest of one full page given its parent's digest; 128-bit blake2b makes collisions moot. Token ids are
    packed as little-endian 64-bit integers, so every machine names a page alike."""
    packed = array("q", tokens)
    if _BIG_ENDIAN:
        packed.byteswap()
    return hashlib.blake2b(parent + packed.tobytes(), digest_size=16).digest()


def extend_digests(digests: list[bytes], tokens: list[int], page_size: int, upto_pages: int) -> None:
    """Append the digests of pages len(digests)..upto_pages-1 (pages that are full in `tokens`)."""
    upto_pages = min(upto_pages, len(tokens) // page_size)
    for i in range(len(digests), upto_pages):
        parent = digests[i - 1] if i else b""
        digests.append(chain_digest(parent, tokens[i * page_size:(i + 1) * page_size]))
