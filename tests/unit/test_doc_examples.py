"""The docs' examples, without a server (tests/e2e/test_docs_examples.py runs them against one): every python and
shell block of README.md and docs/**/*.md parses, each `not run` marker gives a reason and stands before an
example, and the extractor and runner (tests/support/doc_examples.py) do what that test relies on."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.support.doc_examples import Block, DocError, Runner, blocks, doc_files, localize
from tests.support.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = [b for doc in doc_files(ROOT) for b in blocks(doc, ROOT) if b.kind]


def test_the_docs_have_examples_that_run():
    assert {b.kind for b in EXAMPLES if b.not_run is None} == {"python", "shell"}


@pytest.mark.parametrize("block", [b for b in EXAMPLES if b.kind == "python"], ids=lambda b: b.where)
def test_each_python_example_compiles(block: Block):
    compile(block.code, block.where, "exec")


def test_each_shell_example_that_runs_parses():
    """(One not run may be a template: `redis-cli HGETALL rsinfer:req:{<uid>}`.)"""
    bad = {}
    for b in (b for b in EXAMPLES if b.kind == "shell" and b.not_run is None):
        done = subprocess.run(["bash", "-n", "-c", b.code], capture_output=True, text=True, timeout=10)
        if done.returncode:
            bad[b.where] = done.stderr
    assert not bad, bad


def doc(tmp_path: Path, text: str) -> list[Block]:
    path = tmp_path / "x.md"
    path.write_text(textwrap.dedent(text))
    return blocks(path, tmp_path)


def test_blocks_their_languages_and_markers(tmp_path):
    found = doc(tmp_path, """\
        Intro.

        ```python
        print(1)
        ```
        <!-- not run: needs Docker -->

        ~~~bash
        docker ps
        ```not a fence```
        ~~~
        ````yaml
        ```python
        inside = "yaml"
        ```
        ````
           ```sh title="indented"
           echo hi
             echo deeper
           ```
        ```
        untyped
        ```
        """)
    assert [(b.line, b.lang, b.kind, b.not_run) for b in found] == [
        (3, "python", "python", None), (8, "bash", "shell", "needs Docker"), (12, "yaml", None, None),
        (17, "sh", "shell", None), (21, "", None, None)]
    assert found[1].code == 'docker ps\n```not a fence```\n'
    assert found[3].code == "echo hi\n  echo deeper\n"


@pytest.mark.parametrize(("text", "why"), [
    ("<!-- not run -->\n```bash\nls\n```\n", "needs a reason"),
    ("<!-- not run:  -->\n```bash\nls\n```\n", "needs a reason"),
    ("<!-- not run: Docker -->\nSome prose.\n```bash\nls\n```\n", "before no example"),
    ("<!-- not run: Docker -->\n```yaml\na: 1\n```\n", "before a yaml block"),
    ("```bash\nls\n```\n<!-- not run: Docker -->\n", "before no example"),
    ("```bash\nls\n", "never closed"),
])
def test_a_marker_must_say_why_and_stand_before_an_example(tmp_path, text, why):
    with pytest.raises(DocError, match=why):
        doc(tmp_path, text)


def test_the_address_and_paths_are_replaced():
    code = "curl localhost:8000/v1/models\nOpenAI(base_url='http://localhost:8000/v1')\nls /tmp/adapters/sql\n"
    assert localize(code, {"localhost:8000": "127.0.0.1:5", "/tmp/adapters": "/t/a"}) == (
        "curl 127.0.0.1:5/v1/models\nOpenAI(base_url='http://127.0.0.1:5/v1')\nls /t/a/sql\n")


def runner(tmp_path: Path, timeout: float = 30.0) -> Runner:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return Runner(tmp_path, env, timeout)


def run(r: Runner, kind: str, code: str):
    return r.run(Block("x.md", 1, "python" if kind == "python" else "bash", code, None), code)


def test_python_examples_share_one_namespace_and_go_on_after_one_fails(tmp_path):
    with runner(tmp_path) as r:
        first = run(r, "python", "x = 6 * 7\nprint('x is', x, end='')\n")
        failed = run(r, "python", "print('before')\nraise KeyError('boom')\n")
        after = run(r, "python", "import sys\nprint(x, file=sys.stderr)\nraise SystemExit(3)\n")
        again = run(r, "python", "print(x + 1)\n")
    assert first.error is None and "x is 42" in first.output
    assert "KeyError: 'boom'" in failed.error and "before" in failed.output
    assert "SystemExit: 3" in after.error and "42" in after.output
    assert again.error is None and "43" in again.output


def test_a_shell_example_fails_on_its_first_failing_command_and_on_an_http_error(tmp_path):
    with runner(tmp_path) as r:
        ok = run(r, "shell", "echo one\necho two\n")
        failed = run(r, "shell", "echo one\nfalse\necho never\n")
        refused = run(r, "shell", "curl http://127.0.0.1:1/nothing\necho never\n")
    assert ok.error is None and ok.output == "one\ntwo\n"
    assert failed.error == "exit status 1" and "never" not in failed.output
    assert refused.error and "never" not in refused.output


def test_an_example_past_its_time_is_stopped_with_what_it_started(tmp_path):
    pid_file = tmp_path / "pid"
    with runner(tmp_path, timeout=1.0) as r:
        shell = run(r, "shell", f"sleep 60 & echo $! > {pid_file}\nwait\n")
        slow = run(r, "python", "import time\ntime.sleep(60)\n")
        next_one = run(r, "python", "print(1)\n")
    assert shell.error == "still running after 1 s" and slow.error == "still running after 1 s"
    assert next_one.error.startswith("not run: the interpreter was stopped")
    wait_for(lambda: gone(int(pid_file.read_text())), 5)  # the block's process group went with it


def gone(pid: int) -> bool:
    """No such process, or a zombie (dead, not yet reaped by whoever adopted it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
