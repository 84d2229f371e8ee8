"""The design contract (docs/design.md) cannot silently drift from the code: every document a comment or
docstring cites exists in the repository, and every Redis key builder and message tag is described. The Markdown
docs hold together too: every link resolves, and each guide's `## Contents` lists its headings."""

from __future__ import annotations

import ast
import functools
import inspect
import io
import re
import tokenize
from pathlib import Path

import msgspec
import pytest

from shared import messages
from shared.keys import Keys

# One worker parses every file once for all the checks (`parsed`, `prose`) under `--dist loadgroup`.
pytestmark = pytest.mark.xdist_group("docs")
ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
CODE_DIRS = ("services", "shared", "rsinfer", "tests", "bench")
PRODUCT_DIRS = ("services", "shared", "rsinfer")
DOC_PATH = re.compile(r"[\w/.-]+\.md\b")
# Repository paths (`shared/keys.py`, `docs/`...) named in the product's prose; tests and tools also name
# paths outside the repository (in archives, caches, templates), so only documents are checked there.
REPO_PATH = re.compile(r"(?<![\w./-])(?:docs|shared|services|rsinfer|tests|bench|deploy|helm)/[\w/.-]*\w")
# Keys methods that are not key builders: one parses a key, one dispatches to the stage builders, one names the
# hash tag of a model's routing keys (the doc writes it `{<tag>}`).
NOT_KEY_BUILDERS = {"uid_of_request_key", "stage_stream", "routing_tag", "fair_tag"}
# The doc writes a worker's key as `<role>:<id>`, as the README and the operator recipes do.
PLACEHOLDER = {"worker_id": "id"}


@functools.cache
def parsed(path: Path) -> tuple[str, ast.Module]:
    """One Python file's text and tree, read once for all the checks here."""
    source = path.read_text()
    return source, ast.parse(source)


@functools.cache
def prose(path: Path) -> tuple[str, ...]:
    """The comments and docstrings of one Python file."""
    source, tree = parsed(path)
    out = [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append(doc)
    return tuple(out)


def citations() -> list[tuple[str, str]]:
    """(file, cited path) for every document or repository path named in comments and docstrings."""
    found = []
    for top in CODE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            for text in prose(path):
                paths = REPO_PATH.findall(text) if top in PRODUCT_DIRS else []
                for cited in {*DOC_PATH.findall(text), *paths}:
                    found.append((str(path.relative_to(ROOT)), cited.rstrip(".")))
    return found


def section(title: str) -> str:
    text = DESIGN.read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"docs/design.md has no section '## {title}'"
    return match.group(1)


def test_every_cited_document_exists():
    cites = citations()
    missing = [(f, c) for f, c in cites if not (ROOT / c).exists() and not (ROOT / f).parent.joinpath(c).exists()]
    assert not missing, f"comments cite paths that are not in the repository: {missing}"
    assert ("shared/keys.py", "docs/design.md") in cites  # the scan sees the citations it must check


def test_no_comment_cites_unnamed_notes():
    vague = [str(p.relative_to(ROOT)) for top in CODE_DIRS for p in (ROOT / top).rglob("*.py")
             if any("(notes)" in t for t in prose(p))]
    assert not vague, f"'(notes)' names no document; cite docs/design.md and a section: {vague}"


def key_patterns() -> dict[str, str]:
    keys = Keys()
    out = {}
    for name, method in inspect.getmembers(keys, inspect.ismethod):
        if name.startswith("_") or name in NOT_KEY_BUILDERS:
            continue
        params = inspect.signature(method).parameters
        key = method(*(f"<{PLACEHOLDER.get(p, p)}>" for p in params))
        out[name] = key.replace(f"{{{keys.routing_tag('<model>')}}}", "{<tag>}").replace(
            f"{{{keys.fair_tag('<model>')}}}", "{<ftag>}")
    return out


def test_every_key_builder_is_in_the_key_table():
    patterns = key_patterns()
    assert {"reply", "control", "workers", "worker"} <= set(patterns)
    assert patterns["reply"] == "rsinfer:reply:{<uid>}"
    rows = "\n".join(line for line in section("Redis keys").splitlines() if line.startswith("|"))
    missing = {name: p for name, p in patterns.items() if f"`{p}`" not in rows}
    assert not missing, f"docs/design.md's key table lacks: {missing}"


def message_tags() -> set[str]:
    tags = set()
    for _, cls in inspect.getmembers(messages, inspect.isclass):
        if issubclass(cls, msgspec.Struct) and cls.__module__ == messages.__name__:
            tag = cls.__struct_config__.tag
            if tag is not None:
                tags.add(tag)
    return tags


def test_every_message_tag_is_documented():
    tags = message_tags()
    assert {"tokenize", "schedule", "detokenize", "delta", "error"} <= tags
    table = section("Messages")
    missing = sorted(t for t in tags if f"| `{t}` |" not in table)
    assert not missing, f"docs/design.md's message table lacks kinds: {missing}"


def test_every_section_code_cites_exists():
    cited = {m for top in CODE_DIRS for p in (ROOT / top).rglob("*.py") for t in prose(p)
             for m in re.findall(r'docs/design\.md,? "([^"]+)"', t)}
    assert cited, "no comment cites a section of docs/design.md"
    for title in sorted(cited):
        assert section(title).strip()


def record_fields_written() -> set[str]:
    """Keyword fields of every `set_status` call in the stages (shared/request_store.py: the record's fields)."""
    fields = {"status", "updated_at"}
    for top in ("services", "shared"):
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(parsed(path)[1]):
                name = getattr(node, "func", None)
                if isinstance(node, ast.Call) and getattr(name, "attr", getattr(name, "id", "")) == "set_status":
                    fields |= {k.arg for k in node.keywords if k.arg is not None}
    return fields


def test_every_record_field_is_documented():
    fields = record_fields_written()
    assert {"scheduler", "entry", "prompt_tokens", "completion_tokens", "finish_reason", "error"} <= fields
    rows = "\n".join(line for line in section("Request record").splitlines() if line.startswith("|"))
    missing = sorted(f for f in fields if f"`{f}`" not in rows)
    assert not missing, f"docs/design.md's record table lacks fields: {missing}"


# The Markdown a reader follows links through, and the pages whose `## Contents` lists their headings.
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "helm" / "rsinfer" / "README.md"]
WITH_CONTENTS = [ROOT / "docs" / name for name in ("user-guide.md", "operator-guide.md", "limits.md", "design.md")]
WITH_CONTENTS.append(ROOT / "helm" / "rsinfer" / "README.md")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def outside_code(path: Path) -> list[str]:
    """The lines of a Markdown file outside its fenced blocks."""
    lines, fence = [], None
    for line in path.read_text().splitlines():
        m = FENCE.match(line)
        if m and fence is None:
            fence = m.group(1)
        elif m and fence is not None and set(line.strip()) == {fence[0]} and len(line.strip()) >= len(fence):
            fence = None
        elif fence is None:
            lines.append(line)
    return lines


def headings(path: Path) -> list[tuple[int, str, str]]:
    """(level, title, GitHub's anchor) of each heading under the title, in order."""
    out, seen = [], {}
    for line in outside_code(path):
        if m := re.match(r"^(#{2,6}) (.+?)\s*$", line):
            base = re.sub(r"[^\w\- ]", "", m[2].lower()).replace(" ", "-")
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.append((len(m[1]), m[2], base if n == 0 else f"{base}-{n}"))
    return out


def test_every_link_of_the_docs_resolves():
    """README.md, docs/ and the chart's README link only to files that exist and headings they have (the README
    was split into guides; a section that moves must take its links along)."""
    broken = []
    for path in MARKDOWN:
        for target in LINK.findall("\n".join(outside_code(path))):  # a link's text may span lines
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in {a for _, _, a in headings(dest)}:
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


@pytest.mark.parametrize("path", WITH_CONTENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_guide_lists_its_headings_at_its_top(path):
    found = [h for h in headings(path) if h[1] != "Contents"]
    assert headings(path)[0][1] == "Contents", "the first section is `## Contents`"
    text = path.read_text()
    listed = text[text.index("## Contents\n"):text.index("\n## ", text.index("## Contents\n") + 1)]
    expected = "\n".join("  " * (level - 2) + f"- [{title}](#{anchor})" for level, title, anchor in found)
    assert listed.split("\n", 2)[2].strip() == expected
