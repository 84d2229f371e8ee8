"""The Files API (`/v1/files`), what batches read and write: contents in the object store (shared/storage.py,
under `files/<id>`), metadata in Redis (`Keys.file`, with a TTL of --file-ttl-s), so any API process serves any
file. Uploads are `purpose=batch` (a batch's input); a batch's output and error files are `batch_output`.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

from fastapi import Request as HttpRequest
from redis.asyncio import Redis

from services.api.errors import ApiError
from services.api.tenancy import Tenancy
from services.api.tenants import Tenant
from shared.keys import Keys
from shared.settings import ApiSettings

log = logging.getLogger(__name__)

UPLOAD_PURPOSES = ("batch",)


def file_not_found(file_id: str, param: str = "file_id") -> ApiError:
    return ApiError(404, f"no file `{file_id[:80]}`", param=param, code="file_not_found")


def content_key(file_id: str) -> str:
    return f"files/{file_id}"


class Files:
    """A file belongs to the tenant whose key uploaded it (a batch's output files, to the batch's): another
    tenant's is not found (services/api/tenancy.py `owns`)."""

    def __init__(self, settings: ApiSettings, redis: Redis, keys: Keys, tenancy: Tenancy):
        self.settings, self.redis, self.keys, self.tenancy = settings, redis, keys, tenancy
        self._store = None
        self.orphans: set[str] = set()  # contents whose metadata was gone at the last sweep

    def store(self):
        if self._store is None:
            from shared.storage import open_store

            self._store = open_store(self.settings)
        return self._store

    async def close(self) -> None:
        if self._store is not None:
            await self._store.close()

    # -- the routes --------------------------------------------------------------------------------------------
    async def upload(self, http: HttpRequest, tenant: Tenant) -> dict[str, Any]:
        """Multipart `file` and `purpose`; the body's size is capped at the edge (--max-body-bytes)."""
        form = await http.form(max_files=1, max_fields=4)
        try:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose not in UPLOAD_PURPOSES:
                raise ApiError(400, f"`purpose` must be one of {', '.join(UPLOAD_PURPOSES)}", param="purpose")
            if upload is None or isinstance(upload, str):
                raise ApiError(400, "give the file as the multipart field `file`", param="file")
            data = await upload.read()
            name = (upload.filename or "upload.jsonl")[:256]
        finally:
            await form.close()
        return await self.create(data, name, "batch", tenant=tenant.name)

    async def create(self, data: bytes, filename: str, purpose: str, file_id: str | None = None, tenant: str = ""
                     ) -> dict[str, Any]:
        """Store `data` as a new file (or as `file_id`, written again whole); its object, as OpenAI's."""
        from shared.storage import TooLarge

        file_id = file_id or f"file-{secrets.token_hex(12)}"
        try:
            await self.store().put(content_key(file_id), data)
        except TooLarge:
            raise ApiError(413, f"the file is over {self.settings.max_file_bytes} bytes (--max-file-bytes)",
                           param="file", code="file_too_large") from None
        meta = {"id": file_id, "filename": filename, "purpose": purpose, "bytes": len(data),
                "created_at": int(time.time()), "tenant": tenant}
        await self.redis.hset(self.keys.file(file_id), mapping=meta)
        await self.redis.expire(self.keys.file(file_id), self.settings.file_ttl_s)
        return file_object(meta, self.settings.file_ttl_s)

    async def meta(self, file_id: str, tenant: Tenant | None, param: str = "file_id") -> dict[str, Any]:
        """The file's metadata, if it is `tenant`'s (None: whoever's, for a batch's runner)."""
        raw = await self.redis.hgetall(self.keys.file(file_id)) if len(file_id) <= 64 else {}
        meta = {k.decode(): v.decode() for k, v in raw.items()}
        if not meta or (tenant is not None and not self.tenancy.owns(tenant, meta)):
            raise file_not_found(file_id, param)
        return meta

    async def get(self, file_id: str, tenant: Tenant) -> dict[str, Any]:
        return file_object(await self.meta(file_id, tenant), self.settings.file_ttl_s)

    async def content(self, file_id: str, tenant: Tenant | None, param: str = "file_id") -> bytes:
        from shared.storage import NotFound

        await self.meta(file_id, tenant, param)
        try:
            return await self.store().get(content_key(file_id))
        except NotFound:
            raise file_not_found(file_id, param) from None

    async def delete(self, file_id: str, tenant: Tenant) -> dict[str, Any]:
        await self.meta(file_id, tenant)
        await self.redis.delete(self.keys.file(file_id))
        await self.store().delete(content_key(file_id))  # idempotent
        return {"id": file_id, "object": "file", "deleted": True}


    async def sweep_orphans(self) -> int:
        """The object store has no TTL: a file's contents are deleted once its metadata (`Keys.file`, which does)
        has been gone at two sweeps in a row (an upload writes its contents before its metadata). How many."""
        found: set[str] = set()
        async for info in self.store().list_objects("files/"):
            found.add(info.key.removeprefix("files/"))
        ids = sorted(found)
        async with self.redis.pipeline(transaction=False) as pipe:
            for file_id in ids:
                pipe.exists(self.keys.file(file_id))
            alive = await pipe.execute()
        orphans = {i for i, live in zip(ids, alive, strict=True) if not live}
        gone = orphans & self.orphans
        for file_id in gone:
            await self.store().delete(content_key(file_id))
        self.orphans = orphans - gone
        if gone:
            log.info("deleted the contents of %d expired files", len(gone))
        return len(gone)


def file_object(meta: dict[str, Any], ttl_s: int) -> dict[str, Any]:
    created = int(meta["created_at"])
    return {"id": meta["id"], "object": "file", "bytes": int(meta["bytes"]), "created_at": created,
            "filename": meta["filename"], "purpose": meta["purpose"], "status": "processed",
            "expires_at": created + ttl_s, "status_details": None}
