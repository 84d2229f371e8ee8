"""SGLang-style `POST /generate`: text or input_ids in; text, output_ids and meta_info out."""

from __future__ import annotations

import orjson
from fastapi import Request

from services.api.formats import Choice, generate_body
from services.api.service import (
    DONE,
    ENDED_EARLY,
    ApiService,
    Replies,
    chain_replies,
    ended_early,
    sse_event,
    until_disconnect,
)
from shared.messages import ReplyEvent, TokenizeJob


async def generate(svc: ApiService, request: Request, job: TokenizeJob, stream: bool):
    flight = await svc.open(job, {"kind": "generate", "n": 1}, stream)
    choice, ids = Choice(), []

    def body() -> dict:
        return generate_body(job.uid, choice, ids, flight.order.prompt_tokens)

    def add(events: list[ReplyEvent]) -> None:
        for ev in events:
            choice.text.append(ev.text)
            ids.extend(ev.ids)
            choice.finish_reason = ev.finish_reason or choice.finish_reason

    async def chunks(first: list[tuple[str, ReplyEvent]], rest: Replies):
        try:
            async for pairs in chain_replies(first, rest):
                if pairs:
                    add([ev for _, ev in pairs])
                    yield sse_event(orjson.dumps(body()))
        except ENDED_EARLY as e:
            yield sse_event(orjson.dumps(ended_early(flight, e).body()))
        yield DONE

    if stream:
        return await svc.start_stream(request, flight, chunks,
                                      lambda reason: svc.finish(flight, job.model, "generate", reason))

    async def collect() -> dict:
        try:
            async for _, evs in flight.events():
                add(evs)
        except ENDED_EARLY as e:
            raise ended_early(flight, e) from None
        return body()

    try:
        _, result = await until_disconnect(request, collect())
        return result
    finally:
        await svc.finish(flight, job.model, "generate")
