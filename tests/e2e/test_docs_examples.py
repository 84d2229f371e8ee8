"""Every Python and shell example of README.md and docs/**/*.md runs, in order, as a user pasting them would run
them, against `rsinfer up` on the demo model: an example that stops working fails here
(tests/support/doc_examples.py finds and runs them; tests/unit/test_doc_examples.py checks them without a stack).

- ```python blocks of one file run in one interpreter, one namespace, in order (a user pasting them into one
  session: a block uses the `client` an earlier one made); each ```bash / ```sh / ```shell block runs through
  `bash -c` under `set -euo pipefail`, its `curl` failing on an HTTP error. Each block within BLOCK_TIMEOUT_S.
- A block passes when it ends (exit status 0; Python raised nothing) and, where the docs show what it prints, its
  output says it (OUTPUTS).
- yaml, json, text, console-output and untyped blocks are shown, never run. A block preceded by
  `<!-- not run: REASON -->` is not run (it serves until stopped, needs Kubernetes, Docker, S3, a GPU or a real
  checkpoint, or is a template); every other python or shell block runs.
- The examples name the server `rsinfer up` prints, localhost:8000, and adapters under /tmp/adapters; they run
  against this module's stack at its own address, with a folder of its own (`replaced`), in a folder of their own
  (where the Batch example writes its requests.jsonl), and with the demo model `rsinfer up` would make
  (`$RSINFER_CACHE` holds the session's), so `rsinfer demo-adapter` makes no other.
- One stack for every file: `rsinfer up` with the flags of the user guide's LoRA example (`--max-loras 4
  --lora-roots /tmp/adapters --lora-modules sql=/tmp/adapters/sql`, docs/user-guide.md), which the other examples
  do not mind and the session's stack lacks; its `sql` adapter is made before it starts, as the guide's
  `rsinfer demo-adapter` makes it.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.demo_model import DEMO_VERSION
from tests.support import doc_examples
from tests.support.doc_examples import Result
from tests.support.stack import Stack, new_stack

pytestmark = pytest.mark.timeout(600)  # the session's demo model and a stack may start here, on a loaded machine

ROOT = Path(__file__).resolve().parents[2]
DOCS = doc_examples.doc_files(ROOT)
BLOCK_TIMEOUT_S = 60.0
ADDRESSES = ("localhost:8000", "127.0.0.1:8000")
ADAPTERS = "/tmp/adapters"
UP = f"rsinfer up --max-loras 4 --lora-roots {ADAPTERS} --lora-modules sql={ADAPTERS}/sql"  # the user guide's LoRA `up`
# What a block shows it prints (a comment, or the prose before it), said by its output: (a text of the block's
# code that finds it, texts its output has); each must still find one (test_the_checks_find_their_examples).
OUTPUTS = [
    ('"stream": true}', ["data: [DONE]"]),
    ("/tokenize -d", ['"count"', '"tokens"']),
    ("/detokenize -d", ['"prompt"']),
    ("message.parsed", ["population="]),
    ("responses.retrieve(bg_id, stream=True", ["response.completed"]),
    ("client.batches.create", ["completed=2", "request-1"]),
    ("/v1/embeddings", ['"embedding"']),
    ("/v1/score", ['"scores"']),
    ('"model": "legal"', ["'legal' added", '"text_completion"', "'legal' removed"]),
]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, demo_model_dir) -> Path:
    """The adapters' folder, with the `sql` adapter the stack registers at start (the user guide makes it
    with `rsinfer demo-adapter`, which the examples run again)."""
    from rsinfer.demo_adapter import make_adapter

    root = tmp_path_factory.mktemp("adapters")
    make_adapter(root / "sql", demo_model_dir)
    return root


@pytest.fixture(scope="module")
def server(redis_server, demo_model_dir, tmp_path_factory, adapters) -> Iterator[Stack]:
    """UP, on this folder of adapters (test_the_checks_find_their_examples: the docs still say UP)."""
    s = new_stack(redis_server, demo_model_dir, tmp_path_factory, "docs")
    try:
        s.start("up", "up", RSINFER_MAX_LORAS="4", RSINFER_LORA_ROOTS=str(adapters),
                RSINFER_LORA_MODULES=f"sql={adapters}/sql")
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def user_env(tmp_path_factory, demo_model_dir) -> dict[str, str]:
    """A user's shell: the venv's `rsinfer` and `python` first on PATH, this tree's code, no RSINFER_* or
    OPENAI_* of the test run, and a cache whose demo model is the session's."""
    missing = [tool for tool in ("bash", "curl") if shutil.which(tool) is None]
    assert not missing, f"the examples need {' and '.join(missing)}: install them (apt-get install curl)"
    cache = tmp_path_factory.mktemp("cache")
    (cache / f"demo-model-v{DEMO_VERSION}").symlink_to(demo_model_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RSINFER_", "OPENAI_"))}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(ROOT),
               RSINFER_CACHE=str(cache), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def replaced(server: Stack, adapters: Path) -> dict[str, str]:
    """The documented address and paths -> this stack's."""
    return {**dict.fromkeys(ADDRESSES, f"127.0.0.1:{server.port}"), ADAPTERS: str(adapters)}


def failures(results: list[Result]) -> list[str]:
    """What went wrong, per block: its error, or an output that lacks what the docs say it prints."""
    out = []
    for r in results:
        missing = [text for needle, texts in OUTPUTS if needle in r.block.code for text in texts
                   if text not in r.output]
        if r.error or missing:
            why = r.error or f"its output lacks {missing}"
            out.append(f"--- {r.block.where} ({r.block.lang}, {r.seconds:.1f} s): {why}\n{r.output[-3000:]}")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_example_runs_as_pasted(doc, request, tmp_path):
    runnable = [b for b in doc_examples.blocks(doc, ROOT) if b.kind and b.not_run is None]
    if not runnable:
        return  # a file of prose, tables and templates needs no stack
    server, adapters, user_env = (request.getfixturevalue(name) for name in ("server", "adapters", "user_env"))
    replacements = replaced(server, adapters)
    with doc_examples.Runner(tmp_path, user_env, BLOCK_TIMEOUT_S) as runner:
        results = [runner.run(b, doc_examples.localize(b.code, replacements)) for b in runnable]
    for r in results:  # shown with -s, or when it fails
        print(f"=== {r.block.where}: {r.seconds:.1f} s{' FAILED' if r.error else ''}\n{r.output[-2000:]}")
    bad = failures(results)
    assert not bad, f"{len(bad)} of {len(results)} examples of {doc.name} fail:\n" + "\n".join(bad)


def test_the_checks_find_their_examples():
    """Each OUTPUTS check still finds the example it checks, and the docs still start the server as UP."""
    found = [b for doc in DOCS for b in doc_examples.blocks(doc, ROOT) if b.kind]
    code = [b.code for b in found if b.not_run is None]
    assert not [needle for needle, _ in OUTPUTS if not any(needle in c for c in code)]
    assert any(b.not_run and UP in b.code for b in found), f"no example starts `{UP}` any more"
