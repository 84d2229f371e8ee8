"""Object storage for what does not belong in Redis: the contents of Batch API files (input, output and error
JSONL) and LoRA adapter folders (adapter_config.json + adapter_model.safetensors).

One interface, `ObjectStore` (shared/object_store.py: its errors, keys and folder fetches), with two backends
chosen by `--storage-url` (`open_store`, below; the URL is parsed by shared/storage_url.py):
- `LocalStore` (shared/local_store.py: `file:///dir`, the default, a directory under the user's cache dir).
- `S3Store` (shared/s3_store.py: `s3://bucket/prefix`, any S3-compatible server through
  `--storage-endpoint-url`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from shared.local_store import LocalStore
from shared.object_store import ObjectStore
from shared.s3_store import S3Options, S3Store
from shared.storage_url import cache_root, parse_storage_url

if TYPE_CHECKING:
    from shared.settings import StorageSettings


def open_store(settings: StorageSettings) -> ObjectStore:
    """The store `settings` name. Creates nothing remote; call `check()` to fail early on a bad one."""
    where = parse_storage_url(settings.storage_url)
    cache_dir = Path(settings.storage_cache_dir).expanduser() if settings.storage_cache_dir else (
        cache_root() / "storage-cache")
    if where.scheme == "s3":
        s3 = S3Options(settings.storage_endpoint_url, settings.storage_region, settings.storage_addressing_style,
                       settings.storage_part_bytes)
        return S3Store(where.bucket, where.path, max_bytes=settings.max_file_bytes, cache_dir=cache_dir, s3=s3)
    return LocalStore(where.path, max_bytes=settings.max_file_bytes, cache_dir=cache_dir)
