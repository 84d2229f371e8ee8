"""Step 2 of a request's path (services/api/service.py `ApiService.answer`): raw reply-stream entries ->
ordered events, by shared/replies.py's OrderedReplies: per choice, in token-index order, each range once,
and nothing of a scheduler that was taken over once its successor's fence is in the stream. A reply that
ends before the request finished (an error reply, the deadline, Redis gone) raises one of `ENDED_EARLY`;
`ended_early` turns it into the HTTP error and notes on the flight why it ended."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Protocol

import msgspec
from redis.exceptions import RedisError

from services.api.errors import ApiError, redis_down
from services.api.replies import HubError, Subscription
from shared import streams
from shared.messages import Reply, ReplyCheckpoint, ReplyError, ReplyEvent, ReplyFence, decode
from shared.replies import OrderedReplies

log = logging.getLogger(__name__)


class StageFailed(Exception):
    """A stage sent an error reply for this request."""

    def __init__(self, error: ReplyError):
        super().__init__(error.message)
        self.error = error


class DeadlineExceeded(Exception):
    pass


ENDED_EARLY = (StageFailed, DeadlineExceeded, HubError)


class Ending(Protocol):
    end_reason: str  # services/api/gateway.py Inflight, or services/api/fanout.py FlightGroup


def stage_error(e: StageFailed) -> ApiError:
    err = e.error
    return ApiError(err.status, err.message, type=err.type, param=err.param, code=err.code)


def timeout_error() -> ApiError:
    return ApiError(504, "the request did not finish before its deadline", code="request_timeout")


def ended_early(flight: Ending, e: Exception) -> ApiError:
    """The HTTP error for a reply that ended before it finished; notes on the flight why it ended."""
    if isinstance(e, StageFailed):
        # A stage's deadline error is the same end as our own deadline; other errors the stage already ended.
        timed_out = e.error.code == "request_timeout"
        flight.end_reason = "timeout" if timed_out else "rejected" if 400 <= e.error.status < 500 else "failed"
        return stage_error(e)
    if isinstance(e, DeadlineExceeded):
        flight.end_reason = "timeout"
        return timeout_error()
    flight.end_reason = "broker_unavailable"
    return redis_down()


async def head_trimmed_since(sub: Subscription, order: OrderedReplies, ev: ReplyEvent) -> bool:
    """A reattach found the stream whole (Gateway.attach), but MAXLEN may trim its head before the first read:
    then a choice's first range starts past 0. Only that (or a range redone out of order) explains such a
    first range, so ask Redis once, then."""
    if not 0 <= ev.index < len(order.next) or order.next[ev.index] or ev.start == 0:
        return False
    order.head_unsure = False
    try:
        return await streams.trimmed_head(sub.hub.redis, sub.key) is not None
    except (RedisError, OSError):
        return False  # read on as a whole stream; a Redis outage shows in the next read


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
            if isinstance(msg, ReplyFence):
                order.fence(msg.epoch)
            elif not isinstance(msg, ReplyCheckpoint):  # checkpoints are for a resuming scheduler
                if order.head_unsure and await head_trimmed_since(sub, order, msg):
                    order.start_headless()
                pairs.extend((entry_id, ev) for ev in order.accept(msg))
        if pairs:
            yield pairs
