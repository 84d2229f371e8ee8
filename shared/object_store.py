"""The object store's interface (`ObjectStore`, its backends chosen in shared/storage.py), its errors, and the keys
both backends accept.

Keys are `/`-separated relative names (`files/file-abc`, `adapters/sql/adapter_config.json`), checked the
same way on both backends (`check_key`), so a key can never name a path outside the store's root, and a
file that works on one backend works on the other. Every write and every whole read has a byte cap
(`--max-file-bytes`, or the caller's): past it, `TooLarge`, and nothing is left behind.

`fetch_folder` copies every object under a prefix into a local cache directory (for loaders that want
paths, such as safetensors and PEFT): downloaded under a temp name and renamed whole, named after a digest
of the listing, so a changed folder is a new directory and a partial one never appears.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("rsinfer.storage")

MiB = 1 << 20
MAX_KEY_BYTES = 1024  # S3's limit on a key
MAX_SEGMENT_BYTES = 255  # a file name on every common filesystem
TMP_DIR = ".rsinfer-tmp"  # the local root's temp files; no key may start with it
STALE_TMP_S = 3600.0  # temp files and folders of a process that died are swept after this
_CONTROL = re.compile(r"[\x00-\x1f\x7f\\]")


class StorageError(Exception):
    """Object storage failed or is misconfigured (unreachable endpoint, missing bucket, denied...)."""


class NotFound(StorageError):
    """No object under this key (or nothing under this folder prefix)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"no stored object '{key}'")
        self.key = key


class InvalidKey(StorageError, ValueError):
    """A key or prefix that could escape the store's root or is not portable between backends."""


class TooLarge(StorageError):
    """More bytes (or, for a folder, files) than the cap allows. The API answers 413 and names its field;
    the store has kept nothing of the refused upload."""

    def __init__(self, key: str, limit: int, what: str = "bytes") -> None:
        super().__init__(f"'{key}' is over the limit of {limit} {what}")
        self.key = key
        self.limit = limit
        self.what = what


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    version: str  # changes whenever the object is rewritten: the S3 ETag, locally mtime, size and inode


def check_key(key: str) -> str:
    """`key` when it is a safe, portable object name, else InvalidKey: relative, `/`-separated, no empty,
    `.` or `..` segment, no NUL, control character or backslash, at most 1024 bytes (S3's limit)."""
    if not isinstance(key, str) or not key:
        raise InvalidKey("an object key must be a non-empty string")
    _check_chars(key)
    segments = key.split("/")
    if any(s in ("", ".", "..") for s in segments):
        raise InvalidKey(f"object key {key!r} has an empty, '.' or '..' segment (or starts with '/')")
    _check_segments(key, segments)
    return key


def check_prefix(prefix: str) -> str:
    """`prefix` when it is empty or a key's beginning (it may end with `/` or in the middle of a segment)."""
    if prefix == "":
        return prefix
    if not isinstance(prefix, str):
        raise InvalidKey("a prefix must be a string")
    _check_chars(prefix)
    segments = prefix.split("/")
    if segments[-1] == "":
        segments.pop()
    if not segments or any(s in ("", ".", "..") for s in segments):
        raise InvalidKey(f"prefix {prefix!r} has an empty, '.' or '..' segment (or starts with '/')")
    _check_segments(prefix, segments)
    return prefix


def _check_chars(name: str) -> None:
    if _CONTROL.search(name):
        raise InvalidKey(f"{name!r} holds a NUL, control character or backslash")
    if len(name.encode()) > MAX_KEY_BYTES:
        raise InvalidKey(f"{name[:64]!r}... is longer than {MAX_KEY_BYTES} bytes")


def _check_segments(name: str, segments: list[str]) -> None:
    if segments[0] == TMP_DIR:
        raise InvalidKey(f"{name!r}: '{TMP_DIR}' is reserved")
    if any(len(s.encode()) > MAX_SEGMENT_BYTES for s in segments):
        raise InvalidKey(f"{name!r} has a segment longer than {MAX_SEGMENT_BYTES} bytes")


class ObjectReader:
    """An object being read: `info` (its size for a Content-Length) and its bytes as chunks. Iterating to the
    end, `aclose()` or `async with` releases what the read holds (a file, a connection), even unread."""

    def __init__(self, info: ObjectInfo, read: Callable[[], Awaitable[bytes]], close: Callable[[], None]) -> None:
        self.info = info
        self._read = read
        self._close = close
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            while chunk := await self._read():
                yield chunk
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._close()

    async def __aenter__(self) -> ObjectReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class ObjectStore(abc.ABC):
    """What the Batch API (file contents) and LoRA loading (adapter folders) store through. All methods are
    coroutines; blocking I/O runs on the store's own thread pool of `threads` threads."""

    def __init__(self, url: str, *, max_bytes: int, cache_dir: Path, threads: int = 8) -> None:
        self.url = url
        self.max_bytes = max_bytes  # the default cap of put, put_stream, get and fetch_folder
        self.cache_dir = Path(cache_dir)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="storage")
        self._fetching: dict[str, asyncio.Future[Path]] = {}

    async def _io(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    # --- what each backend implements

    @abc.abstractmethod
    async def put_stream(self, key: str, chunks: AsyncIterable[bytes], *, max_bytes: int | None = None) -> int:
        """Store the chunks as `key` (replacing any object there) and return its size. Past `max_bytes`
        (default: the store's cap) raise TooLarge at once, leaving the previous object, if any, untouched;
        a failure or cancellation mid-way leaves nothing either."""

    @abc.abstractmethod
    async def get_stream(self, key: str, *, chunk_size: int = MiB) -> ObjectReader:
        """Open `key` for reading in chunks (NotFound now, not at the first chunk, so an HTTP handler can
        answer 404 before it starts a response). The caller must read it to the end or close it."""

    @abc.abstractmethod
    async def stat(self, key: str) -> ObjectInfo:
        """Size and version of `key`; NotFound if there is none."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove `key`; nothing there is not an error (idempotent)."""

    @abc.abstractmethod
    def list_objects(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Every object whose key starts with `prefix`, in key order."""

    @abc.abstractmethod
    async def check(self) -> None:
        """StorageError unless the store can be used (the directory is writable, the bucket reachable): for a
        process to fail at start rather than at its first upload."""

    # --- built on those

    async def put(self, key: str, data: bytes, *, max_bytes: int | None = None) -> int:
        async def one() -> AsyncIterator[bytes]:
            yield data

        return await self.put_stream(key, one(), max_bytes=max_bytes)

    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """The whole object, in memory: TooLarge past `max_bytes` (default: the store's cap)."""
        limit = self.max_bytes if max_bytes is None else max_bytes
        async with await self.get_stream(key) as reader:
            if reader.info.size > limit:
                raise TooLarge(key, limit)
            out = bytearray()
            async for chunk in reader:
                out += chunk
                if len(out) > limit:
                    raise TooLarge(key, limit)
        return bytes(out)

    async def exists(self, key: str) -> bool:
        try:
            await self.stat(key)
        except NotFound:
            return False
        return True

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def fetch_folder(self, prefix: str, *, max_bytes: int | None = None, max_files: int = 256) -> Path:
        """Every object under `prefix` (a folder: `adapters/sql` means `adapters/sql/...`) copied into a local
        directory, whose path is returned, with the keys' remainders as relative paths. At most `max_files`
        objects and `max_bytes` in all (default: the store's cap), else TooLarge; none, NotFound; a key that
        would leave the directory, InvalidKey. The directory is named after a digest of the listing: fetched
        again unchanged, it is reused without a download; changed, it is a new directory. It appears whole
        or not at all, and concurrent fetches of one folder share one download (across processes, the first
        rename wins and the others reuse it)."""
        folder = check_prefix(prefix).rstrip("/") + "/"
        if folder == "/":
            raise InvalidKey("fetch_folder needs a non-empty prefix")
        limit = self.max_bytes if max_bytes is None else max_bytes
        objects = await self._folder_listing(folder, limit, max_files)
        final = self.cache_dir / self._cache_name(folder, objects)
        if final.is_dir():
            return final
        pending = self._fetching.get(final.name)
        if pending is None:
            pending = asyncio.ensure_future(self._download_folder(folder, objects, final, limit))
            self._fetching[final.name] = pending
            pending.add_done_callback(lambda f: self._download_done(final.name, f))
        return await asyncio.shield(pending)

    async def evict_folder(self, prefix: str) -> int:
        """Remove every cached copy of folder `prefix` (e.g. once an adapter is unloaded and its weights are
        in memory or dropped); returns how many went. Paths fetch_folder returned before stop existing."""
        folder = check_prefix(prefix).rstrip("/") + "/"
        stem = self._cache_stem(folder)
        gone = 0
        if self.cache_dir.is_dir():
            for path in self.cache_dir.iterdir():
                if path.name.startswith(stem + "-") and path.is_dir():
                    await self._io(shutil.rmtree, path, True)
                    gone += 1
        return gone

    async def _folder_listing(self, folder: str, limit: int, max_files: int) -> list[tuple[str, ObjectInfo]]:
        objects: list[tuple[str, ObjectInfo]] = []
        total = 0
        async for info in self.list_objects(folder):
            if len(objects) >= max_files:
                raise TooLarge(folder, max_files, "files")
            rel = info.key[len(folder):]
            try:
                check_key(rel)
            except InvalidKey as e:
                raise InvalidKey(f"folder '{folder}' holds an object that cannot be a local file: {e}") from None
            total += info.size
            if total > limit:
                raise TooLarge(folder, limit)
            objects.append((rel, info))
        if not objects:
            raise NotFound(folder)
        return objects

    def _cache_stem(self, folder: str) -> str:
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", folder.rstrip("/"))[-48:].lstrip(".")
        where = hashlib.sha256(f"{self.url}\0{folder}".encode()).hexdigest()[:8]
        return f"{slug}-{where}"

    def _cache_name(self, folder: str, objects: list[tuple[str, ObjectInfo]]) -> str:
        listing = json.dumps([[rel, i.size, i.version] for rel, i in objects]).encode()
        return f"{self._cache_stem(folder)}-{hashlib.sha256(listing).hexdigest()[:16]}"

    def _download_done(self, name: str, future: asyncio.Future[Path]) -> None:
        self._fetching.pop(name, None)
        if not future.cancelled():
            future.exception()  # retrieved here too, so a download nobody awaits any more logs nothing

    async def _download_file(self, key: str, path: Path, room: int, folder: str, limit: int) -> int:
        """Copy `key` to `path`; TooLarge past `room` bytes (what the folder's cap has left)."""
        size = 0
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("xb") as out:
                async with await self.get_stream(key) as reader:
                    async for chunk in reader:
                        size += len(chunk)
                        if size > room:
                            raise TooLarge(folder, limit)
                        await self._io(out.write, chunk)
                await self._io(fsync_file, out)
        except OSError as e:  # e.g. both `a` and `a/b` under the folder: a file cannot also be a directory
            raise StorageError(f"folder '{folder}': cannot write '{key}' locally: {e}") from e
        return size

    async def _download_folder(self, folder: str, objects: list[tuple[str, ObjectInfo]], final: Path,
                               limit: int) -> Path:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        await self._io(sweep_stale, self.cache_dir, ".tmp-")
        tmp = self.cache_dir / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        try:
            total = 0
            for rel, _ in objects:
                total += await self._download_file(folder + rel, tmp / rel, limit - total, folder, limit)
            if not await self._io(_move_into_place, tmp, final):
                log.info("folder %s: another process fetched it first", folder)
            log.info("fetched folder %s%s (%d files, %d bytes) into %s", self.url, folder, len(objects), total, final)
            return final
        finally:
            if tmp.exists():
                await self._io(shutil.rmtree, tmp, True)


def _move_into_place(tmp: Path, final: Path) -> bool:
    """Rename a fetched folder to its cache name; False if another process's copy is there already."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
        return False
    return True


def fsync_file(out: Any) -> None:
    out.flush()
    os.fsync(out.fileno())


def sweep_stale(directory: Path, name_prefix: str) -> None:
    """Remove what a process that died mid-write left in `directory` (entries older than STALE_TMP_S)."""
    cutoff = time.time() - STALE_TMP_S
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            if entry.name.startswith(name_prefix) and entry.stat(follow_symlinks=False).st_mtime < cutoff:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
