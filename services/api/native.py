"""SGLang-style `POST /generate`: text or input_ids in; text, output_ids and meta_info out."""

from __future__ import annotations

import orjson
from fastapi import Request

from services.api.formats import Choice, generate_body
from services.api.service import (
    DONE,
    ENDED_EARLY,
    ApiService,
    OwnedEventSource,
    ended_early,
    sse_event,
    until_disconnect,
)
from shared.messages import TokenizeJob


async def generate(svc: ApiService, request: Request, job: TokenizeJob, stream: bool):
    flight = await svc.open(job, {"kind": "generate", "n": 1})
    choice, ids = Choice(), []

    def body() -> dict:
        return generate_body(job.uid, choice, ids, flight.order.prompt_tokens)

    async def events():
        async for _, evs in flight.events():
            for ev in evs:
                choice.text.append(ev.text)
                ids.extend(ev.ids)
                choice.finish_reason = ev.finish_reason or choice.finish_reason
            yield

    async def chunks():
        try:
            async for _ in events():
                yield sse_event(orjson.dumps(body()))
        except ENDED_EARLY as e:
            yield sse_event(orjson.dumps(ended_early(flight, e).body()))
        yield DONE

    if stream:
        return OwnedEventSource(chunks(), on_close=lambda reason: svc.finish(flight, job.model, "generate", reason),
                                send_timeout=svc.settings.slow_client_timeout_s)

    async def collect() -> dict:
        try:
            async for _ in events():
                pass
        except ENDED_EARLY as e:
            raise ended_early(flight, e) from None
        return body()

    try:
        _, result = await until_disconnect(request, collect())
        return result
    finally:
        await svc.finish(flight, job.model, "generate")
