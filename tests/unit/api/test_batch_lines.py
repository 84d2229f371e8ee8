"""services/api/batch_api/batch_lines.py: a batch's input file read the same way by every runner."""

from __future__ import annotations

import json

import pytest

from services.api.batch_api.batch_lines import BadInput, LineLimits, invalid_line, line_uid, output_line, parse_lines

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def row(cid, url="/v1/chat/completions", body=None, method="POST") -> str:
    return json.dumps({"custom_id": cid, "method": method, "url": url, "body": CHAT if body is None else body})


def test_lines_in_order_with_their_errors():
    data = "\n".join([row("a"), "{not json", row("b", url="/v1/completions", body={"model": "m", "prompt": "x"}),
                      json.dumps({"method": "POST"}), row("a"), row("c", method="GET"), row("d", url="/v1/x"),
                      row("e", body=[]), "", row("f", url="/v1/responses", body={"model": "m", "input": "x"})])
    lines = parse_lines(data.encode(), "/v1/chat/completions", LineLimits(100))
    assert [line.index for line in lines] == list(range(9))  # blank lines do not count
    assert [(line.custom_id, line.error is None) for line in lines] == [
        ("a", True), (None, False), ("b", True), (None, False), ("a", False), ("c", False), ("d", False),
        ("e", False), ("f", True)]
    assert lines[2].url == "/v1/completions" and lines[2].model == "m" and lines[8].url == "/v1/responses"
    assert "earlier line" in lines[4].error
    bad = invalid_line("batch_x", lines[1])
    assert bad["error"]["line"] == 2 and bad["response"] is None


def test_a_line_without_url_takes_the_batch_endpoint():
    [line] = parse_lines(json.dumps({"custom_id": "a", "method": "POST", "body": CHAT}).encode(),
                         "/v1/responses", LineLimits(10))
    assert line.url == "/v1/responses" and line.error is None


@pytest.mark.parametrize(("data", "why"), [(b"", "no lines"), (b"\xff\xfe", "UTF-8"),
                                           (("\n".join([row(str(k)) for k in range(11)])).encode(), "at most 10")])
def test_files_that_cannot_run(data, why):
    with pytest.raises(BadInput, match=why):
        parse_lines(data, "/v1/chat/completions", LineLimits(10))


def test_uids_are_a_function_of_batch_line_and_job():
    assert line_uid("b", 3, 0) == line_uid("b", 3, 0)
    assert len({line_uid("b", 3, 0), line_uid("b", 3, 1), line_uid("b", 4, 0), line_uid("c", 3, 0)}) == 4
    assert len(line_uid("b", 0, 0)) == 32
    [line] = parse_lines(row("z").encode(), "/v1/chat/completions", LineLimits(10))
    out = output_line("b", line, 200, {"x": 1})
    assert out["custom_id"] == "z" and out["response"]["request_id"] == line_uid("b", 0, 0)


def test_a_line_past_the_body_limits_is_an_error_line_not_a_crash():
    deep = json.dumps({"custom_id": "deep", "method": "POST", "body": {"x": [[[[[[[[1]]]]]]]]}})
    big = row("big", body={**CHAT, "user": "u" * 200})
    too_deep_for_python = '{"custom_id": "x", "body": ' + "[" * 100_000 + "]" * 100_000 + "}"
    lines = parse_lines("\n".join([deep, big, too_deep_for_python, row("ok")]).encode(), "/v1/chat/completions",
                        LineLimits(10, max_line_bytes=200, max_depth=6))
    assert "more than 6 deep" in lines[0].error and "--max-json-depth" in lines[0].error
    assert "at most 200" in lines[1].error and "--max-body-bytes" in lines[1].error
    assert lines[2].error is not None and lines[3].error is None
    # within the byte cap but deeper than json.loads can parse (RecursionError): refused before it is parsed
    [line] = parse_lines(too_deep_for_python.encode(), "/v1/chat/completions", LineLimits(10))
    assert "more than 64 deep" in line.error
