"""The Batch API (`/v1/batches`): a batch is work in the pipeline, not in a process.

`POST /v1/batches` (admitted first: services/api/multitenancy/tenancy.py `admit_action`) writes the batch's hash
(`Keys.batch`), indexes it for its tenant's listing (`Keys.tenant_batches`; an admin's lists every batch,
`Keys.batches`) and adds one entry to its tenant's work stream (`Keys.batch_work`). Every API process runs a
`BatchRunner` (services/api/batch_api/batch_runner.py) in those streams' `batch` consumer group: it runs several batches
at once, in turns across tenants, and keeps touching the entries it holds; if it dies (or stops) an entry goes idle
and another claims it (XAUTOCLAIM after --batch-claim-idle-s) and runs the batch again from where it was, which
loses no line and runs none twice:

- each line's requests have uids derived from the batch and the line (services/api/batch_api/batch_lines.py): a line
whose
  record exists was submitted already, so it is followed (attached to) rather than submitted again;
- a line's result is kept in the object store (services/api/batch_api/batch_output.py) as soon as it is known, so what a
  predecessor finished is not run again; the output and error files are streamed from them once every line ended;
- a batch's requests are `background` (their submitter's death does not abort them) with --batch-priority
  (behind interactive requests), at most --batch-max-inflight at once, each fed only while its model has at most
  --batch-max-backlog requests queued, so interactive requests keep their latency.

Cancel sets `cancelling` (from validating, in_progress or finalizing): the runner feeds nothing more, aborts what
runs, and ends the batch `cancelled` with the files of what ended. A batch past its completion window ends
`expired` the same way. What a run does is services/api/batch_api/batch_run.py.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from pydantic import BaseModel, Field

from services.api.answer.collaborators import ApiContext
from services.api.answer.schemas.field_checks import FORBID
from services.api.answer.service import ApiService
from services.api.batch_api.batch_lines import ENDPOINTS, BadInput, LineLimits, parse_lines
from services.api.batch_api.batch_output import delete_results
from services.api.batch_api.batch_run import ENDED, STOPPING, BatchRun
from services.api.batch_api.files import Files
from services.api.errors import ApiError
from services.api.multitenancy.tenants import Tenant
from services.api.responses_api.responses import Responses
from shared import streams
from shared.messages import BatchWork

log = logging.getLogger(__name__)

WINDOW_S = {"24h": 86400}
PARK_MAX_S = 60.0  # longest a parked batch waits before it is tried again


class OutputExpiresAfter(BaseModel):
    """How long the batch's output and error files are kept (OpenAI's `output_expires_after`)."""

    model_config = FORBID
    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=30 * 86400)


class CreateBatch(BaseModel):
    model_config = FORBID
    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    output_expires_after: OutputExpiresAfter | None = None


@dataclass(frozen=True)
class Parked:
    """A run that stopped because its tenant's quota refused its lines: try again after `delay_s`."""

    delay_s: float
    progressed: bool  # it ended some lines first


def not_found(batch_id: str) -> ApiError:
    return ApiError(404, f"no batch `{batch_id[:80]}`", param="batch_id", code="batch_not_found")


def batch_object(h: dict[str, str]) -> dict[str, Any]:
    """The batch's hash as OpenAI's Batch object."""
    def ts(name: str) -> int | None:
        return int(float(h[name])) if h.get(name) else None

    return {"id": h["id"], "object": "batch", "endpoint": h["endpoint"], "input_file_id": h["input_file_id"],
            "completion_window": h["completion_window"], "status": h["status"],
            "errors": orjson.loads(h["errors"]) if h.get("errors") else None,
            "output_file_id": h.get("output_file_id") or None, "error_file_id": h.get("error_file_id") or None,
            **{f"{name}_at": ts(f"{name}_at") for name in ("created", "in_progress", "expires", "finalizing",
                                                              "completed", "failed", "expired", "cancelling",
                                                              "cancelled")},
            "request_counts": {k: int(h.get(k, 0)) for k in ("total", "completed", "failed")},
            "metadata": orjson.loads(h["metadata"]) if h.get("metadata") else None}


def decoded(raw: dict) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in raw.items()}


class Batches:
    """The routes' work, and a run of a batch (services/api/batch_api/batch_run.py) for the runner."""

    def __init__(self, ctx: ApiContext, service: ApiService, responses: Responses, files: Files):
        self.ctx, self.service, self.responses, self.files = ctx, service, responses, files
        self.s, self.redis, self.keys = ctx.settings, ctx.redis, ctx.keys

    # -- the routes ------------------------------------------------------------------------------------------
    async def create(self, body: CreateBatch, tenant: Tenant) -> dict[str, Any]:
        if body.endpoint not in ENDPOINTS:
            raise ApiError(400, f"`endpoint` must be one of {', '.join(ENDPOINTS)}", param="endpoint")
        if body.completion_window not in WINDOW_S:
            raise ApiError(400, "`completion_window` must be 24h", param="completion_window")
        if self.ctx.tenancy.on and not tenant.policy.background:  # a batch's lines run in the background
            raise ApiError(403, "this key may not run batches (its policy has no `background`)",
                           param="input_file_id", code="background_not_allowed")
        self.ctx.limits.record_fields(None, None, body.metadata)
        await self.ctx.tenancy.admit_action(tenant, "run batches")
        meta = await self.files.meta(body.input_file_id, tenant, "input_file_id")
        if meta["purpose"] != "batch":
            raise ApiError(400, "the input file's purpose must be batch", param="input_file_id")
        now = time.time()
        batch_id = f"batch_{secrets.token_hex(12)}"
        expiry = body.output_expires_after
        h = {"id": batch_id, "endpoint": body.endpoint, "input_file_id": body.input_file_id,
             "completion_window": body.completion_window, "status": "validating", "created_at": int(now),
             "expires_at": int(now + WINDOW_S[body.completion_window]),
             "metadata": orjson.dumps(body.metadata).decode() if body.metadata else "", "tenant": tenant.name,
             "output_ttl_s": expiry.seconds if expiry else self.s.file_ttl_s}
        await self.write(h, tenant.name, now)
        log.info("batch=%s created: %s lines of %s", batch_id, body.endpoint, body.input_file_id)
        return batch_object({k: str(v) for k, v in h.items()})

    async def write(self, h: dict[str, Any], tenant: str, now: float) -> None:
        """The batch's hash, its places in the indexes, its work entry."""
        batch_id, old = h["id"], now - self.s.file_ttl_s
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(self.keys.batch(batch_id), mapping=h)
            pipe.expire(self.keys.batch(batch_id), self.s.file_ttl_s)
            for index in (self.keys.batches(), self.keys.tenant_batches(tenant)):
                pipe.zadd(index, {batch_id: now})
                pipe.zremrangebyscore(index, "-inf", old)
            pipe.sadd(self.keys.batch_tenants(), tenant)
            streams.add(pipe, self.keys.batch_work(tenant), BatchWork(batch_id))
            await pipe.execute()

    async def hash(self, batch_id: str, tenant: Tenant) -> dict[str, str]:
        """The batch, if it is `tenant`'s (another tenant's is not found)."""
        h = decoded(await self.redis.hgetall(self.keys.batch(batch_id))) if len(batch_id) <= 64 else {}
        if not h or not self.ctx.tenancy.owns(tenant, h):
            raise not_found(batch_id)
        return h

    async def get(self, batch_id: str, tenant: Tenant) -> dict[str, Any]:
        return batch_object(await self.hash(batch_id, tenant))

    async def list(self, tenant: Tenant, limit: int, after: str | None) -> dict[str, Any]:
        """The tenant's batches (an admin's: everyone's), newest first as OpenAI lists them, from its own index;
        `after`: the last id of the previous page (one not in the index is a 400, whoever's it is)."""
        index = self.keys.batches() if tenant.admin else self.keys.tenant_batches(tenant.name)
        start = 0
        if after is not None:
            rank = await self.redis.zrevrank(index, after) if len(after) <= 64 else None
            if rank is None:
                raise ApiError(400, f"`after` names no batch of this list: {after[:80]}", param="after")
            start = rank + 1
        ids = [i.decode() for i in await self.redis.zrevrange(index, start, start + limit)]
        async with self.redis.pipeline(transaction=False) as pipe:
            for i in ids[:limit]:
                pipe.hgetall(self.keys.batch(i))
            found = await pipe.execute()
        page = [batch_object(h) for h in map(decoded, found) if h and self.ctx.tenancy.owns(tenant, h)]
        scanned = ids[:limit]  # the cursor moves past what was read (a batch whose hash expired included)
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": scanned[-1] if scanned else None, "has_more": len(ids) > limit}

    async def cancel(self, batch_id: str, tenant: Tenant) -> dict[str, Any]:
        h = await self.hash(batch_id, tenant)
        if h["status"] in ("validating", "in_progress", "finalizing"):
            await self.redis.hset(self.keys.batch(batch_id), mapping={"status": "cancelling",
                                                                        "cancelling_at": int(time.time())})
            h = await self.hash(batch_id, tenant)
        return batch_object(h)

    # -- a run -----------------------------------------------------------------------------------------------
    async def run(self, batch_id: str) -> Parked | None:
        """Run the batch to its end (or from where a predecessor left it); Parked if its tenant's quota stopped it
        (a suspended tenant's is parked before its input is read)."""
        h = decoded(await self.redis.hgetall(self.keys.batch(batch_id)))
        if not h or h["status"] in ENDED:
            return None
        tenancy = self.ctx.tenancy
        live = h["status"] not in STOPPING and time.time() <= float(h["expires_at"])
        if live and tenancy.on and tenancy.suspended(tenancy.named(h.get("tenant", ""))):
            return Parked(PARK_MAX_S, False)
        try:
            data = await self.files.content(h["input_file_id"], None)
            lines = parse_lines(data, h["endpoint"], LineLimits(self.s.max_batch_lines, self.s.max_body_bytes,
                                                                self.s.max_json_depth))
        except (BadInput, ApiError) as e:
            await self.fail(batch_id, str(e) if isinstance(e, BadInput) else e.message)
            return None
        del data
        run = BatchRun(self, h, lines)
        self.ctx.metrics.batches_running.inc()
        try:
            await run.start()
            parked = await run.feed()
            if parked is not None:
                log.info("batch=%s parked for %.0fs: its tenant's quota refused its lines", batch_id, parked)
                return Parked(parked, run.finished > 0)
            await run.finalize()
            return None
        finally:
            self.ctx.metrics.batches_running.dec()

    async def fail(self, batch_id: str, message: str, code: str = "invalid_file",
                   param: str | None = "input_file_id") -> None:
        errors = {"object": "list", "data": [{"code": code, "message": message, "param": param, "line": None}]}
        await self.redis.hset(self.keys.batch(batch_id), mapping={
            "status": "failed", "failed_at": int(time.time()), "errors": orjson.dumps(errors).decode()})
        self.ctx.metrics.batches.labels("failed").inc()
        log.info("batch=%s failed: %s", batch_id, message)

    async def clean_up(self, batch_id: str) -> None:
        await delete_results(self.files.store(), batch_id)

    async def sweep_results(self) -> int:
        """Delete the stored line results of every batch that ended or expired (its runner died before it cleaned
        up); how many batches'."""
        ids: set[str] = set()
        async for info in self.files.store().list_objects("batches/"):
            parts = info.key.split("/")
            if len(parts) == 4 and parts[2] == "lines":
                ids.add(parts[1])
        ordered = sorted(ids)
        async with self.redis.pipeline(transaction=False) as pipe:
            for batch_id in ordered:
                pipe.hget(self.keys.batch(batch_id), "status")
            statuses = await pipe.execute()
        gone = [i for i, st in zip(ordered, statuses, strict=True) if st is None or st.decode() in ENDED]
        for batch_id in gone:
            await self.clean_up(batch_id)
        if gone:
            log.info("deleted the line results of %d ended batches", len(gone))
        return len(gone)
