"""A completion's several prompts answered as one request (`RequestGroup`): one single request per prompt
(services/api/answer/request/single.py), their replies merged."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import msgspec

from services.api.answer.request.api_request import Batch, Writes
from services.api.answer.request.context import RequestContext
from services.api.answer.request.early_end import EndedEarly
from services.api.answer.request.single import SingleRequest
from shared.messages import TokenizeJob
from shared.request_states import EndReason

if TYPE_CHECKING:
    from services.api.multitenancy.quotas import Lease


class GroupCounts:
    """The usage of a whole group."""

    def __init__(self, members: list[SingleRequest]):
        self.members = members

    @property
    def prompt_tokens(self) -> int:
        return sum(m.order.prompt_tokens for m in self.members)

    @property
    def completion_tokens(self) -> int:
        return sum(m.order.completion_tokens for m in self.members)

    @property
    def cached_tokens(self) -> int:
        return sum(m.order.cached_tokens for m in self.members)


class RequestGroup:
    """A completion with a list of prompts: one request per prompt through the pipeline (each with its own uid,
    record and reply stream), answered as one. Choice `i` of prompt `k` is choice `k * per + i` of the response,
    as OpenAI numbers them; its first prompt's trace stands for the group's first token."""

    def __init__(self, members: list[SingleRequest], per: int):
        self.members, self.per = members, per
        self.counts = GroupCounts(members)
        self.uid, self.model = members[0].uid, members[0].model
        self.times_first_token = members[0].times_first_token
        self.lease: Lease | None = None
        for m in members:
            m.times_first_token = False

    def hold(self, lease: Lease | None) -> None:
        self.lease = lease
        if lease is not None:
            lease.follow(tuple(m.uid for m in self.members), self.counts)

    @classmethod
    async def open(cls, ctx: RequestContext, jobs: list[TokenizeJob], record: dict, stream: bool, label: str, *,
                   writes: Writes | None = None) -> RequestGroup:
        """Open every job (`writes` with the first); if one cannot be opened, those already open are ended
        (`EndReason.REJECTED`)."""
        members: list[SingleRequest] = []
        try:
            for job in jobs:
                members.append(await SingleRequest.open(ctx, job, record, stream, label,
                                                        writes=None if members else writes))
        except BaseException:
            for m in members:
                await m.close(EndReason.REJECTED)
            raise
        return cls(members, jobs[0].params.n)

    @property
    def done(self) -> bool:
        return all(m.done for m in self.members)

    @property
    def end_reason(self) -> str:
        return self.members[0].end_reason

    @end_reason.setter
    def end_reason(self, reason: str) -> None:
        for m in self.members:
            m.end_reason = reason

    async def replies(self, idle_s: float | None = None) -> AsyncIterator[Batch]:
        first = self.members[0]
        try:
            async for batch in merged([m.replies(idle_s) for m in self.members], self.per):
                if batch and first.first_token_at is None and self.times_first_token:
                    first.first_token()
                yield batch
        except EndedEarly as e:
            self.end_reason = e.reason  # the first prompt to end early ends them all
            raise

    async def close(self, reason: str | None = None) -> None:
        try:
            for m in self.members:
                await m.close(reason)
        finally:
            if self.lease is not None:
                await self.lease.end(self.done)


async def merged(sources: list[AsyncIterator[Batch]], per: int) -> AsyncIterator[Batch]:
    """Batches of every source as they come, choice indices shifted by the source's place; the first error of
    any source ends it (the others are cancelled)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, source: AsyncIterator[Batch]) -> None:
        try:
            async for batch in source:
                shifted = [(eid, msgspec.structs.replace(ev, index=ev.index + k * per)) for eid, ev in batch]
                await queue.put((shifted, None))
        except Exception as e:  # EndedEarly: the caller maps it
            await queue.put((None, e))
            return
        await queue.put((None, None))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(sources)]
    try:
        live = len(tasks)
        while live:
            batch, error = await queue.get()
            if error is not None:
                raise error
            if batch is None:
                live -= 1
                continue
            yield batch
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
