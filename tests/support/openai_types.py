"""Objects and events of the Responses API checked against the official `openai` SDK's types, strictly: the SDK's
models accept fields they do not declare (pydantic's extra="allow"), so a misspelt or invented field would pass
`model_validate` alone; here any such field, at any depth, fails the check."""

from __future__ import annotations

from typing import Any

from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

EVENTS: TypeAdapter = TypeAdapter(ResponseStreamEvent)
# Fields OpenAI's own API returns that the SDK's models leave undeclared: `store` of a response.
OPENAI_EXTRA = {("Response", "store")}


def no_extra(value: Any, where: str = "") -> None:
    """Fail on any field the SDK's models do not declare."""
    if isinstance(value, BaseModel):
        extra = {k for k in value.model_extra or {} if (type(value).__name__, k) not in OPENAI_EXTRA}
        assert not extra, f"{where or type(value).__name__}: fields the SDK does not know: {sorted(extra)}"
        for name in type(value).model_fields:
            no_extra(getattr(value, name), f"{where}.{name}")
    elif isinstance(value, list | tuple):
        for k, v in enumerate(value):
            no_extra(v, f"{where}[{k}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            no_extra(v, f"{where}.{k}")


def strict_event(event: dict | BaseModel) -> Any:
    """A stream event as the SDK's ResponseStreamEvent (its `type` picks the model), with nothing undeclared."""
    parsed = EVENTS.validate_python(event.model_dump(by_alias=True, exclude_unset=True)
                                    if isinstance(event, BaseModel) else event)
    no_extra(parsed, parsed.type)
    if hasattr(parsed, "response"):
        strict_response(parsed.response)
    return parsed


def strict_response(obj: dict | BaseModel) -> Response:
    """A response object as the SDK's Response, with nothing undeclared."""
    parsed = Response.model_validate(obj.model_dump(by_alias=True, exclude_unset=True)
                                     if isinstance(obj, BaseModel) else obj)
    no_extra(parsed, "response")
    return parsed
