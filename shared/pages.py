"""How a full KV page is named, the same in every process: the engine's prefix cache names the pages it holds
this way (services/scheduler/engine/prefix_cache.py), and the tokenizer names the pages of a prompt it encoded
to find the scheduler that holds them (services/tokenizer/router.py).

A page's digest is chained over every token before its end (the digest of the previous page plus this page's
tokens), so equal digests mean equal prefixes, not just equal pages. The chain of a request that runs with a LoRA
adapter starts from the adapter's root (`adapter_root`) instead of b"": its pages hold other K/V than the base
model's for the same tokens, so they are named apart, while the base model's digests stay what they were.

Prefix-cache isolation: a request's `cache_salt` (shared/messages.py RequestJob, set by the API from its tenant, or
its policy's shared salt, and the client's `cache_salt`: `isolation_salt`) seeds the root too (`prefix_root`), so no
page of one salt is named as any page of another: a tenant's `cached_tokens` and time to first token cannot tell
whether another's prefix is cached. The empty salt (open mode, no `cache_salt`) keeps the unsalted names.
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


def prefix_root(adapter: str | None, salt: str = "") -> bytes:
    """The parent digest of the first page of a request with LoRA adapter `adapter` and cache salt `salt` (module
    doc): the adapter's root, salted unless `salt` is empty."""
    root = adapter_root(adapter)
    if not salt:
        return root
    return hashlib.blake2b(b"rsinfer-salt\0" + salt.encode("utf-8") + b"\0" + root, digest_size=16).digest()


def isolation_salt(scope: str, requested: str | None) -> str:
    """The salt a request's pages are named under: its tenant's `scope` (its policy's shared salt, else its name;
    "" in open mode) and the salt the client sent (vLLM's `cache_salt`), as a fixed-size hex digest; "" when
    neither is given. Length-prefixed, so no (scope, salt) pair names another's pages."""
    if not scope and not requested:
        return ""
    parts = [scope.encode("utf-8"), (requested or "").encode("utf-8")]
    packed = b"".join(len(p).to_bytes(4, "little") + p for p in parts)
    return hashlib.blake2b(b"rsinfer-isolation\0" + packed, digest_size=16).hexdigest()


def extend_digests(digests: list[bytes], tokens: list[int], page_size: int, upto_pages: int,
                   root: bytes = b"") -> None:
    """Append the digests of pages len(digests)..upto_pages-1 (pages that are full in `tokens`); `root` is the
    first page's parent (`prefix_root`)."""
    upto_pages = min(upto_pages, len(tokens) // page_size)
    for i in range(len(digests), upto_pages):
        parent = digests[i - 1] if i else root
        digests.append(chain_digest(parent, tokens[i * page_size:(i + 1) * page_size]))
