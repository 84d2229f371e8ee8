"""Several requests answered as one response: a completion with a list of prompts is one request per
prompt through the pipeline (each with its own uid, record and reply stream), merged here. Choice `i` of
prompt `k` is choice `k * per + i` of the response, as OpenAI numbers them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec

from services.api.gateway import Inflight
from shared.messages import ReplyEvent

Pairs = list[tuple[str, ReplyEvent]]


class GroupOrder:
    """The usage counts of the whole group."""

    def __init__(self, flights: list[Inflight]):
        self.flights = flights

    @property
    def prompt_tokens(self) -> int:
        return sum(f.order.prompt_tokens for f in self.flights)

    @property
    def completion_tokens(self) -> int:
        return sum(f.order.completion_tokens for f in self.flights)

    @property
    def cached_tokens(self) -> int:
        return sum(f.order.cached_tokens for f in self.flights)

    @property
    def done(self) -> bool:
        return all(f.order.done for f in self.flights)


class FlightGroup:
    """Quacks like one Inflight for services/api/service.py's answering code (entries, events, usage, end
    reason); `flights` are finished one by one."""

    def __init__(self, flights: list[Inflight], per: int):
        self.flights, self.per = flights, per
        self.order = GroupOrder(flights)
        self.uid, self.model = flights[0].uid, flights[0].model
        self.started = flights[0].started
        self.first_token_at: float | None = None

    @property
    def done(self) -> bool:
        return self.order.done

    @property
    def span(self):  # the first prompt's trace stands for the group's first token
        return self.flights[0].span

    @property
    def end_reason(self) -> str:
        return self.flights[0].end_reason

    @end_reason.setter
    def end_reason(self, reason: str) -> None:
        for f in self.flights:
            f.end_reason = reason

    def entries(self, idle_s: float | None = None) -> AsyncIterator[Pairs]:
        return merged([f.entries(idle_s) for f in self.flights], self.per)

    async def events(self) -> AsyncIterator[tuple[str, list[ReplyEvent]]]:
        async for pairs in self.entries():
            if pairs:
                yield pairs[-1][0], [ev for _, ev in pairs]


async def merged(sources: list[AsyncIterator[Pairs]], per: int) -> AsyncIterator[Pairs]:
    """Entries of every source as they come, choice indices shifted by the source's place; the first
    error of any source ends it (the others are cancelled)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, source: AsyncIterator[Pairs]) -> None:
        try:
            async for pairs in source:
                shifted = [(eid, msgspec.structs.replace(ev, index=ev.index + k * per)) for eid, ev in pairs]
                await queue.put((shifted, None))
        except Exception as e:  # StageFailed, DeadlineExceeded, HubError: the caller maps them
            await queue.put((None, e))
            return
        await queue.put((None, None))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(sources)]
    try:
        live = len(tasks)
        while live:
            pairs, error = await queue.get()
            if error is not None:
                raise error
            if pairs is None:
                live -= 1
                continue
            yield pairs
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
