"""The requests of this API process (`Requests`): a body's jobs opened as one request, once admitted (`Admitted`,
services/api/answer/admission.py), or a request submitted by any API process attached to; the tenant's lease each
holds; and the race of a request's work against its client leaving."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import Request as HttpRequest
from redis.exceptions import RedisError

from services.api.answer.request.api_request import ApiRequest, Writes
from services.api.answer.request.context import RequestContext
from services.api.answer.request.group import RequestGroup
from services.api.answer.request.single import SingleRequest
from shared import queued
from shared.messages import TokenizeJob

if TYPE_CHECKING:
    from services.api.answer.schemas.submission import Submission
    from services.api.multitenancy.quotas import Lease


@dataclass(frozen=True)
class Admitted:
    """A request that was taken: its submission (jobs with their tenant, record with its fields) and the lease of
    its tenant's quota (None without one), which ends with the request."""

    submission: Submission
    lease: Lease | None

    @property
    def uid(self) -> str:
        """Its first job's: the request's id in logs, its response's id."""
        return self.submission.jobs[0].uid


async def until_disconnect(request: HttpRequest, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Run `work` unless the client goes away first: (True, result) or (False, None)."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher, task = asyncio.ensure_future(watch()), asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        gone = not task.done()
        if gone:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return (False, None) if gone else (True, task.result())


async def leased(opening: Awaitable[ApiRequest], lease: Lease | None) -> ApiRequest:
    """The opened request, holding `lease` (its tenant's quota, services/api/multitenancy/quotas.py) until it ends; the
    lease released if it does not open."""
    try:
        req = await opening
    except BaseException:
        if lease is not None:
            await lease.release()
        raise
    req.hold(lease)
    return req


class Requests(RequestContext):
    """Opens this process's requests on what they share (services/api/answer/request/context.py)."""

    async def open(self, admitted: Admitted, label: str | None = None) -> ApiRequest:
        """Submit an admitted body's jobs (services/api/answer/admission.py); `label` names how it is answered in the
        metrics (stream, full, generate; by default the submission's). The request holds its tenant's lease."""
        sub = admitted.submission
        opening = self.open_jobs(sub.jobs, sub.record, sub.stream, label or sub.label, writes=sub.writes)
        try:
            return await leased(opening, admitted.lease)
        except BaseException:  # not opened: its jobs leave the model's queue count now, not at their deadline
            with anyio.CancelScope(shield=True), contextlib.suppress(RedisError, OSError):
                await queued.leave(self.redis, self.keys, sub.jobs[0].model, queued.members(sub.jobs))
            raise

    async def open_jobs(self, jobs: list[TokenizeJob], record: dict, stream: bool, label: str, *,
                        writes: Writes | None = None) -> ApiRequest:
        """`writes`: what the submission stores beside its record, with its first job (`SingleRequest.open`)."""
        if len(jobs) == 1:
            return await SingleRequest.open(self, jobs[0], record, stream, label, writes=writes)
        return await RequestGroup.open(self, jobs, record, stream, label, writes=writes)

    async def attach(self, uid: str, record: dict, last_event_id: str | None) -> SingleRequest:
        return await SingleRequest.attach(self, uid, record, last_event_id)
