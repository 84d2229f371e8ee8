"""Test-only: `rsinfer scheduler` whose paged engine fails on one request, for tests/e2e/test_poison.py. A job
sent with seed $POISON_RAISE_SEED makes `PagedEngine.add` raise (a bug, or a job this engine cannot take); one
with seed $POISON_EXIT_SEED kills the process on the spot (as a native crash would: no `except` sees it).
Kept out of the package: `python -m tests.support.poison_scheduler scheduler ...`."""

from __future__ import annotations

import os
import sys

from services.scheduler.engine import paged

RAISE_SEED = int(os.environ.get("POISON_RAISE_SEED", "-1"))
EXIT_SEED = int(os.environ.get("POISON_EXIT_SEED", "-1"))
_add = paged.PagedEngine.add


def add(self, req):
    if req.params.seed == EXIT_SEED:
        os._exit(70)
    if req.params.seed == RAISE_SEED:
        raise RuntimeError("this engine cannot take this job (tests/support/poison_scheduler.py)")
    return _add(self, req)


paged.PagedEngine.add = add

if __name__ == "__main__":
    from rsinfer.cli import main

    sys.exit(main(sys.argv[1:]))
