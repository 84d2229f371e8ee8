"""The jobs on the wire (shared/messages.py): the fields both declare once, in `RequestJob`, and entries written
before that decode to the same jobs."""

from __future__ import annotations

import json

import msgspec
import pytest

from shared.messages import RequestJob, SamplingParams, ScheduleJob, TokenizeJob, decode, encode

# As written before the shared struct (the same fields, another key order)
OLD_TOKENIZE = (b'{"kind":"tokenize","uid":"u","model":"m","pod":"p","created_at":1.5,"deadline":9.0,"params":'
                b'{"max_tokens":5},"messages":[{"role":"user","content":"hi"}],"background":true,"priority":2,'
                b'"suffix":"s","trace":"t"}')
OLD_SCHEDULE = (b'{"kind":"schedule","uid":"u","model":"m","pod":"p","created_at":1.5,"deadline":9.0,"params":'
                b'{"max_tokens":5},"input_ids":[1,2],"background":true,"priority":1,"trace":"t"}')


@pytest.mark.parametrize(("raw", "typ"), [(OLD_TOKENIZE, TokenizeJob), (OLD_SCHEDULE, ScheduleJob)])
def test_an_entry_written_before_decodes_and_encodes_to_the_same_json(raw, typ):
    job = decode(raw, typ)
    assert isinstance(job, RequestJob) and job.uid == "u" and job.background and job.trace == "t"
    assert json.loads(encode(job)) == json.loads(raw)


def test_what_both_jobs_carry_is_declared_once():
    shared = set(RequestJob.__struct_fields__)
    assert {"uid", "model", "pod", "created_at", "deadline", "params", "background", "priority", "trace",
            "adapter", "tenant", "weight", "cache_salt", "slo_ttft_ms", "slo_tpot_ms", "v"} == shared
    for typ in (TokenizeJob, ScheduleJob):
        assert shared <= set(typ.__struct_fields__) and not shared & set(typ.__annotations__)
    assert RequestJob.__struct_config__.tag is None  # not a message of its own


def test_jobs_are_built_with_keywords_and_a_schedule_job_needs_its_tokens():
    common = dict(uid="u", model="m", pod="p", created_at=0.0, deadline=1.0, params=SamplingParams())
    assert ScheduleJob(**common, input_ids=[1]).input_ids == [1]
    assert TokenizeJob(**common).input_ids is None
    with pytest.raises(TypeError):
        ScheduleJob(**common)
    with pytest.raises(msgspec.ValidationError):
        decode(OLD_SCHEDULE.replace(b',"input_ids":[1,2]', b""), ScheduleJob)
