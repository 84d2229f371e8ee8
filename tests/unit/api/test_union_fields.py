"""A request field that takes several shapes (a union: `prompt` is a string, a list of strings, a list of token
ids or a list of lists of them) refuses a value of none of them with one sentence naming the field and the shapes
(services/api/answer/schemas/field_checks.py `one_of`), not pydantic's error per member of the union ("prompt.str: Input
should be a valid string"), which named a shape the client never meant."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types
import typing

import pytest
from pydantic import BaseModel, ValidationError, create_model

import services.api
from services.api.answer.schemas.chat import ChatCompletionRequest
from services.api.answer.schemas.completions import CompletionRequest
from services.api.errors import as_api_error
from services.api.pooling_api.prefill import EmbeddingRequest, ScoreRequest
from services.api.responses_api.response_schemas import ResponseRequest

PROMPTS = "a string, a list of strings, a list of token ids or a list of lists of token ids"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def _bodies() -> list[type[BaseModel]]:
    """Every pydantic model of the API's modules (its packages' too, services/api/answer/schemas/): the request bodies
    and what they nest."""
    found = {}
    for info in pkgutil.walk_packages(services.api.__path__, "services.api."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseModel) and cls.__module__.startswith("services.api."):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return [found[k] for k in sorted(found)]


def _members(annotation: object) -> list[object]:
    """The types a field's annotation unites, None left out."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


UNION_FIELDS = [(cls, name) for cls in _bodies() for name, field in cls.model_fields.items()
                if len(_members(field.annotation)) > 1]


def _shapes(cls: type[BaseModel], name: str) -> str | None:
    return next((m.func.shapes for m in cls.model_fields[name].metadata if hasattr(getattr(m, "func", None),
                                                                                   "shapes")), None)


def refusal(cls: type[BaseModel], body: dict) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as caught:
        cls.model_validate(body)
    error = as_api_error(caught.value)
    assert error is not None and error.status == 400
    return error.message, error.param


def test_the_bodies_have_union_fields():
    names = {f"{cls.__name__}.{name}" for cls, name in UNION_FIELDS}
    assert {"CompletionRequest.prompt", "EmbeddingRequest.input", "Message.content", "ResponseRequest.input",
            "ChatCompletionRequest.tool_choice"} <= names, names


@pytest.mark.parametrize(("cls", "name"), UNION_FIELDS, ids=[f"{c.__name__}.{n}" for c, n in UNION_FIELDS])
def test_every_union_field_refuses_in_one_sentence(cls, name):
    """A value of none of its shapes (a number) is refused with "`<field>` must be <shapes>", one sentence."""
    shapes = _shapes(cls, name)
    assert shapes, f"{cls.__name__}.{name} is a union without one_of(...): its refusal would be pydantic's per member"
    field = cls.model_fields[name]
    probe = create_model("Probe", **{name: (field.annotation, field)})
    message, param = refusal(probe, {field.alias or name: 1.5})
    assert message == f"`{field.alias or name}` must be {shapes}" and param == (field.alias or name)
    assert "\n" not in message and "Input should" not in message


@pytest.mark.parametrize(("cls", "body", "message", "param"), [
    (CompletionRequest, {"model": "m", "prompt": ["Once upon", [15, 16, 17]]}, f"`prompt` must be {PROMPTS}",
     "prompt"),
    (EmbeddingRequest, {"model": "m", "input": ["Once upon", [15, 16, 17]]}, f"`input` must be {PROMPTS}", "input"),
    (ChatCompletionRequest, {**CHAT, "messages": [{"role": "user", "content": 5}]},
     '`messages.0.content` must be a string or a list of content parts ({"type": "text", "text": ...})',
     "messages"),
    (ChatCompletionRequest, {**CHAT, "stop": ["a", 3]}, "`stop` must be a string or a list of strings", "stop"),
    (ChatCompletionRequest, {**CHAT, "tool_choice": "sometimes"},
     '`tool_choice` must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
     "tool_choice"),
    (ResponseRequest, {"model": "m", "input": 3}, "`input` must be a string or a list of input items (objects)",
     "input"),
    (ScoreRequest, {"query": {"a": 1}}, "`query` must be a string or a list of token ids", "query"),
])
def test_the_sentences_name_the_field_where_it_is(cls, body, message, param):
    assert refusal(cls, body) == (message, param)


def test_a_value_of_the_right_shape_keeps_its_own_checks():
    """A union member's own refusal (an empty stop string) is still what the client reads."""
    message, param = refusal(ChatCompletionRequest, {**CHAT, "stop": ["a", ""]})
    assert "non-empty" in message and param == "stop"
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[15, 16], [17]]}).prompts() == [
        (None, [15, 16]), (None, [17])]
