"""How a full KV page is named, the same in every process: the engine's prefix cache names the pages it holds
this way (services/scheduler/engine/prefix_cache.py), and the tokenizer names the pages of a prompt it encoded
to find the scheduler that holds them (services/tokenizer/router.py).

A page's digest is chained over every token before its end (the digest of the previous page plus this page's
tokens), so equal digests mean equal prefixes, not just equal pages. The chain of a request that runs with a LoRA
adapter starts from the adapter's root (`adapter_root`) instead of b"": its pages hold other K/V than the base
model's for the same tokens, so they are named apart, while the base model's digests stay what they were.
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


def adapter_root(adapter: str | None) -> bytes:
    """The parent digest of the first page of a request that runs with LoRA adapter `adapter` (b"": the base)."""
    if adapter is None:
        return b""
    return hashlib.blake2b(b"rsinfer-lora\0" + adapter.encode("utf-8"), digest_size=16).digest()


def extend_digests(digests: list[bytes], tokens: list[int], page_size: int, upto_pages: int,
                   root: bytes = b"") -> None:
    """Append the digests of pages len(digests)..upto_pages-1 (pages that are full in `tokens`); `root` is the
    first page's parent (`adapter_root`)."""
    upto_pages = min(upto_pages, len(tokens) // page_size)
    for i in range(len(digests), upto_pages):
        parent = digests[i - 1] if i else root
        digests.append(chain_digest(parent, tokens[i * page_size:(i + 1) * page_size]))
