"""The message contract as an AsyncAPI 3.0 document (docs/asyncapi.yaml), generated from the code.

FastStream builds the document from a broker that declares every stream the way the stages use it: the
tokenizer and detokenizer streams through the very `subscribe` their workers consume with
(shared/faststream_glue.py), the schedule stream, the reply streams and the dead letters as declared
subscribers and publishers. Message payloads are the JSON schemas of the msgspec structs of shared/messages.py
(FastStream derives schemas from pydantic handler arguments, which our raw-entry handlers do not have).
`rsinfer asyncapi` writes it; a test fails when the file and the code drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import yaml

from shared import faststream_glue
from shared.keys import DETOKENIZER_GROUP, SCHEDULER_GROUP, TOKENIZER_GROUP, Keys
from shared.messages import (
    VERSION,
    BatchWork,
    DetokenizeBatch,
    ReplyCheckpoint,
    ReplyError,
    ReplyEvent,
    ReplyFence,
    ScheduleJob,
    TokenizeJob,
    TokenizerAnswer,
    TokenizerQuery,
)
from shared.streams import Member

REF = "#/components/schemas/{name}"
ENTRY = ("Each entry has one field, `data`, whose value is this message as UTF-8 JSON (`kind` names it, `v` is "
         "its version); `redis-cli XRANGE` shows it as it is.")


@dataclass(frozen=True)
class Stream:
    channel: str
    address: str
    messages: tuple[type, ...]
    publishers: str
    consumer: str
    group: str | None = None
    by_faststream: bool = False  # consumed through shared/faststream_glue.py `subscribe`


def stream_catalogue(keys: Keys) -> list[Stream]:
    model, uid = "{model}", "uid"  # the reply key has the uid in braces (its hash tag): rsinfer:reply:{uid}
    return [
        Stream("tokenize", keys.tokenize(model), (TokenizeJob, TokenizerQuery), "api", "tokenizer workers (a query "
               "of /tokenize or /detokenize is answered on its reply stream, never forwarded)", TOKENIZER_GROUP, True),
        Stream("schedule", keys.schedule(model), (ScheduleJob,), "tokenizer", "scheduler workers (XREADGROUP only "
               "while their KV cache has room; an entry is acknowledged when its request ends)", SCHEDULER_GROUP),
        Stream("detokenize", keys.detokenize(model), (DetokenizeBatch,), "scheduler (one entry per engine step)",
               "detokenizer workers", DETOKENIZER_GROUP, True),
        Stream("reply", keys.reply(uid), (ReplyEvent, ReplyError, ReplyFence, ReplyCheckpoint, TokenizerAnswer),
               "detokenizer (text ranges); tokenizer (errors, answers to queries) and scheduler (errors); "
               "scheduler (fences when it takes a request over, checkpoints of the tokens so far, a prefill-only "
               "request's one range with its embedding or scores)",
               "the API process that serves the request (XREAD, no group; any API process when a client "
               "reattaches); a scheduler taking the request over. The braces are part of the key: the uid is the "
               "request's Redis Cluster hash tag, e.g. rsinfer:reply:{3f9a...}"),
        Stream("batch-work", keys.batch_work(), (BatchWork,), "api (POST /v1/batches)",
               "every API process's batch runner, several batches at once in turns across tenants (each tenant's "
               "batches on a stream of its own, rsinfer:batch-work:<tenant>; open mode's is this one); an entry "
               "idle for --batch-claim-idle-s is claimed by another runner; acknowledged and deleted when its "
               "batch ends", "batch"),
    ]


def build_broker(keys: Keys) -> Any:
    from faststream.redis import RedisBroker, StreamSub

    broker = RedisBroker("redis://redis:6379/0", apply_types=False, description="rsinfer's Redis")

    async def nothing(*_: Any) -> None:
        return None

    for s in stream_catalogue(keys):
        about = f"{ENTRY} Published by {s.publishers}; consumed by {s.consumer}."
        if s.by_faststream:
            assert s.group, f"{s.address} is read by FastStream, so in a group"
            what = faststream_glue.Subscription(s.address, Member(s.group, "{worker}"), 64, 10_000)
            faststream_glue.subscribe(broker, what, nothing, title=s.channel, description=about)
        else:
            sub = StreamSub(s.address, group=s.group, consumer="{worker}") if s.group else StreamSub(s.address)
            broker.subscriber(stream=sub, title=s.channel, description=about)(nothing)
        broker.publisher(stream=s.address, title=f"{s.channel}:publish", description=about)
    return broker


def asyncapi_document(keys: Keys | None = None) -> dict:
    """The AsyncAPI 3.0 document of every stream, with msgspec payload schemas."""
    from faststream.specification import AsyncAPI

    keys = keys or Keys()
    spec = AsyncAPI(build_broker(keys), title="rsinfer message contract", version=f"messages v{VERSION}",
                    description=__doc__.split("\n\n")[0], schema_version="3.0.0").to_specification()
    doc = spec.to_jsonable()
    catalogue = {s.channel: s for s in stream_catalogue(keys)}
    messages = [m for s in catalogue.values() for m in s.messages]
    refs, schemas = msgspec.json.schema_components(messages, ref_template=REF)
    by_type = dict(zip(messages, refs, strict=True))
    doc["components"]["schemas"] = schemas
    for name, message in doc["components"]["messages"].items():
        channel = name.split(":", 1)[0]
        types = catalogue[channel].messages
        payload = by_type[types[0]] if len(types) == 1 else {"oneOf": [by_type[t] for t in types]}
        message.pop("correlationId", None)  # FastStream's envelope header; our entries have none
        message.update(payload=payload, contentType="application/json")
    for section in (doc["channels"], doc["operations"], doc["components"]["messages"]):
        ordered = dict(sorted(section.items()))  # FastStream's order varies between runs
        section.clear()
        section.update(ordered)
    return doc


def asyncapi_yaml(keys: Keys | None = None) -> str:
    return yaml.safe_dump(asyncapi_document(keys), sort_keys=False, allow_unicode=True, width=110)
