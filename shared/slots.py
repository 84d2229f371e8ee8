"""Redis Cluster hash slots: which slot a key lands in, and request uids made to land in a chosen one.

Every key of a request carries its uid as hash tag (`rsinfer:req:{<uid>}`, shared/keys.py), so they share one
slot, CRC16(uid) mod 16384. The reply hub reads the reply streams of many requests, and its control stream, in
one XREAD, which a cluster allows only within one slot: so an API process makes the uids of the requests one
hub shard reads fall in that shard's slot (`uid_in_slot`). CRC16 (XMODEM, as Redis computes it) is linear over
GF(2) for messages of one length, so flipping chosen bits of a random uid moves its CRC by the XOR of what each
flip alone moves it: 14 independent flips reach any slot. The uid stays 32 lowercase hex characters.
"""

from __future__ import annotations

import binascii
import functools
import secrets

from redis.crc import key_slot as _key_slot

SLOTS = 16384
UID_LEN = 32
# Hex digits whose lowest bit can flip without leaving the alphabet: 0<->1 ... 8<->9, b<->c, d<->e.
PAIRED = "0123456789bcde"
_PAIRED_BYTES = PAIRED.encode()


def key_slot(key: str) -> int:
    """The cluster slot of a key (its hash tag's, when it has one), as Redis computes it."""
    return _key_slot(key.encode())


def _crc(data: bytes) -> int:
    return binascii.crc_hqx(data, 0) & (SLOTS - 1)


def _flip_basis() -> list[tuple[int, int, int]]:
    """(slot bits a flip moves, its positions' mask, the position it flips) for 14 independent flips among the
    uid's last characters, each row reduced on its leading bit (Gauss-Jordan over GF(2))."""
    rows: list[tuple[int, int, int]] = []
    for pos in range(UID_LEN - 1, -1, -1):
        unit = bytearray(UID_LEN)
        unit[pos] = 1
        vec, mask = _crc(bytes(unit)), 1 << pos
        for rvec, rmask, _ in rows:
            if vec ^ rvec < vec:  # rvec's leading bit is set in vec
                vec, mask = vec ^ rvec, mask ^ rmask
        if vec:
            lead = vec.bit_length() - 1
            rows = [(r ^ vec, m ^ mask, p) if r >> lead & 1 else (r, m, p) for r, m, p in rows]
            rows.append((vec, mask, pos))
            rows.sort(reverse=True)
        if len(rows) == SLOTS.bit_length() - 1:
            return rows
    raise AssertionError("CRC16 flips do not span the slots")


_BASIS = _flip_basis()
_ADJUSTABLE = sorted({p for _, mask, _ in _BASIS for p in range(UID_LEN) if mask >> p & 1})


def uid_in_slot(slot: int) -> str:
    """A random uid (32 hex characters, ~110 random bits) whose key_slot is `slot`."""
    chars = bytearray(secrets.token_hex(UID_LEN // 2).encode())
    for pos, r in zip(_ADJUSTABLE, secrets.token_bytes(len(_ADJUSTABLE)), strict=True):
        chars[pos] = _PAIRED_BYTES[r % len(_PAIRED_BYTES)]  # characters we may flip: paired digits only
    need = _crc(bytes(chars)) ^ slot
    flips = 0
    for vec, mask, _ in _BASIS:
        if need ^ vec < need:
            need, flips = need ^ vec, flips ^ mask
    for pos in _ADJUSTABLE:
        if flips >> pos & 1:
            chars[pos] ^= 1
    return chars.decode()


@functools.lru_cache(maxsize=1024)
def slot_tag(key: str) -> str:
    """The hash tag in `key`'s slot (`tag_in_slot`): cached, since shared/keys.py names the few keys it is asked
    for (one model's) every time it builds a key beside them."""
    return tag_in_slot(key_slot(key))


@functools.lru_cache(maxsize=256)
def tag_in_slot(slot: int) -> str:
    """The smallest decimal number whose key_slot as a hash tag is `slot`: a short tag every process computes
    alike, so keys that must share a slot with an untagged key can be named by anyone (shared/keys.py)."""
    n = 0
    while _crc(str(n).encode()) != slot:
        n += 1
    return str(n)
