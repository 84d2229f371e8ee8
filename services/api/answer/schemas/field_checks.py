"""What every request body's fields share (services/api/answer/schemas/, services/api/pooling_api/prefill.py,
services/api/responses_api/response_schemas.py): the refusals (`BadRequest`, a union's `ShapeError`; both in
services/api/errors.py), a known field refused unless it asks for nothing, and the checks of the values more than
one body takes."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from pydantic import ConfigDict, ValidationError, WrapValidator

from services.api.errors import BadRequest, ShapeError

FORBID = ConfigDict(extra="forbid")
# OpenAI's ReasoningEffort and json_schema `name` (a-z, A-Z, 0-9, underscores and dashes, at most 64): both are
# echoed (the Responses object shows them), so a value OpenAI's schema refuses is refused here too.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def refuse_unless(value: Any, allowed: tuple, field: str, why: str) -> None:
    """A known field we cannot honour is accepted only at a value that asks for nothing."""
    if value not in allowed:
        raise BadRequest(f"`{field}` is not supported: {why}", field)


def one_of(shapes: str) -> WrapValidator:
    """The validator of a union field (`Annotated[A | B, one_of("a string or ...")]`): a value of none of its
    types is refused with one sentence, "`prompt` must be a string, a list of strings, ...", instead of pydantic's
    error per member ("prompt.str: Input should be a valid string"). A member's own check (a BadRequest) still
    speaks for itself. tests/unit/api/test_union_fields.py checks that every union field of a body has one."""

    def validate(value: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            return handler(value)
        except ValidationError as e:
            for error in e.errors():
                if isinstance(own := (error.get("ctx") or {}).get("error"), BadRequest):
                    raise own from None
            raise ShapeError(shapes) from None

    validate.shapes = shapes  # type: ignore[attr-defined]
    return WrapValidator(validate)


TOKEN_PROMPTS = "a string, a list of strings, a list of token ids or a list of lists of token ids"
SCHEMA_SHAPES = "a JSON schema: an object, or its JSON text"
STRINGS = "a string or a list of strings"


def schema_text(value: dict[str, Any] | str, param: str) -> str:
    """A JSON schema given as an object or as JSON text, as compact JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise BadRequest(f"`{param}` must be a JSON schema (an object, or its JSON text)", param) from None
    if not isinstance(value, dict):
        raise BadRequest(f"`{param}` must be a JSON schema object", param)
    return json.dumps(value, separators=(",", ":"))


def check_effort(effort: str | None, param: str) -> None:
    """A reasoning effort is one of OpenAI's values."""
    if effort is not None and effort not in REASONING_EFFORTS:
        raise BadRequest(f"`{param}` must be one of {', '.join(REASONING_EFFORTS)}; got {str(effort)[:40]!r}", param)


def check_schema_name(name: Any, param: str) -> None:
    """A json_schema's `name` is required, as OpenAI requires it."""
    if not isinstance(name, str) or not SCHEMA_NAME.match(name):
        raise BadRequest(f"`{param}` is required: the schema's name, 1 to 64 letters, digits, underscores or "
                         "dashes", param)
