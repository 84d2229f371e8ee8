"""Object storage for what does not belong in Redis: the contents of Batch API files (input, output and error
JSONL) and LoRA adapter folders (adapter_config.json + adapter_model.safetensors).

One interface, `ObjectStore`, with two backends chosen by `--storage-url` (`open_store`):
- `LocalStore` (`file:///dir`, the default: a directory under the user's cache dir, what `rsinfer up` uses).
  Writes go to a temp file that is renamed into place, so a reader sees a whole object or none.
- `S3Store` (`s3://bucket/prefix`, with `--storage-endpoint-url` for MinIO, Ceph, moto...): boto3, whose
  blocking calls run on the store's own small thread pool so that slow object storage never takes the
  event loop's default executor from the engine step or the tokenizer. Large objects go up in multipart.
  boto3 rather than aiobotocore: aiobotocore pins botocore to a narrow range (it breaks with the boto3 an
  image or a user installs beside it) and brings aiohttp; our calls are few and large (a part is 8 MiB), so
  a thread hop per call costs nothing, and boto3's credential chain, retries and endpoint handling are the
  reference every S3-compatible server is tested against.

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
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

if TYPE_CHECKING:
    from shared.settings import StorageSettings

log = logging.getLogger("rsinfer.storage")

MiB = 1 << 20
MAX_KEY_BYTES = 1024  # S3's limit on a key
MAX_SEGMENT_BYTES = 255  # a file name on every common filesystem
TMP_DIR = ".rsinfer-tmp"  # the local root's temp files; no key may start with it
STALE_TMP_S = 3600.0  # temp files and folders of a process that died are swept after this
S3_MAX_PARTS = 10_000
S3_MIN_PART_BYTES = 5 * MiB
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
                await self._io(_flush, out)
        except OSError as e:  # e.g. both `a` and `a/b` under the folder: a file cannot also be a directory
            raise StorageError(f"folder '{folder}': cannot write '{key}' locally: {e}") from e
        return size

    async def _download_folder(self, folder: str, objects: list[tuple[str, ObjectInfo]], final: Path,
                               limit: int) -> Path:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        await self._io(_sweep_stale, self.cache_dir, ".tmp-")
        tmp = self.cache_dir / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        try:
            total = 0
            for rel, _ in objects:
                total += await self._download_file(folder + rel, tmp / rel, limit - total, folder, limit)
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():
                    raise
                log.info("folder %s: another process fetched it first", folder)
            log.info("fetched folder %s%s (%d files, %d bytes) into %s", self.url, folder, len(objects), total, final)
            return final
        finally:
            if tmp.exists():
                await self._io(shutil.rmtree, tmp, True)


class LocalStore(ObjectStore):
    """Objects as files under `root`: one key, one file. Written to `<root>/.rsinfer-tmp/` first, fsynced and
    renamed into place, so a reader (or a crash) never sees half an object."""

    def __init__(self, root: Path | str, *, max_bytes: int, cache_dir: Path, threads: int = 8) -> None:
        self.root = Path(root).expanduser().absolute()
        super().__init__(self.root.as_uri(), max_bytes=max_bytes, cache_dir=cache_dir, threads=threads)
        self._tmp = self.root / TMP_DIR
        self._real_root = self.root.resolve()

    def _path(self, key: str) -> Path:
        path = self.root / check_key(key)
        # A symlink an operator left in the root must not lead a key outside it either.
        if not path.resolve().is_relative_to(self._real_root):
            raise InvalidKey(f"object key {key!r} leads outside the store's directory")
        return path

    async def check(self) -> None:
        try:
            await self._io(self._ensure_dirs)
            probe = f"{TMP_DIR}/check-{uuid.uuid4().hex}"
            await self._io((self.root / probe).write_bytes, b"")
            await self._io((self.root / probe).unlink)
        except OSError as e:
            raise StorageError(f"storage directory {self.root} is not writable: {e}") from e

    def _ensure_dirs(self) -> None:
        self._tmp.mkdir(parents=True, exist_ok=True)
        _sweep_stale(self._tmp, "")

    async def put_stream(self, key: str, chunks: AsyncIterable[bytes], *, max_bytes: int | None = None) -> int:
        path = self._path(key)
        limit = self.max_bytes if max_bytes is None else max_bytes
        await self._io(self._tmp.mkdir, parents=True, exist_ok=True)
        tmp = self._tmp / f"{uuid.uuid4().hex}.part"
        out = tmp.open("xb")
        committed = False
        try:
            size = 0
            pending = bytearray()
            async for chunk in chunks:
                size += len(chunk)
                if size > limit:
                    raise TooLarge(key, limit)
                pending += chunk
                if len(pending) >= MiB:  # fewer, larger writes: one thread hop per MiB, not per chunk
                    await self._io(out.write, bytes(pending))
                    pending.clear()
            await self._io(out.write, bytes(pending))
            await self._io(self._commit, out, tmp, path, key)
            committed = True
            return size
        finally:
            if not committed:
                out.close()
                tmp.unlink(missing_ok=True)

    def _commit(self, out: Any, tmp: Path, path: Path, key: str) -> None:
        _flush(out)
        out.close()
        for _ in range(3):  # a concurrent delete may remove the parent between mkdir and rename
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp, path)
                break
            except FileNotFoundError:
                continue
            except (NotADirectoryError, IsADirectoryError, FileExistsError) as e:
                raise InvalidKey(f"object key {key!r} clashes with another key's path: {e}") from None
        else:
            raise StorageError(f"could not store '{key}': its directory kept disappearing")
        _fsync_dir(path.parent)

    async def get_stream(self, key: str, *, chunk_size: int = MiB) -> ObjectReader:
        path = self._path(key)
        try:
            f = await self._io(path.open, "rb")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise NotFound(key) from None
        st = os.fstat(f.fileno())
        return ObjectReader(_local_info(key, st), lambda: self._io(f.read, chunk_size), f.close)

    async def stat(self, key: str) -> ObjectInfo:
        path = self._path(key)
        try:
            st = await self._io(path.stat)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(key) from None
        if not path.is_file():
            raise NotFound(key)
        return _local_info(key, st)

    async def delete(self, key: str) -> None:
        path = self._path(key)
        with contextlib.suppress(FileNotFoundError, NotADirectoryError, IsADirectoryError):  # no such object
            await self._io(path.unlink)
        await self._io(self._prune_empty_dirs, path.parent)

    def _prune_empty_dirs(self, directory: Path) -> None:
        # Keys such as batches/<id>/output.jsonl would otherwise leave one empty directory per batch.
        while directory != self.root and directory.is_relative_to(self.root):
            try:
                directory.rmdir()
            except OSError:
                return
            directory = directory.parent

    async def list_objects(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        check_prefix(prefix)
        for info in await self._io(self._walk, prefix):
            yield info

    def _walk(self, prefix: str) -> list[ObjectInfo]:
        base = self.root / prefix.rpartition("/")[0]
        found = []
        for dirpath, dirnames, filenames in os.walk(base):
            if Path(dirpath) == self.root and TMP_DIR in dirnames:
                dirnames.remove(TMP_DIR)
            for name in filenames:
                path = Path(dirpath) / name
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix) and not path.is_symlink():
                    with contextlib.suppress(FileNotFoundError):  # deleted while we walked
                        found.append(_local_info(key, path.stat()))
        return sorted(found, key=lambda i: i.key.encode())


class S3Store(ObjectStore):
    """Objects in an S3 bucket (AWS, or any S3-compatible server through `endpoint_url`) under `prefix`.
    Credentials come from boto3's standard chain: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and
    AWS_SESSION_TOKEN), AWS_PROFILE and the shared config files, web identity (EKS service accounts), instance
    roles. Objects over `part_bytes` go up as multipart uploads of that part size, aborted on failure;
    one upload holds one part in memory."""

    def __init__(self, bucket: str, prefix: str = "", *, max_bytes: int, cache_dir: Path,
                 endpoint_url: str | None = None, region: str | None = None, addressing_style: str = "auto",
                 part_bytes: int = 8 * MiB, threads: int = 8) -> None:
        prefix = check_prefix(prefix.strip("/")) if prefix.strip("/") else ""
        self.bucket = bucket
        self.prefix = prefix + "/" if prefix else ""
        super().__init__(f"s3://{bucket}/{self.prefix}", max_bytes=max_bytes, cache_dir=cache_dir, threads=threads)
        # At most 10,000 parts per upload: larger parts when the cap demands them.
        self.part_bytes = max(part_bytes, S3_MIN_PART_BYTES, -(-max_bytes // S3_MAX_PARTS))
        self.endpoint_url = endpoint_url
        self.list_page = 1000  # keys per LIST call (S3's most)
        self._client = _s3_client(endpoint_url, region, addressing_style, threads)

    def _full(self, key: str) -> str:
        return self.prefix + key

    async def _s3(self, op: str, key: str, **kwargs: Any) -> Any:
        """Call the client's `op` on the store's thread pool, with its errors as NotFound / StorageError."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return await self._io(getattr(self._client, op), Bucket=self.bucket, **kwargs)
        except ClientError as e:
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            if code in ("NoSuchKey", "404", "NotFound"):
                raise NotFound(key) from None
            raise StorageError(f"S3 {op} s3://{self.bucket}/{self._full(key)}: {code} {err.get('Message', '')}"
                               .rstrip()) from e
        except BotoCoreError as e:
            raise StorageError(f"S3 {op} s3://{self.bucket}/{self._full(key)}: {e}") from e

    async def check(self) -> None:
        try:
            await self._s3("head_bucket", "")
        except NotFound:
            raise StorageError(f"bucket '{self.bucket}' does not exist"
                               f"{f' at {self.endpoint_url}' if self.endpoint_url else ''}") from None

    async def put_stream(self, key: str, chunks: AsyncIterable[bytes], *, max_bytes: int | None = None) -> int:
        full = self._full(check_key(key))
        limit = self.max_bytes if max_bytes is None else max_bytes
        upload_id: str | None = None
        parts: list[dict] = []
        try:
            size = 0
            buf = bytearray()
            async for chunk in chunks:
                size += len(chunk)
                if size > limit:
                    raise TooLarge(key, limit)
                buf += chunk
                while len(buf) >= self.part_bytes:
                    if upload_id is None:
                        upload_id = (await self._s3("create_multipart_upload", key, Key=full))["UploadId"]
                    part = bytes(buf[:self.part_bytes])
                    del buf[:self.part_bytes]
                    parts.append(await self._upload_part(key, full, upload_id, len(parts) + 1, part))
            if upload_id is None:
                await self._s3("put_object", key, Key=full, Body=bytes(buf))
                return size
            if buf:
                parts.append(await self._upload_part(key, full, upload_id, len(parts) + 1, bytes(buf)))
            await self._s3("complete_multipart_upload", key, Key=full, UploadId=upload_id,
                           MultipartUpload={"Parts": parts})
            upload_id = None
            return size
        finally:
            if upload_id is not None:
                await asyncio.shield(self._abort(key, full, upload_id))

    async def _upload_part(self, key: str, full: str, upload_id: str, number: int, body: bytes) -> dict:
        resp = await self._s3("upload_part", key, Key=full, UploadId=upload_id, PartNumber=number, Body=body)
        return {"PartNumber": number, "ETag": resp["ETag"]}

    async def _abort(self, key: str, full: str, upload_id: str) -> None:
        try:
            await self._s3("abort_multipart_upload", key, Key=full, UploadId=upload_id)
        except StorageError as e:  # the bucket's AbortIncompleteMultipartUpload lifecycle rule is the backstop
            log.warning("could not abort the multipart upload of %s: %s", full, e)

    async def get_stream(self, key: str, *, chunk_size: int = MiB) -> ObjectReader:
        resp = await self._s3("get_object", check_key(key), Key=self._full(key))
        body = resp["Body"]
        info = ObjectInfo(key, int(resp["ContentLength"]), resp.get("ETag", "").strip('"'))

        async def read() -> bytes:
            try:
                return await self._io(body.read, chunk_size)
            except Exception as e:
                raise StorageError(f"S3 read of s3://{self.bucket}/{self._full(key)}: {e}") from e

        return ObjectReader(info, read, body.close)

    async def stat(self, key: str) -> ObjectInfo:
        resp = await self._s3("head_object", check_key(key), Key=self._full(key))
        return ObjectInfo(key, int(resp["ContentLength"]), resp.get("ETag", "").strip('"'))

    async def delete(self, key: str) -> None:
        await self._s3("delete_object", check_key(key), Key=self._full(key))

    async def list_objects(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        check_prefix(prefix)
        token: str | None = None
        while True:
            page = await self._s3("list_objects_v2", prefix, Prefix=self._full(prefix), MaxKeys=self.list_page,
                                  **({"ContinuationToken": token} if token else {}))
            for obj in page.get("Contents", []):
                key = obj["Key"][len(self.prefix):]
                if key and not key.endswith("/"):  # "folder/" markers some tools create hold no data
                    yield ObjectInfo(key, int(obj["Size"]), obj.get("ETag", "").strip('"'))
            if not page.get("IsTruncated"):
                return
            token = page["NextContinuationToken"]


def _s3_client(endpoint_url: str | None, region: str | None, addressing_style: str, threads: int) -> Any:
    import boto3
    from botocore.config import Config

    options: dict[str, Any] = {}
    if endpoint_url:
        # botocore adds CRC checksums to every upload by default since 1.36, which several S3-compatible
        # servers reject; AWS needs them only where an operation requires them.
        options = {"request_checksum_calculation": "when_required", "response_checksum_validation": "when_required"}
    config = Config(s3={"addressing_style": addressing_style}, retries={"mode": "standard", "max_attempts": 5},
                    connect_timeout=10, read_timeout=60, max_pool_connections=threads, **options)
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url or None, region_name=region or None,
                                          config=config)


def _local_info(key: str, st: os.stat_result) -> ObjectInfo:
    return ObjectInfo(key, st.st_size, f"{st.st_mtime_ns:x}-{st.st_size:x}-{st.st_ino:x}")


def _flush(out: Any) -> None:
    out.flush()
    os.fsync(out.fileno())


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sweep_stale(directory: Path, name_prefix: str) -> None:
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


# --- choosing a backend


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


def open_store(settings: StorageSettings) -> ObjectStore:
    """The store `settings` name. Creates nothing remote; call `check()` to fail early on a bad one."""
    where = parse_storage_url(settings.storage_url)
    cache_dir = Path(settings.storage_cache_dir).expanduser() if settings.storage_cache_dir else (
        cache_root() / "storage-cache")
    if where.scheme == "s3":
        return S3Store(where.bucket, where.path, max_bytes=settings.max_file_bytes, cache_dir=cache_dir,
                       endpoint_url=settings.storage_endpoint_url, region=settings.storage_region,
                       addressing_style=settings.storage_addressing_style, part_bytes=settings.storage_part_bytes)
    return LocalStore(where.path, max_bytes=settings.max_file_bytes, cache_dir=cache_dir)
