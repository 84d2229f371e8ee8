"""The examples of the project's Markdown (README.md, docs/**/*.md) and how they are run, as a user pasting them
would run them (tests/e2e/test_docs_examples.py runs them against a stack; tests/unit/test_doc_examples.py checks
them without one).

- A fenced block is an example when its info string's first word is python (py, python3) or bash (sh, shell);
  every other block (yaml, json, text, console output, untyped) is shown, never run.
- An example preceded by `<!-- not run: REASON -->` (blank lines between allowed) is not run; the reason says what
  it needs that a test machine has not (Kubernetes, Docker, S3, a GPU or a real checkpoint), or that it serves
  until stopped, or that it is a template. A marker without a reason, or one before no example, is an error.
- The python examples of one file run in one interpreter, one namespace, in order (a user pasting them into one
  session: a block uses the `client` an earlier one made); `python -m tests.support.doc_examples` is that
  interpreter, which runs the blocks it is sent one by one and says after each how it ended.
- A shell example runs through `bash -c` under `set -euo pipefail`, with `curl` failing on an HTTP error
  (`--fail-with-body`: a refused request fails its block, its body shown), in a process group of its own that is
  killed when the block ends or times out.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

PYTHON = {"python", "py", "python3"}
SHELL = {"bash", "sh", "shell"}
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
MARKER = re.compile(r"^\s*<!--\s*not run\b:?(?P<reason>.*?)-->\s*$")
DONE = "\x1e@@doc-example-done "  # the interpreter's line after each block: DONE + {"error": traceback or null}
SHELL_PRELUDE = """set -euo pipefail
curl() { command curl --silent --show-error --fail-with-body "$@" || return; echo; }
"""


class DocError(ValueError):
    """A Markdown file whose examples cannot be told apart: an unclosed fence, a marker without a reason or before
    no example."""


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # of its opening fence, from 1
    lang: str  # the info string's first word, lower case ("" untyped)
    code: str
    not_run: str | None  # the marker's reason, None when it runs

    @property
    def kind(self) -> str | None:
        """"python", "shell", or None for a block that is shown, never run."""
        return "python" if self.lang in PYTHON else "shell" if self.lang in SHELL else None

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files(root: Path) -> list[Path]:
    """README.md and every Markdown file under docs/, in that order."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def blocks(path: Path, root: Path) -> list[Block]:
    """Every fenced block of one Markdown file, in order, with its marker's reason."""
    name, lines = str(path.relative_to(root)), path.read_text(encoding="utf-8").splitlines()
    found, marker, i = [], None, 0
    while i < len(lines):
        line = lines[i]
        if (m := MARKER.match(line)) is not None:
            if marker is not None:
                raise DocError(f"{name}:{marker[0]}: a `not run` marker before no example")
            reason = m["reason"].strip()
            if not reason:
                raise DocError(f"{name}:{i + 1}: `<!-- not run -->` needs a reason: `<!-- not run: REASON -->`")
            marker = (i + 1, reason)
        elif (m := FENCE.match(line)) is not None:
            end = _closing(lines, i, m["fence"])
            if end is None:
                raise DocError(f"{name}:{i + 1}: a fence never closed")
            lang = (m["info"].split() or [""])[0].lower()
            indent = len(m["indent"])
            code = "\n".join(text[indent:] if not text[:indent].strip() else text.lstrip()
                             for text in lines[i + 1:end]) + "\n"
            block = Block(name, i + 1, lang, code, marker[1] if marker else None)
            if marker is not None and block.kind is None:
                raise DocError(f"{name}:{marker[0]}: a `not run` marker before a {lang or 'untyped'} block, "
                               "which is never run")
            found.append(block)
            marker, i = None, end
        elif line.strip() and marker is not None:
            raise DocError(f"{name}:{marker[0]}: a `not run` marker before no example")
        i += 1
    if marker is not None:
        raise DocError(f"{name}:{marker[0]}: a `not run` marker before no example")
    return found


def _closing(lines: list[str], start: int, fence: str) -> int | None:
    """The line of the fence that closes the one opened at `start` (CommonMark: the same character, at least as
    many, nothing after it)."""
    for j in range(start + 1, len(lines)):
        text = lines[j].strip()
        if text and set(text) == {fence[0]} and len(text) >= len(fence) and len(lines[j]) - len(
                lines[j].lstrip()) <= 3:
            return j
    return None


def localize(code: str, replacements: Mapping[str, str]) -> str:
    """The example as it runs here: the documented address (`localhost:8000`) and paths replaced by the test's."""
    for old, new in replacements.items():
        code = code.replace(old, new)
    return code


@dataclass(frozen=True)
class Result:
    block: Block
    output: str
    error: str | None  # None: it ran to its end (exit status 0; Python raised nothing)
    seconds: float


class Runner:
    """Runs the examples of one file in order: the python ones in one interpreter (started at the first), the shell
    ones each in a bash of its own; in `cwd`, with `env`, each within `timeout` seconds."""

    def __init__(self, cwd: Path, env: Mapping[str, str], timeout: float):
        self.cwd, self.env, self.timeout = cwd, dict(env), timeout
        self.python: subprocess.Popen | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.python_lost: str | None = None  # why the interpreter is gone (its namespace with it)

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, block: Block, code: str) -> Result:
        start = time.monotonic()
        output, error = self._python(code, block.where) if block.kind == "python" else self._shell(code)
        return Result(block, output, error, time.monotonic() - start)

    def _shell(self, code: str) -> tuple[str, str | None]:
        proc = subprocess.Popen(["bash", "-c", SHELL_PRELUDE + code], cwd=self.cwd, env=self.env, text=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=self.timeout)
            error = None if proc.returncode == 0 else f"exit status {proc.returncode}"
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            output, _ = proc.communicate()
            error = f"still running after {self.timeout:.0f} s"
        finally:
            _kill_group(proc)  # whatever the block left in the background
        return output, error

    def _python(self, code: str, where: str) -> tuple[str, str | None]:
        if self.python_lost:
            return "", f"not run: {self.python_lost}"
        if self.python is None:
            self._start_python()
        assert self.python is not None and self.python.stdin is not None
        self.python.stdin.write(json.dumps({"where": where, "code": code}) + "\n")
        self.python.stdin.flush()
        output, deadline = [], time.monotonic() + self.timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.python_lost = f"the interpreter was stopped: the example at {where} ran past {self.timeout:.0f} s"
                self._stop_python()
                return "".join(output), f"still running after {self.timeout:.0f} s"
            if line is None:
                self.python_lost = f"the interpreter exited during the example at {where}"
                return "".join(output), self.python_lost
            if DONE in line:
                head, _, tail = line.partition(DONE)
                output.append(head)
                return "".join(output), json.loads(tail)["error"]
            output.append(line)

    def _start_python(self) -> None:
        self.python = subprocess.Popen([sys.executable, "-u", "-m", "tests.support.doc_examples"], cwd=self.cwd,
                                       env=self.env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        out = self.python.stdout
        assert out is not None

        def pump() -> None:
            for line in out:
                self.lines.put(line)
            self.lines.put(None)

        threading.Thread(target=pump, name="doc-examples-python", daemon=True).start()

    def _stop_python(self) -> None:
        if self.python is not None:
            _kill_group(self.python)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.python.wait(5)
            self.python = None

    def close(self) -> None:
        if self.python is not None and self.python.stdin is not None:
            with contextlib.suppress(OSError):
                self.python.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.python.wait(5)
        self._stop_python()


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _requests() -> Iterator[dict]:
    for line in sys.stdin:
        yield json.loads(line)


def serve() -> None:
    """The interpreter of one file's python examples: each block sent on stdin (one JSON line) runs in the one
    namespace, its output on stdout as it comes, then a DONE line with its traceback, if it raised."""
    namespace: dict = {"__name__": "__main__"}
    for request in _requests():
        error = None
        try:
            exec(compile(request["code"], request["where"], "exec"), namespace)
        except BaseException:  # SystemExit too: one example must not end the session of the next
            error = traceback.format_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout.write("\n" + DONE + json.dumps({"error": error}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
