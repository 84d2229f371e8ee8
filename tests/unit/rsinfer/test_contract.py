"""docs/asyncapi.yaml is the message contract generated from the code: it must not drift, must be valid
AsyncAPI 3.0, and must name every stage stream and the reply stream with the message each carries."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

from rsinfer.contract import asyncapi_document, asyncapi_yaml
from shared.keys import Keys
from tests.unit.shared import asyncapi_specs

pytestmark = pytest.mark.timeout(180)
DOC = Path(__file__).resolve().parents[3] / "docs" / "asyncapi.yaml"


def test_the_committed_document_is_what_the_code_generates():
    assert DOC.read_text() == asyncapi_yaml(), "regenerate it: rsinfer asyncapi --output docs/asyncapi.yaml"


def test_the_document_is_valid_asyncapi_3():
    doc = yaml.safe_load(DOC.read_text())
    jsonschema.Draft7Validator(asyncapi_specs.schema(doc["asyncapi"])).validate(doc)


def test_every_stream_is_documented_with_its_group_and_message():
    keys, doc = Keys(), asyncapi_document()
    channels = doc["channels"]
    by_address = {(c["address"], c["bindings"]["redis"]["method"]): c for c in channels.values()}
    for stage, group in (("tokenizer", "tokenizer"), ("scheduler", "scheduler"), ("detokenizer", "detokenizer")):
        address = keys.stage_stream(stage, "{model}")
        assert by_address[(address, "xreadgroup")]["bindings"]["redis"]["groupName"] == group
        assert (address, "xadd") in by_address
    assert (keys.reply("uid"), "xread") in by_address and (keys.reply("uid"), "xadd") in by_address
    kinds = {}
    for name, message in doc["components"]["messages"].items():
        refs = [message["payload"]] if "$ref" in message["payload"] else message["payload"]["oneOf"]
        kinds[name.split(":")[0]] = {r["$ref"].rsplit("/", 1)[1] for r in refs}
    assert kinds == {"tokenize": {"TokenizeJob", "TokenizerQuery"}, "schedule": {"ScheduleJob"},
                     "detokenize": {"DetokenizeBatch"},
                     "reply": {"ReplyEvent", "ReplyError", "ReplyFence", "ReplyCheckpoint", "TokenizerAnswer"},
                     "batch-work": {"BatchWork"}}
    assert by_address[(keys.batch_work(), "xreadgroup")]["bindings"]["redis"]["groupName"] == "batch"
    tokenize = doc["components"]["schemas"]["TokenizeJob"]
    assert tokenize["properties"]["kind"] == {"enum": ["tokenize"]} and "uid" in tokenize["required"]
