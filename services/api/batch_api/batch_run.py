"""One run of one batch by one API process (services/api/batch_api/batches.py has the batch's life,
services/api/batch_api/batch_runner.py the turns): its lines fed to the pipeline, each line's result stored as it ends
(services/api/batch_api/batch_output.py), then the output and error files written by streaming those results.

A line its tenant's quota refuses (429, or 503 of a draining process or a full Redis) is kept for later: the run
feeds nothing more until one of its own lines ends, and once none runs it stops, `parked` (its runner runs it again
after the refusal's Retry-After), so a rate-limited tenant's batch never holds the runner. The tenant's policy is
read again for each line, so a key changed or suspended mid-run applies at the next line.

A line's tokens are charged to its tenant once, by the lease its admission took when its request ends
(services/api/multitenancy/quotas.py): a runner that takes over a line its predecessor submitted follows it under a
lease of its own, and the predecessor's, gone with its process, charges nothing. An output (or error) file that would
pass --max-file-bytes ends the batch `failed` with the reason, as soon as the results stored show it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import msgspec
import orjson
from redis.exceptions import RedisError

from services.api.answer.admission import Admitted
from services.api.answer.formats import Format
from services.api.answer.request.api_request import ApiRequest
from services.api.answer.request.group import RequestGroup
from services.api.answer.request.requests import leased
from services.api.answer.request.single import SingleRequest
from services.api.answer.schemas.chat import ChatCompletionRequest
from services.api.answer.schemas.completions import CompletionRequest
from services.api.answer.schemas.submission import Submission
from services.api.batch_api.batch_lines import Line, invalid_line, line_uid, output_line
from services.api.batch_api.batch_output import Result, ordered_rows, result_key, stored_results
from services.api.batch_api.files import content_key
from services.api.errors import ApiError, as_api_error
from services.api.multitenancy.tenants import Tenant
from services.api.pooling_api.prefill import EmbeddingRequest
from services.api.responses_api.response_schemas import ResponseRequest
from shared import queued
from shared.request_states import EndReason

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from services.api.answer.collaborators import ApiContext
    from services.api.answer.service import ApiService
    from services.api.batch_api.files import Files
    from services.api.responses_api.responses import Responses
    from shared.keys import Keys
    from shared.settings import ApiSettings

log = logging.getLogger(__name__)

ENDED = ("completed", "failed", "expired", "cancelled")
STOPPING = ("cancelling", "expired")
END_OF = {"in_progress": "completed", "finalizing": "completed", "cancelling": "cancelled", "expired": "expired"}
BODIES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
          "/v1/embeddings": EmbeddingRequest}
POLL_S = 0.5
RETRY = (429, 503)  # a line refused for these before it was submitted is tried again later


class BatchOwner(Protocol):
    """What a run uses of the batches it belongs to (services/api/batch_api/batches.py `Batches`, which starts it):
    their settings, Redis, files, the answer path, and a batch's failure and clean-up."""

    s: ApiSettings
    redis: Redis
    keys: Keys
    files: Files
    responses: Responses
    ctx: ApiContext
    service: ApiService

    async def fail(self, batch_id: str, message: str, code: str = ..., param: str | None = ...) -> None: ...

    async def clean_up(self, batch_id: str) -> None: ...


class BatchRun:
    """One run of one batch by this process."""

    def __init__(self, batches: BatchOwner, h: dict[str, str], lines: list[Line]):
        self.b, self.h, self.lines = batches, h, lines
        self.id, self.endpoint, self.tenant_name = h["id"], h["endpoint"], h.get("tenant", "")
        self.key = batches.keys.batch(self.id)
        self.store = batches.files.store()
        self.done: dict[int, Result] = {}  # lines whose result is stored (by this run or a predecessor)
        self.pending: deque[Line] = deque()  # lines to feed, in order
        self.line = LineRun(batches, self.id, self.tenant_name)
        self.cancelled: set[int] = set()  # lines this run aborted
        self.stopping = h["status"] in STOPPING
        self.refused: float | None = None  # a line was refused: the Retry-After of the longest refusal
        self.failure: str | None = None  # why the batch fails (an output file over its bound)
        self.finished = 0  # lines this run ended

    def sizes(self) -> tuple[int, int]:
        """The output and error files' sizes, from the results stored and the lines that could not be read."""
        out = sum(r.size for r in self.done.values() if r.ok)
        err = sum(r.size for r in self.done.values() if not r.ok) + sum(
            len(orjson.dumps(invalid_line(self.id, line))) + 1 for line in self.lines if line.error is not None)
        return out, err

    async def start(self) -> None:
        """What predecessors finished (from the store's listing), the counts; the batch in progress."""
        self.done = await stored_results(self.store, self.id)
        self.pending = deque(ln for ln in self.lines if ln.error is None and ln.index not in self.done)
        bad = sum(1 for line in self.lines if line.error is not None)
        ok = sum(1 for r in self.done.values() if r.ok)
        fields: dict[str, Any] = {"total": len(self.lines), "completed": ok, "failed": bad + len(self.done) - ok}
        if self.h["status"] == "validating":
            fields.update(status="in_progress", in_progress_at=int(time.time()))
        await self.b.redis.hset(self.key, mapping=fields)
        self.check_sizes()

    async def feed(self) -> float | None:
        """Run the lines; None once every line ended (or the batch stops), else how long to park the batch."""
        tasks: set[asyncio.Task] = set()
        watcher = asyncio.create_task(self.watch())
        try:
            while not self.stopping:
                if self.refused is not None and not tasks:
                    return max(1.0, self.refused)
                if self.pending and self.refused is None and len(tasks) < self.b.s.batch_max_inflight:
                    if await self.room(self.pending[0].model) and self.refused is None:
                        tasks.add(asyncio.create_task(self.one(self.pending.popleft())))
                    continue
                if not tasks:
                    break
                finished, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                tasks -= finished
                if any(t.result() for t in finished):
                    self.refused = None  # one of its own ended: room under its quota again, maybe
            await asyncio.gather(*tasks)
            return None
        finally:
            watcher.cancel()
            for task in tasks:
                task.cancel()

    async def room(self, model: str) -> bool:
        """Wait until the model's backlog lets one more line in; False once the batch is stopping."""
        while not self.stopping:
            if self.b.ctx.stages.snapshot.queued(model) <= self.b.s.batch_max_backlog:
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
                await self.stop()
            await asyncio.sleep(POLL_S)

    async def stop(self) -> None:
        self.stopping = True
        for index, uids in list(self.line.running.items()):
            if index in self.cancelled:
                continue
            self.cancelled.add(index)
            for uid in uids:
                await self.b.ctx.store.abort_now(uid, EndReason.API, self.lines[index].model)

    # -- one line --------------------------------------------------------------------------------------------
    async def one(self, line: Line) -> bool:
        """Run the line and store its result (True), or keep it for later if it was refused (False)."""
        ok, out, retry = await self.line.answer(line)
        if retry is not None and not self.stopping:
            self.pending.appendleft(line)
            self.refused = max(self.refused or 0.0, retry)
            return False
        if line.index in self.cancelled:
            ok, out = False, output_line(self.id, line, 499, {"error": {
                "message": "the batch was cancelled while the request ran", "type": "invalid_request_error",
                "param": None, "code": "batch_cancelled"}})
        row = orjson.dumps(out) + b"\n"
        await self.store.put(result_key(self.id, line.index, ok), row)
        self.done[line.index] = Result(ok, len(row))
        self.finished += 1
        await self.b.redis.hincrby(self.key, "completed" if ok else "failed", 1)
        self.b.ctx.metrics.batch_lines.labels("ok" if ok else "error").inc()
        if self.check_sizes():
            await self.stop()
        return True

    def check_sizes(self) -> bool:
        """Whether a file has just grown past --max-file-bytes (the batch then fails)."""
        if self.failure is not None:
            return False
        limit = self.b.s.max_file_bytes
        for name, size in zip(("output", "error"), self.sizes(), strict=True):
            if size > limit:
                self.failure = f"the batch's {name} file is over {limit} bytes (--max-file-bytes)"
                self.stopping = True
                return True
        return False

    # -- the end ---------------------------------------------------------------------------------------------
    async def finalize(self) -> None:
        """Write the output and error files (ids derived from the batch: a second run writes the same) and end;
        `failed`, with its objects removed, if they cannot be written."""
        status = await self.status()
        if status in ENDED and status != "expired":
            return
        if status == "in_progress":
            status = "finalizing"
        await self.b.redis.hset(self.key, mapping={"status": status, "finalizing_at": int(time.time())})
        self.done = await stored_results(self.store, self.id)
        self.check_sizes()
        written: list[str] = []
        fields: dict[str, Any] = {}
        code = "output_too_large"
        try:
            if self.failure is None:
                for name, ok in (("output", True), ("error", False)):
                    file_id = await self.write_file(name, ok, written)
                    if file_id:
                        fields[f"{name}_file_id"] = file_id
        except ApiError as e:  # the tenant's bound on stored files
            self.failure, code = e.message, e.code or code
        if self.failure is not None:
            await self.b.fail(self.id, self.failure, code, None)
            for file_id in written:
                await self.b.files.remove(file_id, self.tenant_name)
            await self.b.clean_up(self.id)
            return
        await self.end(status, fields)

    async def write_file(self, name: str, ok: bool, written: list[str]) -> str | None:
        """One of the two files, streamed from the stored results in line order (counted against the tenant's
        bound first); its id, None if it has no line."""
        from shared.object_store import TooLarge

        items: list[str | bytes] = []
        for line in self.lines:
            if line.error is not None and not ok:
                items.append(orjson.dumps(invalid_line(self.id, line)) + b"\n")
            elif line.index in self.done and self.done[line.index].ok == ok:
                items.append(result_key(self.id, line.index, ok))
        if not items:
            return None
        size = self.sizes()[0 if ok else 1]
        file_id = f"file-{self.id.removeprefix('batch_')}{name[0]}"
        ttl_s = int(self.h.get("output_ttl_s") or self.b.s.file_ttl_s)
        await self.b.files.quota.reserve(self.tenant_name, file_id, size, time.time() + ttl_s)
        written.append(file_id)
        try:
            size = await self.store.put_stream(content_key(file_id), ordered_rows(self.store, items))
        except TooLarge:
            self.failure = f"the batch's {name} file is over {self.b.s.max_file_bytes} bytes (--max-file-bytes)"
            return None
        await self.b.files.register(file_id, f"{self.id}_{name}.jsonl", "batch_output", size,
                                    tenant=self.tenant_name, ttl_s=ttl_s)
        return file_id

    async def end(self, status: str, fields: dict[str, Any]) -> None:
        now = await self.status()  # a cancel while the files were written ends it cancelled
        end = END_OF.get(now if now == "cancelling" else status, status)
        ok = sum(1 for r in self.done.values() if r.ok)
        failed = len(self.lines) - sum(1 for line in self.lines if line.error is None) + len(self.done) - ok
        fields.update(status=end, completed=ok, failed=failed, **{f"{end}_at": int(time.time())})
        await self.b.redis.hset(self.key, mapping=fields)
        self.b.ctx.metrics.batches.labels(end).inc()
        await self.b.clean_up(self.id)
        log.info("batch=%s %s: %d ok, %d failed", self.id, end, ok, failed)

    async def status(self) -> str:
        return (await self.b.redis.hget(self.key, "status") or b"").decode()


class LineRun:
    """One line of a batch run as its endpoint runs a body (services/api/answer/admission.py), under its tenant's policy
    and quota as the keys say at that line."""

    def __init__(self, batches: BatchOwner, batch_id: str, tenant_name: str):
        self.b, self.id, self.tenant_name = batches, batch_id, tenant_name
        self.running: dict[int, list[str]] = {}  # line -> its requests' uids

    @property
    def tenant(self) -> Tenant:
        return self.b.ctx.tenancy.named(self.tenant_name)

    async def answer(self, line: Line) -> tuple[bool, dict, float | None]:
        """The line's answer (200 and the body) or its HTTP error, as the endpoint would answer it, and, for a
        refusal before anything was submitted, its Retry-After."""
        opened = False
        try:
            admitted, fmt = await self.prepare(line)
            req = await self.open(admitted)
            opened = True
            self.running[line.index] = [j.uid for j in admitted.submission.jobs]
            try:
                body = await self.b.service.full_body(req, fmt)
            finally:
                self.running.pop(line.index, None)
                await req.close()
            on_end = getattr(fmt, "on_end", None)
            if on_end is not None:
                await on_end(body)
            return True, output_line(self.id, line, 200, body), None
        except (RedisError, OSError):
            raise
        except Exception as e:
            err = as_api_error(e)
            if err is None:
                log.exception("batch=%s line %d failed", self.id, line.index)
                err = ApiError(500, "the request failed", code="server_error")
            final = (err.headers or {}).get("x-should-retry") == "false"  # e.g. more tokens than its tpm ever
            retry = (err.retry_after or 1.0) if err.status in RETRY and not opened and not final else None
            return False, output_line(self.id, line, err.status, err.body()), retry

    async def prepare(self, line: Line) -> tuple[Admitted, Format]:
        """The line admitted as its endpoint admits a body (services/api/answer/admission.py), with its own uids."""
        if line.body.get("stream") or line.body.get("background"):
            raise ApiError(400, "a batch's requests are neither streamed nor background", param="stream")
        new_uid = self.uids(line.index)
        if line.url == "/v1/responses":
            return await self.b.responses.prepare(ResponseRequest.model_validate(line.body), self.tenant, new_uid)
        body = BODIES[line.url].model_validate(line.body)
        admitted = await self.b.service.admission.admit(body, self.tenant, new_uid)
        return admitted, admitted.submission.fmt

    def uids(self, index: int) -> Callable[[], str]:
        counter: Iterator[int] = iter(range(1 << 30))
        return lambda: line_uid(self.id, index, next(counter))

    async def open(self, admitted: Admitted) -> ApiRequest:
        """Submit the line's jobs, as background jobs behind interactive ones, holding the tenant's lease (taken
        at admission); those a predecessor submitted (their record exists) are followed instead."""
        sub = admitted.submission
        try:
            return await leased(self.submit(sub), admitted.lease)
        except BaseException:  # not opened: its jobs leave the model's queue count now, not at their deadline
            with anyio.CancelScope(shield=True), contextlib.suppress(RedisError, OSError):
                await queued.leave(self.b.redis, self.b.keys, sub.jobs[0].model, queued.members(sub.jobs))
            raise

    async def submit(self, submission: Submission) -> ApiRequest:
        priority = self.b.ctx.tenancy.priority_of(self.tenant, self.b.s.batch_priority)  # within its key's range
        jobs = [msgspec.structs.replace(j, background=True, priority=priority) for j in submission.jobs]
        records = await self.b.ctx.store.fields([j.uid for j in jobs], "status", "model")
        record = submission.record
        requests = self.b.ctx.requests
        members: list[SingleRequest] = []
        try:
            for job in jobs:
                if records[job.uid][0] is None:
                    members.append(await SingleRequest.open(requests, job, record, False, "batch",
                                                            writes=None if members else submission.writes))
                else:
                    members.append(await requests.attach(job.uid, await self.b.ctx.store.record(job.uid), None))
        except BaseException:
            for m in members:
                await m.close(EndReason.REJECTED)
            raise
        # a followed job was counted in the model's queue by its admission here, but it was queued (and counted,
        # and maybe started) by the predecessor: it leaves the count, which would otherwise hold it till its deadline
        followed = queued.members(j for j in jobs if records[j.uid][0] is not None)
        if followed:
            await queued.leave(self.b.redis, self.b.keys, jobs[0].model, followed)
        return members[0] if len(members) == 1 else RequestGroup(members, jobs[0].params.n)
