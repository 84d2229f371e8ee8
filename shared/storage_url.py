"""Where the object store is (`--storage-url`): a URL parsed into a `StorageLocation`, with no store opened, so
that settings can check the flag and the adapter registry can tell whether a path lies inside the store."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from shared.object_store import check_prefix


def cache_root() -> Path:
    """`$RSINFER_CACHE`, else ~/.cache/rsinfer (where shared/demo_model.py keeps the demo model too)."""
    return Path(os.environ.get("RSINFER_CACHE") or Path.home() / ".cache" / "rsinfer")


@dataclass(frozen=True)
class StorageLocation:
    scheme: str  # "file" or "s3"
    path: str  # file: the directory; s3: the key prefix (may be empty)
    bucket: str = ""


def parse_storage_url(url: str) -> StorageLocation:
    """`file:///dir`, a plain directory path, `s3://bucket[/prefix]`; empty = `<cache root>/storage`."""
    if not url:
        return StorageLocation("file", str(cache_root() / "storage"))
    parts = urlsplit(url)
    if parts.scheme == "s3":
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", parts.netloc):
            raise ValueError(f"storage URL {url!r}: no valid bucket name after s3://")
        if parts.query or parts.fragment:
            raise ValueError(f"storage URL {url!r}: no query or fragment is allowed")
        prefix = parts.path.strip("/")
        if prefix:
            check_prefix(prefix)
        return StorageLocation("s3", prefix, parts.netloc)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise ValueError(f"storage URL {url!r}: a file URL is file:///absolute/path")
        return StorageLocation("file", unquote(parts.path))
    if parts.scheme == "" and "\0" not in url:
        return StorageLocation("file", str(Path(url).expanduser().absolute()))
    raise ValueError(f"storage URL {url!r}: use file:///path or s3://bucket/prefix")
