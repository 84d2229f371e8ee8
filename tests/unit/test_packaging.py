"""pyproject's dependency bounds: each has a lower bound, the environment the suite runs in meets it, and no
bound admits a version known to break rsinfer (a user's `pip install` must not produce a server that crashes)."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
REQUIREMENT = re.compile(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*(.*)$")

# The oldest versions that have what rsinfer calls; a bound below one of these lets pip install a broken server.
KNOWN_BREAKING = {
    "openai": "1.40.0",
}


def _parse(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def _requirements() -> list[tuple[str, str]]:
    reqs = list(PROJECT["dependencies"]) + list(PROJECT["optional-dependencies"]["test"])
    return [REQUIREMENT.match(r).groups() for r in reqs]  # type: ignore[union-attr]


@pytest.mark.parametrize(("name", "spec"), _requirements(), ids=lambda x: x)
def test_every_dependency_has_a_lower_bound_the_suite_runs_on(name: str, spec: str):
    lower = re.search(r">=\s*([0-9][0-9.]*)", spec)
    assert lower, f"{name} has no lower bound: pin the oldest version the suite passed on"
    assert _parse(version(name)) >= _parse(lower.group(1)), f"{name} {version(name)} is below its own bound"
    known = KNOWN_BREAKING.get(name)
    if known:
        assert _parse(lower.group(1)) >= _parse(known), f"{name}>={lower.group(1)} admits versions that break"
