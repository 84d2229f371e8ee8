"""The house's bounds on the package's shape (issue 33): classes of one screen's worth of methods, files a reader
can hold, one name per module. The API folder's own layout is tests/unit/api/test_api_layout.py's; the
import-layers contract and the absence of import cycles are `lint-imports`' (pyproject.toml, `[tool.importlinter]`),
which `make lint` and `make test` run."""

from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ("services", "shared", "rsinfer")
MAX_CLASS_LINES = 250
MAX_FILE_LINES = 450
# Each stage's process entry point is `services/<stage>/main.py` (README, "Architecture"): the one name that is
# the same in every stage by design.
SHARED_NAMES = {"main": {"services/api/main.py", "services/scheduler/main.py", "services/tokenizer/main.py",
                         "services/detokenizer/main.py"}}


def _modules() -> list[Path]:
    return sorted(p for top in PACKAGE for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_no_file_is_over_the_bound():
    long = {_rel(p): n for p in _modules() if (n := p.read_text().count("\n")) > MAX_FILE_LINES}
    assert long == {}, f"files over {MAX_FILE_LINES} lines: split them by what they do"


def test_no_class_is_over_the_bound():
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and (n := node.end_lineno - node.lineno + 1) > MAX_CLASS_LINES:
                long[f"{_rel(path)}:{node.name}"] = n
    assert long == {}, f"classes over {MAX_CLASS_LINES} lines"


def test_every_module_name_is_used_once():
    """A module or package name names one thing across the package, so a name in a log, a trace or a review
    points at one file."""
    where: dict[str, set[str]] = defaultdict(set)
    for path in _modules():
        if path.name == "__init__.py":
            if path.parent.parent.name not in (ROOT.name, "services"):  # the top packages and the stages aside
                where[path.parent.name].add(_rel(path.parent))
        else:
            where[path.stem].add(_rel(path))
    twice = {name: sorted(paths) for name, paths in where.items()
             if len(paths) > 1 and paths != SHARED_NAMES.get(name)}
    assert twice == {}



@pytest.mark.parametrize("stage", ["api", "scheduler", "tokenizer", "detokenizer"])
def test_every_module_of_a_stage_is_in_a_layer_of_its_contract(stage):
    """A module added to a stage takes its place in the stage's `layers` contract (pyproject.toml), which
    import-linter checks: a module no layer names could import upward unseen."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    prefix = f"services.{stage}."
    layers = next(c["layers"] for c in contracts if c["type"] == "layers" and c["layers"][0].startswith(prefix))
    named = {m.strip().removeprefix(prefix) for layer in layers for m in layer.replace(":", "|").split("|")}
    parts = {p.stem for p in (ROOT / "services" / stage).iterdir()
             if p.name not in ("__pycache__", "__init__.py") and (p.suffix == ".py" or p.is_dir())}
    assert parts == named
