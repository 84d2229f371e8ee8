"""Named API keys and their policies, read from `--api-keys-file` (docs/operator-guide.md, "Tenants").

The file is YAML or JSON: a list of entries (or `{"keys": [...]}`), each

    key: <the bearer key>            # at least 32 characters; or, so the file need not hold it:
                                     #   key_hash: pbkdf2_sha256$<iterations>$<salt>$<base64 hash> (salted;
                                     #   `rsinfer hash-key` writes it), or key_sha256: <hex SHA-256 of it>
    tenant: team-a                   # [A-Za-z0-9._-]{1,64}: the name requests, quotas and usage go under
                                     # (`default` is --api-key's: reserved)
    admin: false                     # the operator endpoints; sees every tenant's requests
    models: [rsinfer-demo]           # the `model`s it may ask for; omitted: every model
    max_concurrent: 8                # requests open at once, every API process together; omitted: no limit
    requests_per_minute: 600         # omitted: no limit
    tokens_per_minute: 100000        # prompt plus generated tokens; omitted: no limit
    priority: [0, 10]                # the `priority` range it may ask for; omitted: any
    background: false                # may send `background: true`
    weight: 1                        # its share of the tokenizers' releases under fair queueing (1 to 1000)
    cache_salt: shared-docs          # prefix-cache scope: tenants naming the same one share cached prefixes;
                                     #   omitted: the tenant's own (its name), shared with no other tenant

Keys are held only as HMAC-SHA256 digests under a secret of this process, and a presented key is compared with
every one in constant time. A `key_hash` entry (PBKDF2-HMAC-SHA256 with its own salt, Django's format) is checked
by deriving the presented key with each such entry's salt, off the event loop and one derivation at a time
(`find`); a key that matched one is remembered by its digest as the others are, so only its first request in a
process pays the derivations. `key_sha256` stays accepted: files written before have it, and for a key of 32 or
more random characters (what `rsinfer hash-key --new` makes) an unsalted SHA-256 can be neither reversed nor
looked up, at no cost per request; `key_hash` is for keys that may be guessable (each presented key unknown to a
process costs one derivation per `key_hash` entry: past MAX_DERIVING waiting, a 503).

Several entries may name one tenant (a key being rotated: both are valid while both are listed); they must then
agree on the policy, since the tenant's quota is one. `KeyRing` re-reads the file when it changes (checked at most
every --api-keys-check-s), so a key added to the Secret is honoured and one removed from it refused without a
restart; a file that no longer parses keeps the keys read last (and is logged).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import yaml

log = logging.getLogger(__name__)

TENANT_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
MIN_KEY_CHARS = 32  # a guessable key is a leaked key: 32 characters of a random key are ~190 bits
KEY_FORMS = ("key", "key_hash", "key_sha256")
PBKDF2 = "pbkdf2_sha256"
PBKDF2_ITERATIONS = (100_000, 5_000_000)  # what a `key_hash` may ask: slow enough to guess, bounded per request
MAX_DERIVING = 8  # presented keys waiting for a `key_hash` check at once; past it a 503 (module doc)
FIELDS = {*KEY_FORMS, "tenant", "admin", "models", "max_concurrent", "requests_per_minute",
          "tokens_per_minute", "priority", "background", "weight", "cache_salt"}
LIMITS = ("max_concurrent", "requests_per_minute", "tokens_per_minute")
MAX_WEIGHT = 1000
MAX_CACHE_SALT = 256  # a policy's and a request's `cache_salt`, in characters
LEGACY_TENANT = "default"  # the tenant of --api-key (one admin key, no limits)


class KeyFileError(ValueError):
    """The keys file (or --api-key) is not valid: the message names the entry and the field."""


class KeyCheckBusy(Exception):
    """Too many presented keys wait for a `key_hash` derivation (MAX_DERIVING): answered 503, retry."""


@dataclass(frozen=True)
class SaltedHash:
    """A `key_hash` entry: PBKDF2-HMAC-SHA256 of the key under its salt (Django's `pbkdf2_sha256$...`)."""

    iterations: int
    salt: str
    digest: bytes

    @classmethod
    def parse(cls, text: object, where: str) -> SaltedHash:
        parts = text.split("$") if isinstance(text, str) else []
        low, high = PBKDF2_ITERATIONS
        try:
            ok = len(parts) == 4 and parts[0] == PBKDF2 and parts[2] != "" and low <= int(parts[1]) <= high
            digest = base64.b64decode(parts[3], validate=True) if ok else b""
        except (ValueError, binascii.Error):
            ok = False
        if not ok or len(digest) != 32:
            raise KeyFileError(f"{where}.key_hash: {PBKDF2}$<iterations {low} to {high}>$<salt>$<base64 of the "
                               "32-byte hash> (`rsinfer hash-key` writes it)")
        return cls(int(parts[1]), parts[2], digest)

    @classmethod
    def of(cls, key: str, iterations: int = 600_000, salt: str | None = None) -> SaltedHash:
        salt = salt or secrets.token_urlsafe(16)
        return cls(iterations, salt, hashlib.pbkdf2_hmac("sha256", key.encode(), salt.encode(), iterations))

    def __str__(self) -> str:
        return f"{PBKDF2}${self.iterations}${self.salt}${base64.b64encode(self.digest).decode()}"

    def matches(self, raw: bytes) -> bool:
        return hmac.compare_digest(hashlib.pbkdf2_hmac("sha256", raw, self.salt.encode(), self.iterations),
                                   self.digest)


@dataclass
class KeyTable:
    """What the file says: SHA-256 hex of each `key`/`key_sha256` -> its tenant, and the `key_hash` entries."""

    digests: dict[str, Tenant]
    salted: list[tuple[SaltedHash, Tenant]]


@dataclass(frozen=True)
class Policy:
    """What one tenant may do (module doc); None: no limit."""

    admin: bool = False
    models: frozenset[str] | None = None
    max_concurrent: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    priority: tuple[int, int] | None = None
    background: bool = False
    weight: int = 1  # fair queueing: jobs released per turn (services/tokenizer/fair.py)
    cache_salt: str | None = None  # a prefix-cache scope shared with the tenants naming it (None: its own)

    @property
    def limited(self) -> bool:
        return any(getattr(self, name) is not None for name in LIMITS)


@dataclass(frozen=True)
class Tenant:
    """Who a request comes from: its tenant's name and policy (never its key)."""

    name: str
    policy: Policy

    @property
    def admin(self) -> bool:
        return self.policy.admin

    @property
    def cache_scope(self) -> str:
        """Whose prefix-cache pages its requests may read (shared/pages.py `isolation_salt`): its policy's shared
        salt, else its own name ("" in open mode: one scope for all)."""
        salt = self.policy.cache_salt
        return f"salt:{salt}" if salt is not None else (f"tenant:{self.name}" if self.name else "")


UNLIMITED = Policy(admin=True, background=True)
OPEN = Tenant("", UNLIMITED)  # no key configured: today's open mode, where anyone may do anything


def key_digest(secret: bytes, sha256_hex: str) -> bytes:
    return hmac.new(secret, bytes.fromhex(sha256_hex), hashlib.sha256).digest()


def key_problem(key: object, name: str) -> str | None:
    """Why `key` cannot be a key (None if it can): `name` is how the message names it."""
    if not isinstance(key, str) or len(key) < MIN_KEY_CHARS or key != key.strip():
        return (f"{name}: a string of at least {MIN_KEY_CHARS} characters, without spaces around it (e.g. "
                "`rsinfer hash-key --new`)")
    return None


def _secret_of(entry: dict, where: str) -> str | SaltedHash:
    """The SHA-256 hex of the entry's key, or its salted hash."""
    if sum(form in entry for form in KEY_FORMS) != 1:
        raise KeyFileError(f"{where}: give exactly one of `key`, `key_hash` and `key_sha256`")
    if "key" in entry:
        problem = key_problem(entry["key"], f"{where}.key")
        if problem:
            raise KeyFileError(problem)
        return hashlib.sha256(entry["key"].encode()).hexdigest()
    if "key_hash" in entry:
        return SaltedHash.parse(entry["key_hash"], where)
    digest = entry["key_sha256"]
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", digest):
        raise KeyFileError(f"{where}.key_sha256: 64 hex digits (the SHA-256 of the key)")
    return digest.lower()


def _limit(entry: dict, name: str, where: str) -> int | None:
    value = entry.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise KeyFileError(f"{where}.{name}: a whole number >= 0, or omitted for no limit")
    return value


def _priority(entry: dict, where: str) -> tuple[int, int] | None:
    value = entry.get("priority")
    if value is None:
        return None
    if isinstance(value, dict):
        value = [value.get("min"), value.get("max")]
    ok = (isinstance(value, list) and len(value) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) for v in value) and value[0] <= value[1])
    if not ok:
        raise KeyFileError(f"{where}.priority: [lowest, highest] (or {{min, max}}), whole numbers")
    return value[0], value[1]


def _models(entry: dict, where: str) -> frozenset[str] | None:
    value = entry.get("models")
    if value is None or value == "*" or value == ["*"]:
        return None
    if not isinstance(value, list) or not all(isinstance(m, str) and m for m in value):
        raise KeyFileError(f"{where}.models: a list of model names, or omitted for every model")
    return frozenset(value)


def _weight(entry: dict, where: str) -> int:
    value = entry.get("weight", 1)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WEIGHT:
        raise KeyFileError(f"{where}.weight: a whole number from 1 to {MAX_WEIGHT}")
    return value


def _cache_salt(entry: dict, where: str) -> str | None:
    value = entry.get("cache_salt")
    if value is not None and not (isinstance(value, str) and 1 <= len(value) <= MAX_CACHE_SALT):
        raise KeyFileError(f"{where}.cache_salt: a string of 1 to {MAX_CACHE_SALT} characters, or omitted")
    return value


def _flag(entry: dict, name: str, where: str) -> bool:
    value = entry.get(name, False)
    if not isinstance(value, bool):
        raise KeyFileError(f"{where}.{name}: true or false")
    return value


def parse_entry(entry: Any, where: str) -> tuple[str | SaltedHash, Tenant]:
    """(the SHA-256 hex of its key or its salted hash, its tenant) of one entry of the file."""
    if not isinstance(entry, dict):
        raise KeyFileError(f"{where}: an object with `key` and `tenant`")
    unknown = sorted(set(entry) - FIELDS)
    if unknown:
        raise KeyFileError(f"{where}: unknown field `{unknown[0]}` (known: {', '.join(sorted(FIELDS))})")
    name = entry.get("tenant")
    if not isinstance(name, str) or not TENANT_NAME.match(name):
        raise KeyFileError(f"{where}.tenant: a name of 1 to 64 letters, digits, `.`, `_` or `-`")
    if name == LEGACY_TENANT:  # a name is an identity: this one would take --api-key's objects and policy
        raise KeyFileError(f"{where}.tenant: `{LEGACY_TENANT}` is reserved (the tenant of --api-key); give another "
                           "name")
    policy = Policy(admin=_flag(entry, "admin", where), models=_models(entry, where),
                    priority=_priority(entry, where), background=_flag(entry, "background", where),
                    weight=_weight(entry, where), cache_salt=_cache_salt(entry, where),
                    **{limit: _limit(entry, limit, where) for limit in LIMITS})
    return _secret_of(entry, where), Tenant(name, policy)


def parse_keys(text: str) -> KeyTable:
    """The file's keys and their tenants, from its text (YAML, of which JSON is a subset)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise KeyFileError(f"not YAML or JSON: {e}") from None
    if isinstance(data, dict) and set(data) == {"keys"}:
        data = data["keys"]
    if not isinstance(data, list):
        raise KeyFileError("a list of key entries (or {\"keys\": [...]})")
    keys = KeyTable({}, [])
    policies: dict[str, Policy] = {}
    for i, entry in enumerate(data):
        secret, tenant = parse_entry(entry, f"keys[{i}]")
        if secret in keys.digests or any(secret == s for s, _ in keys.salted):
            raise KeyFileError(f"keys[{i}]: the same key as an entry before it")
        if policies.setdefault(tenant.name, tenant.policy) != tenant.policy:
            raise KeyFileError(f"keys[{i}]: tenant `{tenant.name}` has another policy in an entry before it (the "
                               "entries of one tenant share one policy and one quota)")
        if isinstance(secret, SaltedHash):
            keys.salted.append((secret, tenant))
        else:
            keys.digests[secret] = tenant
    return keys


def read_keys(path: str) -> KeyTable:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise KeyFileError(f"cannot read {path}: {e}") from None
    try:
        return parse_keys(text)
    except KeyFileError as e:
        raise KeyFileError(f"{path}: {e}") from None


def _file_state(path: str) -> tuple[int, int, int] | None:
    """What changes when the file does (a mounted Secret's update swaps a symlink: a new inode)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def check_keys(path: str = "", api_key: str | None = None) -> KeyTable | None:
    """The keys file's table (None without one), or a KeyFileError naming the entry and field (or --api-key):
    what a process checks before it starts (services/api/main.py, rsinfer/up.py)."""
    if api_key:
        problem = key_problem(api_key, "--api-key (RSINFER_API_KEY, --api-key-file)")
        if problem:
            raise KeyFileError(problem)
    return read_keys(path) if path else None


class KeyRing:
    """The keys a request may present: `--api-keys-file`'s, plus `--api-key` (tenant `default`: admin, background,
    no limits). Empty: open mode (`configured` false)."""

    def __init__(self, path: str = "", api_key: str | None = None, check_s: float = 1.0):
        self.path, self.check_s = path, check_s
        self.secret = secrets.token_bytes(32)
        table = check_keys(path, api_key)  # a bad file or key at start: the process does not start
        self.legacy: dict[bytes, Tenant] = {}
        if api_key:
            self.legacy[key_digest(self.secret, hashlib.sha256(api_key.encode()).hexdigest())] = Tenant(
                LEGACY_TENANT, UNLIMITED)
        self.digests: dict[bytes, Tenant] = dict(self.legacy)
        self.salted: list[tuple[SaltedHash, Tenant]] = []
        self.deriving = 0
        self.limiter: anyio.CapacityLimiter | None = None
        self.state: tuple[int, int, int] | None = None
        self.checked_at = 0.0
        if table is not None:
            self._load(table, _file_state(path))

    @property
    def configured(self) -> bool:
        return bool(self.path or self.legacy)

    def _load(self, keys: KeyTable, state: tuple[int, int, int] | None) -> None:
        # a key that matched a `key_hash` entry is forgotten with the file it was checked against
        self.digests = {**self.legacy, **{key_digest(self.secret, sha): t for sha, t in keys.digests.items()}}
        self.salted = keys.salted
        self.state = state
        tenants = {t.name for t in self.digests.values()} | {t.name for _, t in self.salted}
        log.info("api keys: %d keys of %d tenants", len(self.digests) + len(self.salted), len(tenants))

    def refresh(self, now: float | None = None) -> None:
        """Re-read the file if it changed since the last look (at most every check_s)."""
        now = time.monotonic() if now is None else now
        if not self.path or now - self.checked_at < self.check_s:
            return
        self.checked_at = now
        state = _file_state(self.path)
        if state == self.state:
            return
        try:
            self._load(read_keys(self.path), state)
        except KeyFileError as e:
            self.state = state  # logged once per change, not at every look
            log.error("api keys file changed but is not valid; keeping the keys read before: %s", e)

    def named(self, name: str) -> Tenant | None:
        """The tenant of that name as the keys now say (work that runs without a request of its own: a batch's
        lines), None if no key of it is left."""
        self.refresh()
        every = [*self.digests.values(), *(t for _, t in self.salted)]
        return next((t for t in every if t.name == name), None)

    def tenant(self, presented: str | bytes | None) -> Tenant | None:
        """The tenant of a presented key (OPEN in open mode), None for an unknown one, from the digests alone (a
        key of a `key_hash` entry once `find` has matched it). Every stored digest is compared, in constant
        time, whichever matches."""
        if not self.configured:
            return OPEN
        self.refresh()
        if not presented:
            return None
        digest = key_digest(self.secret, hashlib.sha256(_raw(presented)).hexdigest())
        found = None
        for stored, tenant in self.digests.items():
            if hmac.compare_digest(stored, digest):
                found = tenant
        return found

    async def find(self, presented: str | bytes | None) -> Tenant | None:
        """`tenant`, then the `key_hash` entries (module doc): KeyCheckBusy while MAX_DERIVING keys wait."""
        found = self.tenant(presented)
        if found is not None or not presented or not self.salted:
            return found
        if self.deriving >= MAX_DERIVING:
            raise KeyCheckBusy
        if self.limiter is None:
            self.limiter = anyio.CapacityLimiter(1)  # one derivation at a time: a flood of keys costs one core
        raw, salted = _raw(presented), self.salted
        self.deriving += 1
        try:
            found = await anyio.to_thread.run_sync(_match, salted, raw, limiter=self.limiter)
        finally:
            self.deriving -= 1
        if found is not None and salted is self.salted:  # the file was not reloaded meanwhile
            self.digests[key_digest(self.secret, hashlib.sha256(raw).hexdigest())] = found
        return found


def _raw(presented: str | bytes) -> bytes:
    return presented.encode() if isinstance(presented, str) else presented


def _match(salted: list[tuple[SaltedHash, Tenant]], raw: bytes) -> Tenant | None:
    return next((tenant for hashed, tenant in salted if hashed.matches(raw)), None)
