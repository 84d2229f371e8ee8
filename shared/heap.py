"""A long-lived process's garbage collector, set once the process has started
(docs/design.md, "Measured facts behind the design").

What a process builds before it serves (the modules it imported, its model or tokenizer, the app's routes and
schemas) lives as long as it does, yet CPython's full collections walk all of it again and again. `freeze_startup`
moves it out of the collector's sight (`gc.freeze`), so a collection walks what requests made, and raises the
first generation's threshold so that the many short-lived objects of each request and chunk are collected in
fewer, still short, passes.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)

GEN0_THRESHOLD = 2_000  # allocations between young collections (CPython's default: 700)


def freeze_startup(role: str) -> None:
    """Collect what starting left behind, then freeze what remains; call once, when the process has started."""
    began = time.perf_counter()
    gc.collect()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, GEN0_THRESHOLD), middle, old)
    log.info("%s: %d objects frozen out of garbage collection in %.0f ms", role, gc.get_freeze_count(),
             (time.perf_counter() - began) * 1000)
