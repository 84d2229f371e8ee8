"""A batch's input file, read the same way by every API process that runs it (services/api/batch_api/batches.py): its
lines in order, each a request to run or an error line already (malformed JSON, no `custom_id`, a repeated one, a
method or url that is not the batch's), and the lines of its output and error files in OpenAI's shape.

A line runs at its own `url` (any of ENDPOINTS): OpenAI wants every line at the batch's `endpoint`, rsinfer
takes a mix (the batch's endpoint is then the default of a line without `url`).

Pure code: the uid of each line's requests is derived from the batch and the line (`line_uid`), so a runner that
takes over a batch finds the requests its predecessor submitted (their records) instead of running them again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from services.api.answer.limits import depth_over

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
MAX_CUSTOM_ID_CHARS = 512


class BadInput(ValueError):
    """The input file cannot be run at all (the batch fails with this)."""


@dataclass(frozen=True)
class Line:
    """Line `index` (0-based) of the input file: a request (`body`) or an error (`error`)."""

    index: int
    custom_id: str | None
    body: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    url: str = ""

    @property
    def model(self) -> str:
        return str(self.body.get("model", ""))


@dataclass(frozen=True)
class LineLimits:
    """What one input file and each of its lines may hold: a line is a request body, bounded as one sent over HTTP
    is (--max-body-bytes, --max-json-depth), checked before it is parsed."""

    max_lines: int
    max_line_bytes: int = 16 << 20
    max_depth: int = 64


def parse_lines(data: bytes, endpoint: str, limits: LineLimits) -> list[Line]:
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise BadInput("the input file is not UTF-8 text") from None
    raw = [r for r in text.splitlines() if r.strip()]
    if not raw:
        raise BadInput("the input file has no lines")
    if len(raw) > limits.max_lines:
        raise BadInput(f"the input file has {len(raw)} lines; at most {limits.max_lines} (--max-batch-lines)")
    seen: set[str] = set()
    lines = []
    for k, r in enumerate(raw):
        line = parse_line(k, r, endpoint, limits)
        if line.error is None and line.custom_id in seen:
            line = Line(k, line.custom_id, error=f"custom_id `{line.custom_id}` is used by an earlier line")
        seen.add(line.custom_id or "")
        lines.append(line)
    return lines


def parse_line(k: int, raw: str, endpoint: str, limits: LineLimits) -> Line:
    data = raw.encode()
    if len(data) > limits.max_line_bytes:
        return Line(k, None, error=f"the line is {len(data)} bytes; at most {limits.max_line_bytes} "
                    "(--max-body-bytes)")
    if depth_over(data, limits.max_depth):
        return Line(k, None, error=f"the line nests objects and lists more than {limits.max_depth} deep "
                    "(--max-json-depth)")
    try:
        obj = json.loads(raw)
    except ValueError:
        return Line(k, None, error="the line is not valid JSON")
    if not isinstance(obj, dict):
        return Line(k, None, error="the line is not a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID_CHARS:
        return Line(k, None, error=f"`custom_id` must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters")
    if obj.get("method") != "POST":
        return Line(k, cid, error="`method` must be POST")
    url = obj.get("url", endpoint)
    if url not in ENDPOINTS:
        return Line(k, cid, error=f"`url` must be one of {', '.join(ENDPOINTS)}")
    if not isinstance(obj.get("body"), dict):
        return Line(k, cid, error="`body` must be a JSON object")
    return Line(k, cid, obj["body"], url=url)


def line_uid(batch_id: str, index: int, job: int) -> str:
    """The uid of job `job` (a completion's prompt) of line `index`: the same in every process."""
    return hashlib.sha256(f"{batch_id}/{index}/{job}".encode()).hexdigest()[:32]


def output_line(batch_id: str, line: Line, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """A line of the output file (status 200) or the error file (an HTTP error's status and body)."""
    uid = line_uid(batch_id, line.index, 0)
    return {"id": f"batch_req_{uid}", "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": uid, "body": body}, "error": None}


def invalid_line(batch_id: str, line: Line) -> dict[str, Any]:
    """A line that could not be read as a request: in the error file, with its number (1-based)."""
    return {"id": f"batch_req_{line_uid(batch_id, line.index, 0)}", "custom_id": line.custom_id, "response": None,
            "error": {"code": "invalid_request", "message": line.error, "line": line.index + 1}}
