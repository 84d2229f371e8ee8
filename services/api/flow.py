"""From raw reply-stream entries to ordered events: per choice, in token-index order, each range once.

Stages may write a range twice (a peer replica redoing a dead one's work) or out of order (a gap a peer
fills after claiming it); events carry [start, end) token ranges, so the API delivers each choice's
events in order, holds early ones and drops what it already delivered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import msgspec

from services.api.replies import Subscription
from shared.messages import Reply, ReplyError, ReplyEvent, decode

log = logging.getLogger(__name__)


class StageFailed(Exception):
    """A stage sent an error reply for this request."""

    def __init__(self, error: ReplyError):
        super().__init__(error.message)
        self.error = error


class DeadlineExceeded(Exception):
    pass


class OrderedReplies:
    def __init__(self, n: int):
        self.next = [0] * n  # next token index to deliver, per choice
        self.held: list[dict[int, ReplyEvent]] = [{} for _ in range(n)]
        self.finished: dict[int, str] = {}
        self.prompt_tokens = 0
        self.cached_tokens = 0  # of the prompt, read from the engine's prefix cache

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.next)

    def accept(self, ev: ReplyEvent) -> list[ReplyEvent]:
        """Events now deliverable, in order, after receiving `ev`."""
        i = ev.index
        if not 0 <= i < len(self.next) or i in self.finished:
            return []
        self.prompt_tokens = max(self.prompt_tokens, ev.prompt_tokens)
        self.cached_tokens = max(self.cached_tokens, ev.cached_tokens)
        if ev.finish_reason is not None and not ev.ids and ev.start <= self.next[i]:
            self.finished[i] = ev.finish_reason  # an abort or error ends the choice where it stands
            self.held[i].clear()
            return [ev]
        if ev.end < self.next[i] or (ev.end == self.next[i] and ev.finish_reason is None):
            return []  # already delivered
        if ev.start > self.next[i]:
            self.held[i][ev.start] = ev  # a gap before it: wait for the range a peer will redo
            return []
        if ev.start < self.next[i]:
            # Overlaps what was delivered; its text cannot be split by token. Whoever wrote the part we
            # have also writes the rest in step-sized ranges, which do fit.
            log.warning("dropping reply range [%d, %d) overlapping delivered %d", ev.start, ev.end, self.next[i])
            return []
        out = [ev]
        self._advance(ev)
        while i not in self.finished and (nxt := self.held[i].pop(self.next[i], None)) is not None:
            out.append(nxt)
            self._advance(nxt)
        return out

    def _advance(self, ev: ReplyEvent) -> None:
        self.next[ev.index] = max(self.next[ev.index], ev.end)
        if ev.finish_reason is not None:
            self.finished[ev.index] = ev.finish_reason
            self.held[ev.index].clear()

    @property
    def completion_tokens(self) -> int:
        return sum(self.next)


async def ordered_events(sub: Subscription, order: OrderedReplies, deadline: float
                         ) -> AsyncIterator[tuple[str, list[ReplyEvent]]]:
    """Yield (last entry id, events) for everything that arrives at once, until every choice finished.
    Raises StageFailed on an error reply, DeadlineExceeded at the deadline, HubError if Redis is gone."""
    async for pairs in ordered_entries(sub, order, deadline):
        yield pairs[-1][0], [ev for _, ev in pairs]


async def ordered_entries(sub: Subscription, order: OrderedReplies, deadline: float, idle_s: float | None = None
                          ) -> AsyncIterator[list[tuple[str, ReplyEvent]]]:
    """Like ordered_events, but each event with the id of the reply entry that carried it. With `idle_s`,
    an empty list is yielded whenever nothing arrived for that long (the caller may start its response)."""
    while not order.done:
        remaining = deadline - time.time()
        if remaining <= 0:
            raise DeadlineExceeded()
        wait = remaining if idle_s is None else min(remaining, idle_s)
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation that lands
        # as an entry arrives, and a request whose client left would then never be aborted.
        try:
            async with asyncio.timeout(wait):
                first = await sub.get()
        except TimeoutError:
            if wait < remaining:
                yield []
                continue
            raise DeadlineExceeded() from None
        pairs: list[tuple[str, ReplyEvent]] = []
        for entry_id, raw in [first, *sub.drain()]:
            try:
                msg = decode(raw, Reply)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                log.error("uid=%s unreadable reply entry %s: %s", sub.uid, entry_id, e)
                continue
            if isinstance(msg, ReplyError):
                if pairs:
                    yield pairs
                raise StageFailed(msg)
            pairs.extend((entry_id, ev) for ev in order.accept(msg))
        if pairs:
            yield pairs
