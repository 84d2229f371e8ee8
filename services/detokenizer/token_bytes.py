"""Each token's own bytes, for logprobs' `bytes`: what the vocabulary says the token stands for, so that a client
joining the bytes of a choice's tokens gets its text back, characters split across tokens included. Decoding one
token alone cannot give them: a token holding part of a multi-byte character decodes to U+FFFD.

- byte-level BPE (GPT-2, Qwen, Llama 3: a ByteLevel decoder): each character of the piece stands for one byte;
- SentencePiece (a Metaspace decoder or byte fallback): `<0xAB>` is that byte, `▁` a space;
- special and added tokens, and any other vocabulary, are their text in UTF-8.
"""

from __future__ import annotations

import re

BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
METASPACE = "\u2581"


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted: printable bytes stand for themselves, the others for the
    characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenBytes:
    """token id -> its bytes, computed once per id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = repr(getattr(backend, "decoder", None)) if backend is not None else ""
        self.byte_level = byte_level_alphabet() if "ByteLevel" in decoder else None
        self.metaspace = "Metaspace" in decoder or "ByteFallback" in decoder
        self.added = set(getattr(tokenizer, "added_tokens_decoder", {}) or ())
        self._cache: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> list[int]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = list(self._bytes(token_id))
        return found

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and self.byte_level is not None and all(c in self.byte_level for c in piece):
            return bytes(self.byte_level[c] for c in piece)
        if isinstance(piece, str) and self.metaspace:
            byte = BYTE_PIECE.fullmatch(piece)
            return bytes([int(byte.group(1), 16)]) if byte else piece.replace(METASPACE, " ").encode()
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
