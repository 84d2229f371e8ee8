"""The Batch API (`/v1/batches`): a batch is work in the pipeline, not in a process.

`POST /v1/batches` writes the batch's hash (`Keys.batch`) and one entry on the batch work stream
(`Keys.batch_work`). Every API process runs a `BatchRunner` in that stream's `batch` consumer group: the one that
reads the entry runs the batch and keeps touching the entry; if it dies (or stops) the entry goes idle and
another claims it (XAUTOCLAIM after --batch-claim-idle-s) and runs the batch again from its start, which loses
no line and runs none twice:

- each line's requests have uids derived from the batch and the line (services/api/batch_lines.py): a line whose
  record exists was submitted already, so it is followed (attached to) rather than submitted again;
- a line's result is kept in the object store (`batches/<id>/lines/<n>`) as soon as it is known, so what a
  predecessor finished is not run again; the output and error files are written once every line has ended;
- a batch's requests are `background` (their submitter's death does not abort them) with --batch-priority
  (behind interactive requests), at most --batch-max-inflight at once, each fed only while its model has at most
  --batch-max-backlog requests queued, so interactive requests keep their latency.

Cancel sets `cancelling`: the runner feeds nothing more, aborts what runs, and ends the batch `cancelled` with
the files of what ended. A batch past its completion window ends `expired` the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import orjson
from pydantic import BaseModel, Field
from redis.exceptions import RedisError

from services.api.adapters import Adapters
from services.api.admission import Admitted
from services.api.batch_lines import (
    ENDPOINTS,
    BadInput,
    Line,
    LineLimits,
    invalid_line,
    line_uid,
    output_line,
    parse_lines,
)
from services.api.errors import ApiError, as_api_error
from services.api.files import Files
from services.api.formats import Format
from services.api.request import ApiRequest, RequestGroup, SingleRequest, leased
from services.api.response_schemas import ResponseRequest
from services.api.responses import Responses
from services.api.schemas import FORBID, ChatCompletionRequest, CompletionRequest, Submission
from services.api.service import ApiService
from services.api.tenants import Tenant
from shared import streams
from shared.messages import BatchWork, decode
from shared.request_states import EndReason

log = logging.getLogger(__name__)

GROUP = "batch"
WINDOW_S = {"24h": 86400}
ENDED = ("completed", "failed", "expired", "cancelled")
STOPPING = ("cancelling", "expired")
BODIES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
POLL_S = 0.5
WORK_POLL_S = 2.0  # how often an API process looks for a batch to run
FILE_SWEEP_S = 3600.0  # how often the contents of expired files are looked for (services/api/files.py)
RETRY = (429, 503)  # a line refused for these is tried again


class CreateBatch(BaseModel):
    model_config = FORBID
    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


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


class Batches:
    """The routes' work, and the runs of the batches this process holds."""

    def __init__(self, svc: ApiService, adapters: Adapters, responses: Responses, files: Files):
        self.svc, self.adapters, self.responses, self.files = svc, adapters, responses, files
        self.s, self.redis, self.keys = svc.settings, svc.redis, svc.keys

    # -- the routes ------------------------------------------------------------------------------------------
    async def create(self, body: CreateBatch, tenant: Tenant) -> dict[str, Any]:
        if body.endpoint not in ENDPOINTS:
            raise ApiError(400, f"`endpoint` must be one of {', '.join(ENDPOINTS)}", param="endpoint")
        if body.completion_window not in WINDOW_S:
            raise ApiError(400, "`completion_window` must be 24h", param="completion_window")
        if self.svc.tenancy.on and not tenant.policy.background:  # a batch's lines run in the background
            raise ApiError(403, "this key may not run batches (its policy has no `background`)",
                           param="input_file_id", code="background_not_allowed")
        self.svc.limits.record_fields(None, None, body.metadata)
        meta = await self.files.meta(body.input_file_id, tenant, "input_file_id")
        if meta["purpose"] != "batch":
            raise ApiError(400, "the input file's purpose must be batch", param="input_file_id")
        now = time.time()
        batch_id = f"batch_{secrets.token_hex(12)}"
        h = {"id": batch_id, "endpoint": body.endpoint, "input_file_id": body.input_file_id,
             "completion_window": body.completion_window, "status": "validating", "created_at": int(now),
             "expires_at": int(now + WINDOW_S[body.completion_window]),
             "metadata": orjson.dumps(body.metadata).decode() if body.metadata else "", "tenant": tenant.name}
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(self.keys.batch(batch_id), mapping=h)
            pipe.expire(self.keys.batch(batch_id), self.s.file_ttl_s)
            pipe.zadd(self.keys.batches(), {batch_id: now})
            pipe.zremrangebyscore(self.keys.batches(), "-inf", now - self.s.file_ttl_s)
            streams.add(pipe, self.keys.batch_work(), BatchWork(batch_id))
            await pipe.execute()
        log.info("batch=%s created: %s lines of %s", batch_id, body.endpoint, body.input_file_id)
        return batch_object({k: str(v) for k, v in h.items()})

    async def hash(self, batch_id: str, tenant: Tenant) -> dict[str, str]:
        """The batch, if it is `tenant`'s (another tenant's is not found)."""
        raw = await self.redis.hgetall(self.keys.batch(batch_id)) if len(batch_id) <= 64 else {}
        h = {k.decode(): v.decode() for k, v in raw.items()}
        if not h or not self.svc.tenancy.owns(tenant, h):
            raise not_found(batch_id)
        return h

    async def get(self, batch_id: str, tenant: Tenant) -> dict[str, Any]:
        return batch_object(await self.hash(batch_id, tenant))

    async def list(self, tenant: Tenant, limit: int, after: str | None) -> dict[str, Any]:
        """The tenant's batches (an admin's: all), newest first as OpenAI lists them; `after`: the last id of the
        previous page. A page is read from the newest `limit + 1` after `after` of everyone's, so another
        tenant's batches can make it shorter than `limit` (with `has_more` still true)."""
        start = 0
        if after is not None:
            rank = await self.redis.zrevrank(self.keys.batches(), after)
            if rank is None:
                raise ApiError(400, f"`after` names no batch: {after[:80]}", param="after")
            start = rank + 1
        ids = [i.decode() for i in await self.redis.zrevrange(self.keys.batches(), start, start + limit)]
        async with self.redis.pipeline(transaction=False) as pipe:
            for i in ids:
                pipe.hgetall(self.keys.batch(i))
            found = await pipe.execute()
        hashes = [{k.decode(): v.decode() for k, v in h.items()} for h in found]
        data = [batch_object(h) for h in hashes[:limit] if h and self.svc.tenancy.owns(tenant, h)]
        page = data
        scanned = ids[:limit]  # the cursor moves past what was read, whoever's it was
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": scanned[-1] if scanned else None, "has_more": len(ids) > limit}

    async def cancel(self, batch_id: str, tenant: Tenant) -> dict[str, Any]:
        h = await self.hash(batch_id, tenant)
        if h["status"] in ("validating", "in_progress"):
            await self.redis.hset(self.keys.batch(batch_id), mapping={"status": "cancelling",
                                                                        "cancelling_at": int(time.time())})
            h = await self.hash(batch_id, tenant)
        return batch_object(h)

    # -- a run -----------------------------------------------------------------------------------------------
    async def run(self, batch_id: str) -> None:
        """Run the batch to its end (or from where a predecessor left it)."""
        h = await self.redis.hgetall(self.keys.batch(batch_id))
        h = {k.decode(): v.decode() for k, v in h.items()}
        if not h or h["status"] in ENDED:
            return
        try:
            data = await self.files.content(h["input_file_id"], None)
            lines = parse_lines(data, h["endpoint"], LineLimits(self.s.max_batch_lines, self.s.max_body_bytes,
                                                                self.s.max_json_depth))
        except (BadInput, ApiError) as e:
            await self.fail(batch_id, str(e) if isinstance(e, BadInput) else e.message)
            return
        run = BatchRun(self, h, lines)
        self.svc.metrics.batches_running.inc()
        try:
            await run.start()
            await run.feed()
            await run.finalize()
        finally:
            self.svc.metrics.batches_running.dec()

    async def fail(self, batch_id: str, message: str) -> None:
        errors = {"object": "list", "data": [{"code": "invalid_file", "message": message, "param": "input_file_id",
                                              "line": None}]}
        await self.redis.hset(self.keys.batch(batch_id), mapping={
            "status": "failed", "failed_at": int(time.time()), "errors": orjson.dumps(errors).decode()})
        log.info("batch=%s failed: %s", batch_id, message)


class BatchRun:
    """One run of one batch by this process."""

    def __init__(self, batches: Batches, h: dict[str, str], lines: list[Line]):
        self.b, self.h, self.lines = batches, h, lines
        self.id, self.endpoint = h["id"], h["endpoint"]
        self.tenant = batches.svc.tenancy.named(h.get("tenant", ""))  # its policy and quota, as the keys now say
        self.key = batches.keys.batch(self.id)
        self.done: dict[int, dict] = {}  # line -> {"ok": bool, "line": the output or error line}
        self.running: dict[int, list[str]] = {}  # line -> its requests' uids
        self.cancelled: set[int] = set()  # lines this run aborted
        self.stopping = False

    def result_key(self, index: int) -> str:
        return f"batches/{self.id}/lines/{index:08d}"

    async def start(self) -> None:
        """What predecessors finished, and the counts; the batch in progress."""
        store = self.b.files.store()
        async for info in store.list_objects(f"batches/{self.id}/lines/"):
            self.done[int(info.key.rsplit("/", 1)[1])] = orjson.loads(await store.get(info.key))
        bad = sum(1 for line in self.lines if line.error is not None)
        ok = sum(1 for r in self.done.values() if r["ok"])
        fields = {"total": len(self.lines), "completed": ok, "failed": bad + len(self.done) - ok}
        if self.h["status"] == "validating":
            fields.update(status="in_progress", in_progress_at=int(time.time()))
        await self.b.redis.hset(self.key, mapping=fields)

    async def feed(self) -> None:
        limit = asyncio.Semaphore(self.b.s.batch_max_inflight)
        tasks: set[asyncio.Task] = set()
        watcher = asyncio.create_task(self.watch())
        try:
            for line in self.lines:
                if line.error is not None or line.index in self.done:
                    continue
                await limit.acquire()
                if self.stopping or not await self.room(line.model):
                    limit.release()
                    break
                task = asyncio.create_task(self.one(line))
                tasks.add(task)
                task.add_done_callback(lambda t: (tasks.discard(t), limit.release()))
            await asyncio.gather(*tasks)
        finally:
            watcher.cancel()
            for task in tasks:
                task.cancel()

    async def room(self, model: str) -> bool:
        """Wait until the model's backlog lets one more line in; False once the batch is stopping."""
        while not self.stopping:
            if self.b.svc.stages.snapshot.queued(model) <= self.b.s.batch_max_backlog:
                return True
            await asyncio.sleep(POLL_S)
        return False

    async def watch(self) -> None:
        """Cancel and the completion window: stop feeding and abort what runs."""
        while True:
            status = await self.b.redis.hget(self.key, "status")
            expired = time.time() > float(self.h["expires_at"])
            if status == b"cancelling" or expired:
                if expired and status != b"expired":
                    await self.b.redis.hset(self.key, mapping={"status": "expired", "expired_at": int(time.time())})
                self.stopping = True
                await self.abort_running()
            await asyncio.sleep(POLL_S)

    async def abort_running(self) -> None:
        for index, uids in list(self.running.items()):
            if index in self.cancelled:
                continue
            self.cancelled.add(index)
            for uid in uids:
                await self.b.svc.store.abort_now(uid, EndReason.API, self.lines[index].model)

    # -- one line --------------------------------------------------------------------------------------------
    async def one(self, line: Line) -> None:
        ok, out = await self.answer(line)
        while not ok and out["response"]["status_code"] in RETRY and not self.stopping:
            await asyncio.sleep(1.0)  # this process is draining, Redis is full or unreachable: not the line's fault
            ok, out = await self.answer(line)
        if line.index in self.cancelled:
            ok, out = False, output_line(self.id, line, 499, {"error": {
                "message": "the batch was cancelled while the request ran", "type": "invalid_request_error",
                "param": None, "code": "batch_cancelled"}})
        await self.b.files.store().put(self.result_key(line.index), orjson.dumps({"ok": ok, "line": out}))
        self.done[line.index] = {"ok": ok, "line": out}
        await self.b.redis.hincrby(self.key, "completed" if ok else "failed", 1)
        self.b.svc.metrics.batch_lines.labels("ok" if ok else "error").inc()

    async def answer(self, line: Line) -> tuple[bool, dict]:
        """The line's answer (200 and the body) or its HTTP error, as the endpoint would answer it."""
        try:
            admitted, fmt = await self.prepare(line)
            req = await self.open(admitted)
            self.running[line.index] = [j.uid for j in admitted.submission.jobs]
            try:
                body = await self.b.svc.full_body(req, fmt)
            finally:
                self.running.pop(line.index, None)
                await req.close()
            on_end = getattr(fmt, "on_end", None)
            if on_end is not None:
                await on_end(body)
            return True, output_line(self.id, line, 200, body)
        except (RedisError, OSError):
            raise
        except Exception as e:
            err = as_api_error(e)
            if err is None:
                log.exception("batch=%s line %d failed", self.id, line.index)
                err = ApiError(500, "the request failed", code="server_error")
            return False, output_line(self.id, line, err.status, err.body())

    async def prepare(self, line: Line) -> tuple[Admitted, Format]:
        """The line admitted as its endpoint admits a body (services/api/admission.py), with its own uids."""
        if line.body.get("stream") or line.body.get("background"):
            raise ApiError(400, "a batch's requests are neither streamed nor background", param="stream")
        new_uid = self.uids(line.index)
        if line.url == "/v1/responses":
            return await self.b.responses.prepare(ResponseRequest.model_validate(line.body), self.tenant, new_uid)
        admitted = await self.b.svc.admission.admit(BODIES[line.url].model_validate(line.body), self.tenant, new_uid)
        return admitted, admitted.submission.fmt

    def uids(self, index: int) -> Callable[[], str]:
        counter: Iterator[int] = iter(range(1 << 30))
        return lambda: line_uid(self.id, index, next(counter))

    async def open(self, admitted: Admitted) -> ApiRequest:
        """Submit the line's jobs, as background jobs behind interactive ones, holding the tenant's lease (taken
        at admission; a 429 there is tried again later); those a predecessor submitted (their record exists) are
        followed instead."""
        return await leased(self.submit(admitted.submission), admitted.lease)

    async def submit(self, submission: Submission) -> ApiRequest:
        priority = self.b.svc.tenancy.priority_of(self.tenant, self.b.s.batch_priority)  # within its key's range
        jobs = [msgspec.structs.replace(j, background=True, priority=priority) for j in submission.jobs]
        records = await self.b.svc.store.fields([j.uid for j in jobs], "status", "model")
        record = submission.record
        requests = self.b.svc.requests
        members: list[SingleRequest] = []
        try:
            for job in jobs:
                if records[job.uid][0] is None:
                    members.append(await SingleRequest.open(requests, job, record, False, "batch",
                                                            writes=None if members else submission.writes))
                else:
                    members.append(await requests.attach(job.uid, await self.b.svc.store.record(job.uid), None))
        except BaseException:
            for m in members:
                await m.close(EndReason.REJECTED)
            raise
        return members[0] if len(members) == 1 else RequestGroup(members, jobs[0].params.n)

    # -- the end ---------------------------------------------------------------------------------------------
    async def finalize(self) -> None:
        """Write the output and error files (ids derived from the batch: a second run writes the same) and end."""
        status = (await self.b.redis.hget(self.key, "status") or b"").decode()
        if status in ENDED and status != "expired":
            return
        await self.b.redis.hset(self.key, mapping={"status": "finalizing" if status == "in_progress" else status,
                                                  "finalizing_at": int(time.time())})
        out, err = [], []
        for line in self.lines:
            if line.error is not None:
                err.append(invalid_line(self.id, line))
            elif line.index in self.done:
                (out if self.done[line.index]["ok"] else err).append(self.done[line.index]["line"])
        fields: dict[str, Any] = {}
        for name, rows in (("output", out), ("error", err)):
            if rows:
                data = b"".join(orjson.dumps(r) + b"\n" for r in rows)
                f = await self.b.files.create(data, f"{self.id}_{name}.jsonl", "batch_output",
                                              file_id=f"file-{self.id.removeprefix('batch_')}{name[0]}",
                                              tenant=self.h.get("tenant", ""))
                fields[f"{name}_file_id"] = f["id"]
        end = {"in_progress": "completed", "finalizing": "completed", "cancelling": "cancelled"}.get(status, status)
        fields.update(status=end, completed=len(out), failed=len(err), **{f"{end}_at": int(time.time())})
        await self.b.redis.hset(self.key, mapping=fields)
        self.b.svc.metrics.batches.labels(end).inc()
        await self.clean_up()
        log.info("batch=%s %s: %d ok, %d failed", self.id, end, len(out), len(err))

    async def clean_up(self) -> None:
        store = self.b.files.store()
        for index in list(self.done):
            with contextlib.suppress(OSError):
                await store.delete(self.result_key(index))


class BatchRunner:
    """This process's part of the `batch` consumer group: it runs one batch at a time, claims those whose runner
    went quiet, and touches the entry of the one it runs."""

    def __init__(self, batches: Batches):
        self.b = batches
        self.member = streams.Member(GROUP, batches.svc.pod)
        self.task: asyncio.Task | None = None
        self.cursor = "0-0"

    def start(self) -> None:
        self.task = asyncio.create_task(self.loop())

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


    async def loop(self) -> None:
        """Every WORK_POLL_S, unless draining (its batches are then left to the other API processes): a batch to
        run, polled without blocking (two commands), so an idle API costs Redis one command a second."""
        key, grouped, swept = self.b.keys.batch_work(), False, time.monotonic()
        while True:
            try:
                await asyncio.sleep(WORK_POLL_S)
                if self.b.svc.draining:
                    continue
                if time.monotonic() - swept > FILE_SWEEP_S:
                    swept = time.monotonic()
                    await self.b.files.sweep_orphans()
                if not grouped:
                    grouped = await streams.create_group(self.b.redis, key, GROUP, mkstream=True)
                entry = await self.next_entry(key)
                if entry is not None:
                    await self.run_held(key, *entry)
            except (RedisError, OSError) as e:
                log.warning("batch runner: %s", e)
                await asyncio.sleep(1.0)
            except Exception:
                log.exception("batch runner")
                await asyncio.sleep(1.0)

    async def next_entry(self, key: str) -> tuple[str, str] | None:
        """A batch whose runner went quiet, else a new one."""
        idle_ms = int(self.b.s.batch_claim_idle_s * 1000)
        claimed = (await streams.autoclaim(self.b.redis, {key: self.cursor}, self.member, idle_ms, 1))[key]
        rows: list = []
        if not isinstance(claimed, Exception):
            self.cursor, rows = claimed
        if not rows:
            rows = [(eid, f) for _, eid, f in await streams.read_group(self.b.redis, [key], self.member, 1, None)]
        if not rows:
            return None
        entry_id, fields = rows[0]
        try:
            work = decode(fields[b"data"], BatchWork)
        except (KeyError, msgspec.DecodeError, msgspec.ValidationError):
            log.error("unreadable batch work entry %s: acknowledged", streams.as_str(entry_id))
            await streams.ack(self.b.redis, key, GROUP, [streams.as_str(entry_id)])
            return None
        return streams.as_str(entry_id), work.batch_id

    async def run_held(self, key: str, entry_id: str, batch_id: str) -> None:
        """Run the batch while this process holds its entry (touched every third of the claim idle time); one
        taken over is left to its new runner."""
        run = asyncio.create_task(self.b.run(batch_id))
        every = self.b.s.batch_claim_idle_s / 3
        try:
            while not run.done():
                await asyncio.wait({run}, timeout=every)
                if run.done():
                    break
                if (await streams.touch_own(self.b.redis, {key: [entry_id]}, self.member))[key]:
                    log.warning("batch=%s taken over by another runner", batch_id)
                    return
            run.result()
            await streams.ack(self.b.redis, key, GROUP, [entry_id])
        finally:
            if not run.done():
                run.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await run
