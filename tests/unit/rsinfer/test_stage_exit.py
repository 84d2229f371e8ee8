"""rsinfer/cli.py: a stage's process ends without the interpreter's teardown, unless coverage must write its data."""

from __future__ import annotations

import sys
import types

from rsinfer import cli


def test_a_stopped_stage_exits_at_once_with_its_code(monkeypatch):
    exits: list[int] = []
    monkeypatch.setattr(cli.os, "_exit", exits.append)
    flushed: list[bool] = []
    monkeypatch.setattr(cli.logging, "shutdown", lambda: flushed.append(True))  # not this test process's logs
    monkeypatch.setitem(sys.modules, "coverage", None)  # not measured
    cli._exit_now(3)
    assert exits == [3] and flushed == [True]


def test_under_coverage_it_exits_as_usual(monkeypatch):
    exits: list[int] = []
    monkeypatch.setattr(cli.os, "_exit", exits.append)
    running = types.SimpleNamespace(Coverage=types.SimpleNamespace(current=lambda: object()))
    monkeypatch.setitem(sys.modules, "coverage", running)
    assert cli._exit_now(3) == 3 and exits == []
