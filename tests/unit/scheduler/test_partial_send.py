"""A pipeline of the scheduler's effects that Redis applies in part (a full Redis refuses some writes, not others):
only what failed is sent again, so no step's deltas reach the detokenize stream twice. Against a real
redis-server, one write made to fail by the key's type."""

from __future__ import annotations

import pytest
from redis.exceptions import ResponseError

from services.scheduler.effects import Ack, Publish, RecordRunning, raise_first_error, unapplied
from shared.keys import Keys
from shared.messages import TokenDelta
from shared.redis_conn import connect
from tests.unit.scheduler.test_detokenize_cap import writer_for

pytestmark = pytest.mark.timeout(60)


async def test_only_the_effects_whose_commands_failed_are_sent_again(redis_server):
    keys, redis = Keys("partial1"), connect(redis_server.url)
    try:
        writer = writer_for(redis, keys, budget_mb=16)
        step = Publish([TokenDelta(uid="u1", start=0, ids=[5], prompt_tokens=1)], 1)
        effects = [RecordRunning("u1", "1-0", 16, None), step, Ack(["1-0"]),
                   Publish([TokenDelta(uid="u2", start=0, ids=[6], prompt_tokens=1)], 1)]
        await redis.set(keys.detokenize("m"), "not a stream")  # every XADD to it fails
        async with redis.pipeline(transaction=False) as pipe:
            spans = writer.apply(pipe, effects)
            results = await pipe.execute(raise_on_error=False)
        again = unapplied(effects, spans, results)
        assert again == [step, effects[3]]  # the record and the acknowledgement were applied
        assert await redis.hget(keys.request("u1"), "scheduler") == b"s1"
        with pytest.raises(ResponseError):
            raise_first_error(results)

        await redis.delete(keys.detokenize("m"))
        async with redis.pipeline(transaction=False) as pipe:
            spans = writer.apply(pipe, again)
            results = await pipe.execute(raise_on_error=False)
        assert unapplied(again, spans, results) == []
        assert await redis.xlen(keys.detokenize("m")) == 2  # each step once
    finally:
        await redis.aclose()
