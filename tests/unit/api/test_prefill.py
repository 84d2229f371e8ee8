"""The prefill-only bodies (services/api/pooling_api/prefill.py): their inputs as jobs, their limits and refusals naming
the field, and their answers from the engine's reply events."""

from __future__ import annotations

import base64
import itertools

import numpy as np
import pytest
from pydantic import ValidationError

from services.api.answer.limits import Limits
from services.api.answer.schemas.field_checks import BadRequest
from services.api.answer.schemas.submission import Stamp
from services.api.errors import ApiError
from services.api.pooling_api.prefill import EmbeddingRequest, ScoreRequest
from shared.messages import ReplyEvent
from shared.settings import ApiSettings

LIMITS = Limits(ApiSettings(max_pooling_inputs=4, max_pooling_input_tokens=6, max_score_labels=3,
                            embedding_pooling="mean"))
INFO = {"vocab_size": 100, "hidden_size": 8, "matryoshka_dimensions": None}


def stamp(info: dict | None = None) -> Stamp:
    uids = (f"u{k}" for k in itertools.count())
    return Stamp("m", "pod", 60.0, lambda: next(uids), INFO if info is None else info)


def submitted(body, info: dict | None = None):
    params = body.checked(LIMITS)
    return params, body.budget(params), body.submission(params, stamp(info))


@pytest.mark.parametrize(("given", "prompts"), [
    ("one", [("one", None)]), (["a", "b"], [("a", None), ("b", None)]), ([1, 2, 3], [(None, [1, 2, 3])]),
    ([[1], [2, 3]], [(None, [1]), (None, [2, 3])])])
def test_every_input_shape_is_one_job_each(given, prompts):
    params, budget, sub = submitted(EmbeddingRequest.model_validate({"model": "m", "input": given}))
    assert [(j.prompt, j.input_ids) for j in sub.jobs] == prompts
    assert budget.prompts == len(prompts) and budget.prompts_param == "input" and budget.max_tokens == 1
    p = params.pooling
    assert (p.task, p.pooling, p.normalize, p.max_input_tokens, p.param) == ("embed", "mean", True, 6, "input")
    assert sub.record["kind"] == "embedding" and sub.label == "embedding" and not sub.stream


def test_user_is_kept_in_the_record():
    _, _, sub = submitted(EmbeddingRequest.model_validate({"model": "m", "input": "x", "user": "alice"}))
    assert sub.record["user"] == "alice"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": ""}, "input", "empty string"), ({"input": []}, "input", "must not be empty"),
    ({"input": ["a"] * 5}, "input", "at most 4"), ({"input": [[1] * 7]}, "input", "at most 6"),
    ({"input": [[]]}, "input", "empty list"), ({"input": [-1]}, "input", "negative"),
    ({"input": "x", "user": "u" * 10_000}, "user", "characters")])
def test_embedding_inputs_past_a_limit_are_refused_by_name(body, param, words):
    with pytest.raises((BadRequest, ApiError)) as e:
        submitted(EmbeddingRequest.model_validate({"model": "m", **body}))
    assert e.value.param == param and words in str(e.value)


def test_dimensions_are_checked_against_the_model():
    body = {"model": "m", "input": "x", "dimensions": 4}
    with pytest.raises(BadRequest, match="does not support truncating") as e:
        submitted(EmbeddingRequest.model_validate(body))
    assert e.value.param == "dimensions"
    params, _, _ = submitted(EmbeddingRequest.model_validate(body), {**INFO, "matryoshka_dimensions": [4]})
    assert params.pooling.dimensions == 4
    with pytest.raises(BadRequest, match="not one this model allows"):
        submitted(EmbeddingRequest.model_validate({**body, "dimensions": 5}), {**INFO, "matryoshka_dimensions": [4]})
    submitted(EmbeddingRequest.model_validate({**body, "dimensions": 8}))  # its own size
    submitted(EmbeddingRequest.model_validate(body), {})  # no scheduler reported yet: the engine checks
    with pytest.raises(ValidationError):
        EmbeddingRequest.model_validate({**body, "encoding_format": "int8"})
    with pytest.raises(ValidationError):
        EmbeddingRequest.model_validate({"model": "m", "input": "x", "stream": True})


def test_score_prompts_join_query_and_items_as_sglang_does():
    base = {"query": "Q", "items": ["a", "b"], "label_token_ids": [1, 2]}
    _, _, sub = submitted(ScoreRequest.model_validate(base))
    assert [j.prompt for j in sub.jobs] == ["Qa", "Qb"]
    _, _, sub = submitted(ScoreRequest.model_validate({**base, "item_first": True, "items": "a"}))
    assert [j.prompt for j in sub.jobs] == ["aQ"]
    params, budget, sub = submitted(ScoreRequest.model_validate(
        {"query": [1, 2], "items": [[3], [4, 5]], "label_token_ids": [7], "apply_softmax": True, "item_first": True}))
    assert [j.input_ids for j in sub.jobs] == [[3, 1, 2], [4, 5, 1, 2]]
    p = params.pooling
    assert (p.task, p.label_token_ids, p.apply_softmax, p.param) == ("score", [7], True, "items")
    assert budget.prompts_param == "items" and sub.record["kind"] == "score"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"label_token_ids": [1, 100]}, "label_token_ids", "Token ID 100"),
    ({"label_token_ids": [1, 2, 3, 4]}, "label_token_ids", "at most 3"),
    ({"query": [1]}, "items", "both be text or both be token ids"),
    ({"items": ["a"] * 5}, "items", "at most 4"),
    ({"query": [1, 2, 3, 4], "items": [[1, 2, 3]]}, "items", "at most 6")])
def test_score_refusals_name_the_field(body, param, words):
    with pytest.raises(BadRequest) as e:
        submitted(ScoreRequest.model_validate({"query": "q", "items": ["a"], "label_token_ids": [1], **body}))
    assert e.value.param == param and words in str(e.value)


def test_answers_from_the_engine_events():
    _, _, sub = submitted(EmbeddingRequest.model_validate({"model": "m", "input": ["a", "b"]}))
    vectors = [np.asarray([0.1, -2.0], "<f4"), np.asarray([3.5, 0.0], "<f4")]
    events = [ReplyEvent(start=0, end=0, text="", prompt_tokens=3 + k, index=k, finish_reason="stop",
                         embedding=base64.b64encode(v.tobytes()).decode()) for k, v in enumerate(vectors)]
    sub.fmt.add(events[::-1])

    class Counts:
        prompt_tokens, completion_tokens, cached_tokens = 7, 0, 0

    body = sub.fmt.response(Counts())
    assert [d["embedding"] for d in body["data"]] == [v.tolist() for v in vectors]
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7} and body["object"] == "list"
    _, _, sub = submitted(EmbeddingRequest.model_validate({"model": "m", "input": "a", "encoding_format": "base64"}))
    sub.fmt.add(events[:1])
    assert sub.fmt.response(Counts())["data"][0]["embedding"] == events[0].embedding
    _, _, sub = submitted(ScoreRequest.model_validate({"query": "q", "items": ["a", "b"], "label_token_ids": [1]}))
    sub.fmt.add([ReplyEvent(start=0, end=0, text="", prompt_tokens=1, index=1, finish_reason="stop", scores=[0.25])])
    with pytest.raises(Exception, match="aborted"):  # one item never computed
        sub.fmt.response(Counts())
    sub.fmt.add([ReplyEvent(start=0, end=0, text="", prompt_tokens=1, index=0, finish_reason="stop", scores=[0.5])])
    body = sub.fmt.response(Counts())
    assert body["scores"] == [[0.5], [0.25]] and body["object"] == "scoring" and body["model"] == "m"


@pytest.mark.parametrize(("settings", "info", "chosen"), [
    ({}, {}, ("last", True)),  # auto, and a model that says nothing
    ({}, {"embedding_pooling": "mean", "embedding_normalize": False}, ("mean", False)),  # as its config says
    ({"embedding_pooling": "last", "embedding_normalize": True}, {"embedding_pooling": "mean",
                                                                  "embedding_normalize": False}, ("last", True))])
def test_pooling_follows_the_model_unless_set(settings, info, chosen):
    limits = Limits(ApiSettings(**settings))
    body = EmbeddingRequest.model_validate({"model": "m", "input": "x"})
    params = body.checked(limits)
    [job] = body.submission(params, stamp({**INFO, **info})).jobs
    assert (job.params.pooling.pooling, job.params.pooling.normalize) == chosen
