"""The `encrypted_content` of reasoning items (`include: ["reasoning.encrypted_content"]`): a response's reasoning
sealed with the server's key so that a stateless client (`store: false`, as Codex runs) can hand it back on its
next turn without the server keeping anything, and can neither read it nor forge or alter it.

AES-256-GCM: a random 96-bit nonce per value, the tenant's and the model's names as associated data (a value
sealed for one tenant or model is not accepted for another: a tenant cannot have another's reasoning put into its
prompt), the output URL-safe base64 of nonce and ciphertext with its tag. The key is --responses-key (or
--responses-key-file): 32 bytes as base64. Every API process of a deployment needs the same key (a value sealed
by one is opened by the next turn's, whichever it is); without one each process makes its own at start, with a
warning, and values it sealed are refused by any other process and after a restart.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from services.api.errors import BadRequest

log = logging.getLogger(__name__)

KEY_BYTES, NONCE_BYTES = 32, 12
VERSION = b"rsinfer-reasoning-1:"  # bound into the associated data: a later layout never opens an older value


def key_from_setting(text: str | None) -> bytes:
    """The key of --responses-key (base64 of 32 bytes), or a new one for this process only (with a warning)."""
    if not text:
        log.warning("no --responses-key(-file): reasoning encrypted_content is sealed with a key of this process "
                    "only; another API process, or this one after a restart, refuses it (a 400)")
        return AESGCM.generate_key(bit_length=KEY_BYTES * 8)
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise ValueError("--responses-key must be 32 bytes as base64 (e.g. `openssl rand -base64 32`)")
    return key


def bound_to(model: str, tenant: str) -> bytes:
    """The associated data of a sealed value: whose and for which model (unambiguous: a JSON list)."""
    return VERSION + orjson.dumps([tenant, model])


class Sealer:
    """Seals and opens reasoning text for one deployment's key."""

    def __init__(self, key: bytes):
        self.aead = AESGCM(key)

    def seal(self, reasoning: str, model: str, tenant: str) -> str:
        nonce = os.urandom(NONCE_BYTES)
        sealed = self.aead.encrypt(nonce, orjson.dumps({"text": reasoning}), bound_to(model, tenant))
        return base64.urlsafe_b64encode(nonce + sealed).decode()

    def open(self, value: str, model: str, tenant: str, param: str) -> str:
        """The reasoning text of a value this deployment sealed for `model` and `tenant`; anything else is a 400
        naming `param` (a value altered, forged, sealed under another key, for another model or tenant)."""
        try:
            raw = base64.urlsafe_b64decode(value.encode())
            plain = self.aead.decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], bound_to(model, tenant))
            text = orjson.loads(plain)["text"]
        except (binascii.Error, ValueError, InvalidTag, KeyError, TypeError, UnicodeEncodeError):
            raise BadRequest(f"`{param}` is not reasoning this server sealed for model `{model[:80]}` (altered, "
                             "or sealed under another key: see --responses-key)", param) from None
        if not isinstance(text, str):
            raise BadRequest(f"`{param}` is not reasoning this server sealed", param)
        return text
