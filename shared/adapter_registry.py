"""The LoRA adapter registry: which adapters clients may name as `model`, their base model and where their PEFT
folder is, in one Redis hash (`rsinfer:adapters`, `Keys.adapters`: field = name, value = an `AdapterRecord`),
so that every API process and every scheduler sees the same adapters.

The API registers and unregisters them (`POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`,
services/api/lora_api/adapters.py) and resolves a request's `model`; schedulers resolve the names of the requests they
admit and serve the folders (services/scheduler/registered_adapters.py); `--lora-modules` registers some at start
on either.
Each registration has a new `version`: the engine knows an adapter by `name@version` (`AdapterRecord.identity`),
so a name unloaded and loaded again (perhaps from other weights) never reuses the old one's KV pages or slot.
The number of registrations is bounded (--max-adapters), checked and written in one script.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath
from urllib.parse import unquote, urlsplit

import msgspec
from redis.asyncio import Redis

from shared.keys import Keys
from shared.messages import AdapterRecord, decode, encode
from shared.object_store import check_prefix
from shared.storage_url import StorageLocation, parse_storage_url

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+-]*")

# KEYS[1] the registry; ARGV: name, record JSON, most registrations, "new" (refuse a name taken) or "config" (keep
# an equal registration, replace another: --lora-modules). Returns {1, record} written, {0, current} kept, {-1}
# full.
_REGISTER = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if current then
  if ARGV[4] == 'new' then return {0, current} end
  local old, new = cjson.decode(current), cjson.decode(ARGV[2])
  if old.base == new.base and (old.path or '') == (new.path or '') and (old.stored or '') == (new.stored or '') then
    return {0, current}
  end
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  return {1, ARGV[2]}
end
if redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then return {-1, ''} end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return {1, ARGV[2]}
"""


class RegistryFull(Exception):
    """--max-adapters registrations already."""


@dataclass(frozen=True)
class Module:
    """One `--lora-modules` entry."""

    name: str
    path: str
    base: str | None = None


def parse_lora_modules(text: str) -> list[Module]:
    """`name=path` entries and vLLM's JSON objects ({"name", "path", "base_model_name"}), separated by spaces;
    ValueError naming the entry that is neither."""
    out, i, decoder = [], 0, json.JSONDecoder()
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        if text[i] == "{":
            try:
                obj, i = decoder.raw_decode(text, i)
            except ValueError as e:
                raise ValueError(f"--lora-modules: a JSON entry does not parse: {e}") from None
            if not isinstance(obj, dict) or not all(isinstance(obj.get(k), str) for k in ("name", "path")):
                raise ValueError(f"--lora-modules: {obj!r} needs string `name` and `path`")
            base = obj.get("base_model_name")
            out.append(Module(obj["name"], obj["path"], base if isinstance(base, str) else None))
            continue
        end = i
        while end < len(text) and not text[end].isspace():
            end += 1
        name, eq, path = text[i:end].partition("=")
        if not eq or not name or not path:
            raise ValueError(f"--lora-modules: {text[i:end]!r} is not name=path")
        out.append(Module(name, path))
        i = end
    return out


def name_problem(name: object, max_chars: int) -> str | None:
    """Why `name` cannot name an adapter, or None."""
    if not isinstance(name, str) or not name:
        return "lora_name must be a non-empty string"
    if len(name) > max_chars:
        return f"lora_name has {len(name)} characters; at most {max_chars} (--max-lora-name-chars)"
    if not NAME.fullmatch(name):
        return ("lora_name may hold letters, digits and . _ : / + - only, and starts with a letter or a digit; got "
                f"{name[:80]!r}")
    return None


def locate(lora_path: str, storage_url: str, max_chars: int, roots: str = "", configured: bool = False
           ) -> tuple[str, str]:
    """(path, stored) of a `lora_path`: an absolute local folder inside one of `roots` (--lora-roots), or an s3://
    or file:// URL inside the object store `storage_url` names (its key prefix there). ValueError saying what is
    wrong. The one check of every adapter path, whoever registers it (an admin's load, --lora-modules of an API
    process or a scheduler). `configured`: a path the operator named in --lora-modules, which is loaded wherever
    it lies (the roots bound what an HTTP request may make the server look at, not the operator's own flags)."""
    if not lora_path:
        raise ValueError("lora_path must be a non-empty string")
    if len(lora_path) > max_chars:
        raise ValueError(f"lora_path has {len(lora_path)} characters; at most {max_chars} (--max-lora-path-chars)")
    if "\0" in lora_path:
        raise ValueError("lora_path holds a NUL character")
    if "://" not in lora_path:
        if not lora_path.startswith("/"):
            raise ValueError(f"lora_path must be an absolute path or a URL of the object store; got {lora_path!r}")
        return (os.path.realpath(lora_path) if configured else inside_roots(lora_path, roots)), ""
    store = parse_storage_url(storage_url)
    inside = _inside_store(lora_path, store)
    if inside is not None:
        return "", inside
    if lora_path.startswith("file://"):
        path = unquote(urlsplit(lora_path).path)
        return (os.path.realpath(path) if configured else inside_roots(path, roots)), ""
    raise ValueError(f"lora_path {lora_path!r} is not in the object store --storage-url names "
                     f"({storage_url or 'the local default'}); a folder outside it is given as an absolute path")


def inside_roots(path: str, roots: str) -> str:
    """The real path of a local folder (symlinks and `..` resolved) that lies under one of `roots` (--lora-roots,
    separated by spaces); else a ValueError that says so and nothing of the path (whether it exists, what it
    is): a load never probes the server's filesystem outside the roots. No roots: no local folder."""
    allowed = [os.path.realpath(r) for r in roots.split()]
    if not allowed:
        raise ValueError("lora_path: local adapter folders are not loaded by this server (give --lora-roots, the "
                         "directories they may come from), or give a URL in its object store (--storage-url)")
    real = os.path.realpath(path)
    if not any(real == r or real.startswith(r.rstrip("/") + "/") for r in allowed):
        raise ValueError(f"lora_path must lie inside --lora-roots ({' '.join(roots.split())})")
    return real


def _inside_store(url: str, store: StorageLocation) -> str | None:
    """The key prefix of `url` in `store`, or None when it lies outside."""
    parts = urlsplit(url)
    if parts.scheme == "s3" and store.scheme == "s3" and parts.netloc == store.bucket:
        key = parts.path.strip("/")
        root = store.path.strip("/")
    elif parts.scheme == "file" and store.scheme == "file":
        key = str(PurePosixPath(unquote(parts.path))).strip("/")
        root = store.path.strip("/")
    else:
        return None
    if root and not key.startswith(root + "/"):
        return None
    prefix = key[len(root):].strip("/")
    return check_prefix(prefix) if prefix else None


def new_record(name: str, base: str, path: str, stored: str, *, rank: int = 0,
               targets: Iterable[str] = ()) -> AdapterRecord:
    return AdapterRecord(name=name, base=base, version=secrets.token_hex(4), path=path, stored=stored, rank=rank,
                         targets=list(targets), created_at=round(time.time(), 3))


def adapter_name(identity: str) -> str:
    """The registered name of an engine's adapter (`name@version`)."""
    return identity.rpartition("@")[0] or identity


def _record(raw: bytes | str | None) -> AdapterRecord | None:
    if raw is None:
        return None
    try:
        record = decode(raw, AdapterRecord)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None  # a hand-written field: not an adapter we can serve
    return record  # type: ignore[return-value]


async def register(redis: Redis, keys: Keys, record: AdapterRecord, max_adapters: int, mode: str = "new"
                   ) -> tuple[bool, AdapterRecord | None]:
    """(written, the registration now in place). `mode` "new": a name already registered is kept (written False);
    "config": an equal registration is kept, another replaced. RegistryFull past `max_adapters`."""
    written, now = await redis.eval(_REGISTER, 1, keys.adapters(), record.name, encode(record), max_adapters, mode)
    if int(written) < 0:
        raise RegistryFull(f"{max_adapters} LoRA adapters are registered, the most this server keeps "
                           "(--max-adapters); unload one first")
    return int(written) == 1, _record(now)


async def unregister(redis: Redis, keys: Keys, name: str) -> AdapterRecord | None:
    """Remove a registration; the record it had, or None if there was none."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hget(keys.adapters(), name)
        pipe.hdel(keys.adapters(), name)
        raw, gone = await pipe.execute()
    return _record(raw) if gone else None


async def lookup(redis: Redis, keys: Keys, names: list[str]) -> dict[str, AdapterRecord]:
    """The registrations of those of `names` that are registered."""
    if not names:
        return {}
    raws = await redis.hmget(keys.adapters(), names)
    return {n: r for n, raw in zip(names, raws, strict=True) if (r := _record(raw)) is not None}


async def registered(redis: Redis, keys: Keys) -> dict[str, AdapterRecord]:
    """Every registration (at most --max-adapters)."""
    raw = await redis.hgetall(keys.adapters())
    out = {}
    for field, value in raw.items():
        record = _record(value)
        if record is not None:
            out[field.decode() if isinstance(field, bytes) else field] = record
    return out
