"""The Files API (`/v1/files`), what batches read and write: contents in the object store (shared/storage.py,
under `files/<id>`), metadata in Redis (`Keys.file`, with a TTL of --file-ttl-s), so any API process serves any
file. Uploads are `purpose=batch` (a batch's input); a batch's output and error files are `batch_output`.

Every file counts against its tenant's bounds, --max-files-per-tenant and --max-file-bytes-per-tenant, kept in
Redis by one script (`FileQuota`) before its contents are written: a file is released when it is deleted, and an
expired one at the tenant's next count. An upload is admitted first (services/api/multitenancy/tenancy.py
`admit_action`: a suspended tenant is refused, its requests per minute count it). The tenant's index
(`Keys.tenant_files`) lists its files (`GET /v1/files`).
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

from fastapi import Request as HttpRequest
from redis.asyncio import Redis

from services.api.errors import ApiError
from services.api.multitenancy.tenancy import Tenancy
from services.api.multitenancy.tenants import Tenant
from shared.keys import Keys
from shared.settings import ApiSettings

log = logging.getLogger(__name__)

UPLOAD_PURPOSES = ("batch",)
PURPOSES = ("batch", "batch_output")

# KEYS: the tenant's files (id -> expires at), their bytes (id -> bytes, and `_total`). ARGV: file id, bytes, expires
# at (0: release the file), most files, most bytes. -> {refused (0 none, 1 files, 2 bytes), files, bytes}: the
# expired ones dropped first, the file itself not counted twice (a batch's output written again).
RESERVE = """
local now = tonumber(redis.call('TIME')[1])
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, id in ipairs(gone) do
  redis.call('HINCRBY', KEYS[2], '_total', -tonumber(redis.call('HGET', KEYS[2], id) or '0'))
  redis.call('HDEL', KEYS[2], id)
end
if #gone > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now) end
local id, size, expires = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local old = redis.call('HGET', KEYS[2], id)
if old then
  redis.call('HINCRBY', KEYS[2], '_total', -tonumber(old))
  redis.call('HDEL', KEYS[2], id)
  redis.call('ZREM', KEYS[1], id)
end
local files = redis.call('ZCARD', KEYS[1])
local total = tonumber(redis.call('HGET', KEYS[2], '_total') or '0')
if expires == 0 then return {0, files, total} end
if files + 1 > tonumber(ARGV[4]) then return {1, files, total} end
if total + size > tonumber(ARGV[5]) then return {2, files, total} end
redis.call('ZADD', KEYS[1], expires, id)
redis.call('HSET', KEYS[2], id, size)
redis.call('HINCRBY', KEYS[2], '_total', size)
return {0, files + 1, total + size}
"""


def file_not_found(file_id: str, param: str = "file_id") -> ApiError:
    return ApiError(404, f"no file `{file_id[:80]}`", param=param, code="file_not_found")


def content_key(file_id: str) -> str:
    return f"files/{file_id}"


class FileQuota:
    """Each tenant's stored files and bytes, counted atomically in Redis (`RESERVE`)."""

    def __init__(self, settings: ApiSettings, redis: Redis, keys: Keys):
        self.settings, self.redis, self.keys = settings, redis, keys

    async def reserve(self, tenant: str, file_id: str, size: int, expires_at: float) -> None:
        """Count the file (a 403 naming the bound past either)."""
        s = self.settings
        refused, files, total = await self._call(tenant, file_id, size, max(1, int(expires_at)))
        if refused == 1:
            raise ApiError(403, f"tenant `{tenant}` stores {files} files, at most {s.max_files_per_tenant} "
                           "(--max-files-per-tenant): delete some first", param="file", code="too_many_files")
        if refused == 2:
            raise ApiError(403, f"tenant `{tenant}` stores {total} bytes; {size} more would pass its "
                           f"{s.max_file_bytes_per_tenant} (--max-file-bytes-per-tenant): delete some first",
                           param="file", code="storage_quota_exceeded")

    async def release(self, tenant: str, file_id: str) -> None:
        await self._call(tenant, file_id, 0, 0)

    async def _call(self, tenant: str, file_id: str, size: int, expires_at: int) -> list[int]:
        result = await self.redis.eval(RESERVE, 2, self.keys.tenant_files(tenant), self.keys.tenant_file_bytes(tenant),
                                       file_id, size, expires_at, self.settings.max_files_per_tenant,
                                       self.settings.max_file_bytes_per_tenant)
        return [int(x) for x in result]

    async def ids(self, tenant: str) -> list[str]:
        """The tenant's files (at most --max-files-per-tenant, some maybe expired since)."""
        return [i.decode() for i in await self.redis.zrange(self.keys.tenant_files(tenant), 0, -1)]


class Files:
    """A file belongs to the tenant whose key uploaded it (a batch's output files, to the batch's): another
    tenant's is not found (services/api/multitenancy/tenancy.py `owns`)."""

    def __init__(self, settings: ApiSettings, redis: Redis, keys: Keys, tenancy: Tenancy):
        self.settings, self.redis, self.keys, self.tenancy = settings, redis, keys, tenancy
        self.quota = FileQuota(settings, redis, keys)
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
        """Multipart `file` and `purpose`; the body's size is capped at the edge (--max-body-bytes). Admitted
        before the body is read."""
        await self.tenancy.admit_action(tenant, "store files")
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
        """Store `data` as a new file of `tenant` (counted first); its object, as OpenAI's."""
        from shared.object_store import TooLarge

        file_id = file_id or f"file-{secrets.token_hex(12)}"
        if len(data) > self.settings.max_file_bytes:
            raise self.too_large()
        ttl_s = self.settings.file_ttl_s
        await self.quota.reserve(tenant, file_id, len(data), time.time() + ttl_s)
        try:
            await self.store().put(content_key(file_id), data)
        except BaseException as e:
            await self.quota.release(tenant, file_id)
            if isinstance(e, TooLarge):
                raise self.too_large() from None
            raise
        return await self.register(file_id, filename, purpose, len(data), tenant=tenant, ttl_s=ttl_s)

    def too_large(self) -> ApiError:
        return ApiError(413, f"the file is over {self.settings.max_file_bytes} bytes (--max-file-bytes)",
                        param="file", code="file_too_large")

    async def register(self, file_id: str, filename: str, purpose: str, size: int, *, tenant: str, ttl_s: int
                       ) -> dict[str, Any]:
        """The metadata of contents stored (and counted, `FileQuota.reserve`) already; the file's object."""
        now = time.time()
        meta = {"id": file_id, "filename": filename, "purpose": purpose, "bytes": size, "created_at": int(now),
                "created": f"{now:.6f}", "tenant": tenant, "ttl_s": ttl_s}  # `created`: the listing's order
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.file(file_id), mapping=meta)
            pipe.expire(self.keys.file(file_id), ttl_s)
            await pipe.execute()
        return file_object(meta, ttl_s)

    async def list(self, tenant: Tenant, purpose: str | None, limit: int, order: str, after: str | None
                   ) -> dict[str, Any]:
        """The tenant's files (its own, an admin's too), newest first unless `order` is asc; `after`: the last id
        of the previous page. Read whole from the tenant's index (at most --max-files-per-tenant)."""
        if purpose is not None and purpose not in PURPOSES:
            raise ApiError(400, f"`purpose` must be one of {', '.join(PURPOSES)}", param="purpose")
        ids = await self.quota.ids(tenant.name)
        async with self.redis.pipeline(transaction=False) as pipe:
            for i in ids:
                pipe.hgetall(self.keys.file(i))
            found = await pipe.execute()
        metas = [{k.decode(): v.decode() for k, v in h.items()} for h in found]
        metas = [m for m in metas if m and (purpose is None or m["purpose"] == purpose)]
        metas.sort(key=lambda m: float(m.get("created") or m["created_at"]), reverse=order == "desc")
        start = 0
        if after is not None:
            at = next((k for k, m in enumerate(metas) if m["id"] == after), None)
            if at is None:
                raise ApiError(400, f"`after` names no file of this list: {after[:80]}", param="after")
            start = at + 1
        page = [file_object(m, int(m.get("ttl_s") or self.settings.file_ttl_s)) for m in metas[start:start + limit]]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(metas)}

    async def meta(self, file_id: str, tenant: Tenant | None, param: str = "file_id") -> dict[str, Any]:
        """The file's metadata, if it is `tenant`'s (None: whoever's, for a batch's runner)."""
        raw = await self.redis.hgetall(self.keys.file(file_id)) if len(file_id) <= 64 else {}
        meta = {k.decode(): v.decode() for k, v in raw.items()}
        if not meta or (tenant is not None and not self.tenancy.owns(tenant, meta)):
            raise file_not_found(file_id, param)
        return meta

    async def get(self, file_id: str, tenant: Tenant) -> dict[str, Any]:
        meta = await self.meta(file_id, tenant)
        return file_object(meta, int(meta.get("ttl_s") or self.settings.file_ttl_s))

    async def content(self, file_id: str, tenant: Tenant | None, param: str = "file_id") -> bytes:
        from shared.object_store import NotFound

        await self.meta(file_id, tenant, param)
        try:
            return await self.store().get(content_key(file_id))
        except NotFound:
            raise file_not_found(file_id, param) from None

    async def delete(self, file_id: str, tenant: Tenant) -> dict[str, Any]:
        meta = await self.meta(file_id, tenant)
        await self.remove(file_id, meta.get("tenant", ""))
        return {"id": file_id, "object": "file", "deleted": True}

    async def remove(self, file_id: str, tenant: str) -> None:
        """The file's metadata, contents and count gone (each idempotent)."""
        await self.redis.delete(self.keys.file(file_id))
        await self.store().delete(content_key(file_id))
        await self.quota.release(tenant, file_id)


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
