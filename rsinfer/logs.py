"""Logging set-up shared by every process: one line per record, with the role and worker id."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str, role: str, worker_id: str) -> None:
    fmt = f"%(asctime)s %(levelname)s {role}[{worker_id}] %(name)s: %(message)s"
    logging.basicConfig(level=level.upper(), format=fmt, stream=sys.stderr, force=True)
    for noisy in ("httpx", "urllib3", "filelock", "transformers"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
