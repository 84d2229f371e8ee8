"""services/api by concern (issue 33): folders whose names are the layers, each importing only the ones below it
(the `layers` contract in pyproject.toml, which `make lint` checks with import-linter), no import cycle among its
modules even counting function-local and typing imports (which import-linter's contracts can leave out), and no
part reaching back into the service (`ApiService`): the parts are given the process's state (`ApiContext`,
services/api/answer/collaborators.py) instead."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
API = ROOT / "services" / "api"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `path` imports anywhere: at the top, in a function, under TYPE_CHECKING."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
                break
    return found - {_module(path)}


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in API.rglob("*.py")}
    return {m: _imports(p, set(files)) for m, p in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*path[path.index(n):], m, n] if n in path else [m, n]
            if n not in state and (found := visit(n, [*path, m])):
                return found
        state[m] = 2
        return None

    return next((c for m in sorted(graph) if m not in state and (c := visit(m, []))), None)


def test_the_api_has_at_most_14_entries_at_its_top():
    top = sorted(p.name for p in API.iterdir() if p.name != "__pycache__")
    assert len(top) <= 14, top


def test_no_import_cycle_among_the_api_modules_typing_and_local_imports_counted():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_only_the_edge_and_the_features_that_answer_hold_the_service():
    """Admission, adapters, tokenize, tenancy, ... take the context; the service (the answer path's entry) is
    held by the edge that builds it and by the feature APIs that answer through it (Responses, Messages, batches)."""
    service = next(_module(p) for p in API.rglob("*.py") if "\nclass ApiService" in p.read_text())
    holders = {m for m, deps in _graph().items() if service in deps}
    allowed = ("services.api.edge.", "services.api.responses_api.", "services.api.messages_api.",
               "services.api.batch_api.")
    assert {m for m in holders if not m.startswith(allowed)} == set()


def test_every_folder_of_the_api_is_in_a_layer_of_the_contract():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c["layers"] for c in contracts if c["type"] == "layers" and "services.api.edge" in c["layers"])
    named = {m.strip() for layer in layers for m in layer.replace(":", "|").split("|")}
    parts = {_module(p) for p in API.iterdir() if p.name not in ("__pycache__", "__init__.py")}
    assert parts == named
    acyclic = next(c for c in contracts if c["type"] == "acyclic_siblings")
    assert not [i for i in acyclic.get("ignore_imports", []) if i.startswith("services.api")]
