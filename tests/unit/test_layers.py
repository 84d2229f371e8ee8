"""Stream commands stay in the streams layer: shared/streams.py is the only module of the package (services/,
shared/, rsinfer/) that issues XADD, XREAD, XREADGROUP, XACK, ... (README.md, "Architecture": "the only code
issuing stream commands"), so what a stage writes, reads and acknowledges can be read in one place, and every
XACK goes through its barrier.

ruff's banned-API rule (TID251) sees imports and module attributes, not a method called on a Redis client or
pipeline, so this walks the syntax trees: a call of a stream command's method, an `execute_command("X...")`,
or a Lua script (any string literal, or a .lua file) that calls an X command is an offence outside the layer. The
layer's own scripts are shared/data/*.lua, which shared/streams.py loads."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ("services", "shared", "rsinfer")
LAYER = {"shared/streams.py", *(p.relative_to(ROOT).as_posix() for p in (ROOT / "shared/data").glob("*.lua"))}

# redis-py's method names for the stream commands (every Redis command that starts with X is one).
STREAM_METHODS = frozenset({
    "xadd", "xread", "xreadgroup", "xack", "xautoclaim", "xclaim", "xpending", "xpending_range", "xtrim", "xdel",
    "xgroup_create", "xgroup_destroy", "xgroup_delconsumer", "xgroup_createconsumer", "xgroup_setid",
    "xinfo_stream", "xinfo_groups", "xinfo_consumers", "xrange", "xrevrange", "xlen", "xsetid",
})
RAW_COMMAND_METHODS = frozenset({"execute_command"})
STREAM_COMMAND = re.compile(r"^\s*X[A-Z]+\b", re.IGNORECASE)
LUA_STREAM_CALL = re.compile(r"redis\.p?call\(\s*['\"]X[A-Z]+['\"]", re.IGNORECASE)

# Offenders allowed outside the streams layer, as (file, command): count. Empty: every stream command is in
# shared/streams.py; keep it so.
ALLOWED: Counter[tuple[str, str]] = Counter()


def _literal(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def stream_commands(source: str) -> list[tuple[int, str]]:
    """(line, command) of every stream command the source issues: a method call, a raw command, a Lua call."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            if name in STREAM_METHODS:
                found.append((node.lineno, name))
            elif name in RAW_COMMAND_METHODS and node.args:
                command = _literal(node.args[0])
                if command and STREAM_COMMAND.match(command):
                    found.append((node.lineno, command.split()[0].lower()))
        elif (text := _literal(node)) and (call := LUA_STREAM_CALL.search(text)):
            found.append((node.lineno, "lua " + call.group(0).split("(")[1].strip(" '\"").lower()))
    return sorted(found)


def lua_stream_commands(script: str) -> list[tuple[int, str]]:
    """(line, command) of every stream command a Lua script file calls."""
    return [(n, "lua " + call.group(0).split("(")[1].strip(" '\"").lower())
            for n, line in enumerate(script.splitlines(), 1) for call in LUA_STREAM_CALL.finditer(line)]


def commands_of(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    return lua_stream_commands(text) if path.suffix == ".lua" else stream_commands(text)


def _package_files() -> list[Path]:
    return sorted(p for top in PACKAGE for pattern in ("*.py", "*.lua") for p in (ROOT / top).rglob(pattern))


def _offences() -> list[tuple[str, int, str]]:
    offences = []
    for path in _package_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel not in LAYER:
            offences += [(rel, line, command) for line, command in commands_of(path)]
    return offences


def test_the_detector_sees_each_way_of_issuing_a_stream_command():
    source = '''
async def f(redis, pipe):
    await redis.xadd("k", {"data": b"x"})
    pipe.xack("k", "g", "1-0")
    await redis.execute_command("XREADGROUP", "GROUP", "g", "c", "STREAMS", "k", ">")
    redis.eval("return redis.call('XTRIM', KEYS[1], 'MAXLEN', 0)", 1, "k")
    model.eval()
    await redis.execute_command("MULTI")
    await redis.hset("h", "f", "v")
'''
    assert stream_commands(source) == [(3, "xadd"), (4, "xack"), (5, "xreadgroup"), (6, "lua xtrim")]


def test_the_walk_covers_the_package_and_finds_the_layer_itself():
    files = {p.relative_to(ROOT).as_posix() for p in _package_files()}
    assert files >= LAYER
    assert {"services/scheduler/main.py", "shared/consumer_group.py", "rsinfer/cli.py"} <= files
    in_layer = {command for path in LAYER for _, command in commands_of(ROOT / path)}
    assert {"xadd", "xack", "xreadgroup", "xautoclaim", "lua xadd", "lua xpending"} <= in_layer


def test_stream_commands_are_issued_only_by_the_streams_layer():
    offences = _offences()
    counts = Counter((rel, command) for rel, _, command in offences)
    over = {key for key, n in counts.items() if n > ALLOWED[key]}
    new = [f"{rel}:{line}: {command}" for rel, line, command in offences if (rel, command) in over]
    assert not new, "stream commands outside shared/streams.py (add a function there, call it):\n" + "\n".join(new)


def test_every_allowed_offender_is_still_there():
    counts = Counter((rel, command) for rel, _, command in _offences())
    gone = [f"{rel}: {command}" for (rel, command), n in ALLOWED.items() if counts[rel, command] < n]
    assert not gone, "moved into the streams layer, so remove from ALLOWED here:\n" + "\n".join(gone)


# ---- shared/ holds what more than one stage uses (issue 33): a module only the CLI or one service imports lives
# under rsinfer/ or in that service, so shared/ reads as the stages' common ground.

STAGES = ("api", "tokenizer", "scheduler", "detokenizer")


def _shared_imports(path: Path) -> set[str]:
    """The shared/ modules `path` imports, at the top, in a function or under TYPE_CHECKING alike."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    modules = {n.split(".")[1] for n in names if n.startswith("shared.")}
    return {m for m in modules if (ROOT / "shared" / f"{m}.py").exists()}


def test_every_shared_module_is_used_by_more_than_one_stage():
    shared = {p.stem: _shared_imports(p) for p in (ROOT / "shared").glob("*.py") if p.stem != "__init__"}
    stages_of: dict[str, set[str]] = {name: set() for name in shared}
    for stage in STAGES:
        todo = set().union(*(_shared_imports(p) for p in (ROOT / "services" / stage).rglob("*.py")))
        seen: set[str] = set()
        while todo:  # what the stage imports, and what those import in turn
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo |= shared[name]
        for name in seen:
            stages_of[name].add(stage)
    lonely = {f"shared/{name}.py": sorted(stages) for name, stages in stages_of.items() if len(stages) < 2}
    assert not lonely, f"used by one stage or none: move to that service or rsinfer/: {lonely}"
