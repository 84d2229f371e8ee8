"""FastStream as the tokenizer's and detokenizer's consume loop, and everything that has to know it: the two
subscribers of a stage stream, our parser and decoder (the raw entries, no JSON work), and a patch of one of its
constants.

FastStream only reads here (XREADGROUP for new entries, XAUTOCLAIM for a peer's idle ones); every write and
every acknowledgement goes through shared/streams.py, in the pipeline that writes a stage's output. FastStream
creates groups at `$`, so the worker creates them at `0` first (shared/consumer_group.py
`GroupConsumer.ensure_group`) and FastStream finds them there. Why the scheduler does not read through it:
docs/design.md, "Measured facts behind the design".
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from shared.streams import as_str

if TYPE_CHECKING:
    from faststream.redis import RedisBroker


Handler = Callable[[list[tuple[str, dict[bytes, bytes]]], bool], Awaitable[None]]
READ_BLOCK_MS = 1000
CLAIM_POLL_MS = 500  # claims are cheap; polling often is what makes a hand-back "at once"
READ_RETRY_S = 0.5


def _retry_failed_reads_sooner() -> None:
    """FastStream's subscribers wait 5 s after a read that failed before the next: every Redis outage, and every
    cluster failover (a replica takes over within seconds), would leave the tokenizer and
    detokenizer idle 5 s longer than the rest of the pipeline, whose loops retry within 2 s."""
    from faststream.redis.subscriber.usecases import basic, stream_subscriber

    for module in (basic, stream_subscriber):
        if hasattr(module, "CONSUME_ERROR_BACKOFF_SECONDS"):
            module.CONSUME_ERROR_BACKOFF_SECONDS = READ_RETRY_S


def subscribe(broker: RedisBroker, key: str, group: str, consumer: str, batch_size: int, claim_idle_ms: int,
              handler: Handler, title: str, description: str) -> list[Any]:
    """Two FastStream subscribers of one stream in one group: new entries in batches of up to `batch_size`,
    and entries idle past `claim_idle_ms` in other consumers' hands, one at a time. Both call
    `handler(entries, claimed)` with the raw entries [(entry_id, fields)]; nothing is acknowledged for it.
    The broker should have `apply_types=False`: the handlers take the entries as they come (our parser puts
    them in the message body), with no dependency injection or JSON work per read."""
    from faststream import AckPolicy
    from faststream.redis import StreamSub

    _retry_failed_reads_sooner()

    async def fresh(entries: list[tuple[str, dict[bytes, bytes]]]) -> None:
        await handler(entries, False)

    async def claimed(entries: list[tuple[str, dict[bytes, bytes]]]) -> None:
        await handler(entries, True)

    class Sub(StreamSub):
        def add_prefix(self, prefix: str) -> Sub:
            # FastStream asks for the prefixed stream on every read, and builds it by deepcopy (~50 µs).
            return super().add_prefix(prefix) if prefix else self

    reader = Sub(key, group=group, consumer=consumer, batch=True, max_records=batch_size,
                 polling_interval=READ_BLOCK_MS)
    claimer = Sub(key, group=group, consumer=consumer, min_idle_time=claim_idle_ms, polling_interval=CLAIM_POLL_MS)
    subscribers = [broker.subscriber(stream=reader, parser=_entries, decoder=_body, ack_policy=AckPolicy.MANUAL,
                                     title=title, description=description),
                   broker.subscriber(stream=claimer, parser=_entries, decoder=_body, ack_policy=AckPolicy.MANUAL,
                                     include_in_schema=False)]
    for sub, fn in zip(subscribers, (fresh, claimed), strict=True):
        sub(fn)
    return subscribers


async def _entries(msg: Any, _original: Any) -> Any:
    """FastStream's parser minus its JSON work: the body is the raw entries (decoding them is ours)."""
    from faststream.redis.message import RedisBatchStreamMessage, RedisStreamMessage

    ids, data = msg["message_ids"], msg["data"]
    if msg["type"] == "bstream":
        return RedisBatchStreamMessage(raw_message=msg, body=[(as_str(i), f) for i, f in zip(ids, data, strict=True)],
                                       consumer=None, group=None)
    return RedisStreamMessage(raw_message=msg, body=[(as_str(ids[0]), data)], consumer=None, group=None)


async def _body(msg: Any, _original: Any) -> Any:
    return msg.body
