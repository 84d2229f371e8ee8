"""shared/heap.py in a fresh interpreter (freezing is for the whole process: not this test runner's)."""

from __future__ import annotations

import json
import subprocess
import sys

from shared import heap

PROBE = """
import gc, json, logging
from shared import heap
logging.basicConfig(level=logging.INFO)
kept = [[i] for i in range(1000)]  # what a process built before it serves
before = gc.get_threshold()
heap.freeze_startup("probe")
print(json.dumps({"frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects()), "before": before,
                  "after": gc.get_threshold()}))
"""


def test_what_a_process_built_before_serving_is_frozen_out_of_collections_and_young_ones_run_less_often():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=60)
    got = json.loads(out.stdout)
    assert got["frozen"] > 1000  # the startup's objects, those of the probe's list among them
    assert got["tracked"] < got["frozen"] // 10  # what a collection walks now: those are out of it
    assert got["after"][0] == max(got["before"][0], heap.GEN0_THRESHOLD) and got["after"][1:] == got["before"][1:]
    assert "probe:" in out.stderr and "objects frozen out of garbage collection" in out.stderr
