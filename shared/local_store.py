"""The object store in a local directory (`file:///dir`, the default: a directory under the user's cache dir, what
`rsinfer up` uses; shared/storage.py chooses it). Writes go to a temp file that is renamed into place, so a reader
sees a whole object or none.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path
from typing import Any

from shared.object_store import (
    TMP_DIR,
    InvalidKey,
    MiB,
    NotFound,
    ObjectInfo,
    ObjectReader,
    ObjectStore,
    StorageError,
    TooLarge,
    check_key,
    check_prefix,
    fsync_file,
    sweep_stale,
)


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
        sweep_stale(self._tmp, "")

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
        fsync_file(out)
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


def _local_info(key: str, st: os.stat_result) -> ObjectInfo:
    return ObjectInfo(key, st.st_size, f"{st.st_mtime_ns:x}-{st.st_size:x}-{st.st_ino:x}")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
