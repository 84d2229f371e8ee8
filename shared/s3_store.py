"""The object store in an S3 bucket (`s3://bucket/prefix`, with `--storage-endpoint-url` for MinIO, Ceph, moto...;
shared/storage.py chooses it): boto3, whose blocking calls run on the store's own small thread pool so that slow
object storage never takes the event loop's default executor from the engine step or the tokenizer. Large objects
go up in multipart.

boto3 rather than aiobotocore: aiobotocore pins botocore to a narrow range (it breaks with the boto3 an image or a
user installs beside it) and brings aiohttp; our calls are few and large (a part is 8 MiB), so a thread hop per
call costs nothing, and boto3's credential chain, retries and endpoint handling are the reference every
S3-compatible server is tested against.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.object_store import (
    MiB,
    NotFound,
    ObjectInfo,
    ObjectReader,
    ObjectStore,
    StorageError,
    TooLarge,
    check_key,
    check_prefix,
    log,
)

S3_MAX_PARTS = 10_000
S3_MIN_PART_BYTES = 5 * MiB


@dataclass(frozen=True)
class S3Options:
    """How an S3Store talks to its server (the `storage_*` settings): which server (None: AWS), in which region,
    how it names the bucket in a request ("auto", "path" or "virtual"), and the part size of multipart uploads."""

    endpoint_url: str | None = None
    region: str | None = None
    addressing_style: str = "auto"
    part_bytes: int = 8 * MiB


class S3Store(ObjectStore):
    """Objects in an S3 bucket (AWS, or any S3-compatible server through `S3Options.endpoint_url`) under `prefix`.
    Credentials come from boto3's standard chain: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and
    AWS_SESSION_TOKEN), AWS_PROFILE and the shared config files, web identity (EKS service accounts), instance
    roles. Objects over `part_bytes` go up as multipart uploads of that part size, aborted on failure;
    one upload holds one part in memory."""

    def __init__(self, bucket: str, prefix: str = "", *, max_bytes: int, cache_dir: Path,
                 s3: S3Options = S3Options(), threads: int = 8) -> None:
        prefix = check_prefix(prefix.strip("/")) if prefix.strip("/") else ""
        self.bucket = bucket
        self.prefix = prefix + "/" if prefix else ""
        super().__init__(f"s3://{bucket}/{self.prefix}", max_bytes=max_bytes, cache_dir=cache_dir, threads=threads)
        # At most 10,000 parts per upload: larger parts when the cap demands them.
        self.part_bytes = max(s3.part_bytes, S3_MIN_PART_BYTES, -(-max_bytes // S3_MAX_PARTS))
        self.s3, self.endpoint_url = s3, s3.endpoint_url
        self.list_page = 1000  # keys per LIST call (S3's most)
        self._client = _s3_client(s3, threads)

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


def _s3_client(s3: S3Options, threads: int) -> Any:
    import boto3
    from botocore.config import Config

    options: dict[str, Any] = {}
    if s3.endpoint_url:
        # botocore adds CRC checksums to every upload by default since 1.36, which several S3-compatible
        # servers reject; AWS needs them only where an operation requires them.
        options = {"request_checksum_calculation": "when_required", "response_checksum_validation": "when_required"}
    config = Config(s3={"addressing_style": s3.addressing_style}, retries={"mode": "standard", "max_attempts": 5},
                    connect_timeout=10, read_timeout=60, max_pool_connections=threads, **options)
    return boto3.session.Session().client("s3", endpoint_url=s3.endpoint_url or None, region_name=s3.region or None,
                                          config=config)
