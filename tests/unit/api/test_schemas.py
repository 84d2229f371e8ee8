"""Request bodies -> SamplingParams and what they submit; what we cannot honour is refused, not ignored."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.api.answer.schemas.chat import ChatCompletionRequest
from services.api.answer.schemas.completions import CompletionRequest, GenerateRequest
from services.api.answer.schemas.field_checks import BadRequest
from services.api.answer.schemas.submission import Stamp

MSG = [{"role": "user", "content": "hi"}]


def test_every_sampling_field_travels():
    body = ChatCompletionRequest.model_validate(dict(
        model="m", messages=MSG, max_completion_tokens=7, temperature=0.5, top_p=0.9, n=2, stop="END", seed=3,
        presence_penalty=0.1, frequency_penalty=0.2, top_k=5, min_p=0.05, ignore_eos=True,
        repetition_penalty=1.1, min_tokens=2, stop_token_ids=[4], logprobs=True, top_logprobs=3))
    p = body.params()
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.stop, p.seed) == (7, 0.5, 0.9, 2, ["END"], 3)
    assert (p.presence_penalty, p.frequency_penalty, p.top_k, p.min_p) == (0.1, 0.2, 5, 0.05)
    assert (p.ignore_eos, p.repetition_penalty, p.min_tokens, p.stop_token_ids) == (True, 1.1, 2, [4])
    assert p.logprobs and p.top_logprobs == 3


def test_content_parts_and_developer_role():
    body = ChatCompletionRequest.model_validate(dict(model="m", messages=[
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]}]))
    msg = body.chat_messages()[0]
    assert (msg.role, msg.content) == ("system", "be brief")


@pytest.mark.parametrize("extra", [{"tools": [{"type": "function"}]}, {"response_format": {"type": "yaml"}},
                                   {"regex": "a", "guided_choice": ["b"]}, {"guided_choice": []},
                                   {"response_format": {"type": "json_schema"}},
                                   {"top_logprobs": 2}, {"stop": [""]}, {"n": 0}, {"max_tokens": 0}])
def test_refused(extra):
    with pytest.raises((ValidationError, BadRequest)):
        ChatCompletionRequest.model_validate(dict(model="m", messages=MSG, **extra)).params()


def test_completion_prompts():
    assert CompletionRequest(model="m", prompt="x").prompts() == [("x", None)]
    assert CompletionRequest(model="m", prompt=[1, 2]).prompts() == [(None, [1, 2])]
    assert CompletionRequest(model="m", prompt=[[1, 2], [3]]).prompts() == [(None, [1, 2]), (None, [3])]
    assert CompletionRequest(model="m", prompt=["a", "b"]).prompts() == [("a", None), ("b", None)]
    with pytest.raises(BadRequest):
        CompletionRequest(model="m", prompt=[]).prompts()
    with pytest.raises(ValidationError):  # best_of below n
        CompletionRequest(model="m", prompt="x", n=3, best_of=2)
    p = CompletionRequest(model="m", prompt="x", n=2, best_of=4, echo=True, logprobs=2,
                          logit_bias={"7": -100}).params()
    assert (p.n, p.logprobs, p.echo, p.prompt_logprobs, p.logit_bias) == (4, True, True, 2, {7: -100.0})
    assert CompletionRequest(model="m", prompt="x").params().max_tokens == 16


def test_generate_sampling_params():
    g = GenerateRequest(text="hi", sampling_params={"max_new_tokens": 9, "temperature": 0})
    assert g.params().max_tokens == 9 and g.params().greedy


def test_generate_refuses_several_choices():
    """/generate answers with one text: n > 1 would be generated and its choices run together into it."""
    with pytest.raises(BadRequest) as e:
        GenerateRequest(text="hi", sampling_params={"n": 2}).params()
    assert e.value.param == "sampling_params.n"
    assert GenerateRequest(text="hi", sampling_params={"n": 1}).params().n == 1


def test_structured_output_fields_become_one_constraint():
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}}
    g = ChatCompletionRequest.model_validate(dict(model="m", messages=MSG, response_format=fmt)).params().guided
    assert (g.kind, g.spec, g.param) == ("json_schema", '{"type":"object"}', "response_format")
    g = CompletionRequest.model_validate(dict(model="m", prompt="x", json='{"type": "object"}')).params().guided
    assert (g.kind, g.param) == ("json_schema", "json")
    g = GenerateRequest(text="hi", sampling_params={"json_schema": '{"type": "object"}'}).params().guided
    assert g.kind == "json_schema"
    g = ChatCompletionRequest.model_validate(dict(model="m", messages=MSG, guided_choice=["a", "b"])).params().guided
    assert (g.kind, g.spec) == ("choice", '["a", "b"]')


def stamp(model: str = "m", timeout_s: float = 600.0) -> Stamp:
    uids = iter(["u1", "u2", "u3"])
    return Stamp(model, "pod-1", timeout_s, lambda: next(uids), {"reasoning_parser": "qwen3"})


def test_a_chat_body_builds_its_job_format_and_record():
    body = ChatCompletionRequest.model_validate(dict(model="m", messages=MSG, timeout=5, user="me", stream=True,
                                                     stream_options={"include_usage": True}))
    sub = body.submission(body.params(), stamp())
    [job] = sub.jobs
    assert (job.uid, job.pod, job.model) == ("u1", "pod-1", "m")
    assert job.deadline == pytest.approx(job.created_at + 5) and job.messages[0].content == "hi"
    assert (sub.fmt.rid, sub.stream, sub.label) == ("chatcmpl-u1", True, "stream")
    assert sub.record == {"kind": "chat", "n": 1, "rid": "chatcmpl-u1", "created": int(job.created_at),
                            "include_usage": 1, "logprobs": 0, "user": "me", "parse": '{"reasoning":"qwen3"}'}


def test_a_timeout_is_capped_and_each_prompt_is_a_job():
    body = CompletionRequest(model="m", prompt=["a", "b"], n=2, timeout=900, echo=True)
    sub = body.submission(body.params(), stamp(timeout_s=60))
    assert [j.uid for j in sub.jobs] == ["u1", "u2"] and [j.prompt for j in sub.jobs] == ["a", "b"]
    assert all(j.deadline == pytest.approx(j.created_at + 60) for j in sub.jobs)
    assert (sub.fmt.rid, len(sub.fmt.choices), sub.label) == ("cmpl-u1", 4, "full")
    assert sub.record["echo"] == "1" and sub.record["n"] == 2 and sub.record["kind"] == "completion"


@pytest.mark.parametrize(("fmt", "effort", "param"), [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, None, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, None, "response_format.json_schema.name"),
    (None, "extreme", "reasoning_effort"),
])
def test_chat_validates_as_the_responses_api_does(fmt, effort, param):
    """A json_schema needs its `name` and an effort is one of OpenAI's, on chat as on the Responses API."""
    with pytest.raises((BadRequest, ValidationError)) as e:
        ChatCompletionRequest.model_validate(dict(model="m", messages=MSG, response_format=fmt,
                                                  reasoning_effort=effort)).params()
    err = e.value if isinstance(e.value, BadRequest) else e.value.errors()[0]["ctx"]["error"]
    assert err.param == param


def test_a_reasoning_effort_reaches_the_template_of_a_model_that_reasons():
    body = ChatCompletionRequest.model_validate(dict(model="m", messages=MSG, reasoning_effort="low"))
    stamp = Stamp("m", "pod", 60.0, lambda: "u1", {"reasoning_parser": "qwen3"})
    assert body.submission(body.params(), stamp).jobs[0].chat_template_kwargs == {"reasoning_effort": "low"}
    with pytest.raises(BadRequest) as e:  # a model whose template does not reason
        body.submission(body.params(), Stamp("m", "pod", 60.0, lambda: "u1", {}))
    assert e.value.param == "reasoning_effort"
    kwargs = dict(model="m", messages=MSG, reasoning_effort="none", chat_template_kwargs={"reasoning_effort": "x"})
    body = ChatCompletionRequest.model_validate(kwargs)  # "none" asks for nothing; the kwargs' own value wins
    assert body.submission(body.params(), Stamp("m", "pod", 60.0, lambda: "u1", {})).jobs[0].chat_template_kwargs == \
        {"reasoning_effort": "x"}
