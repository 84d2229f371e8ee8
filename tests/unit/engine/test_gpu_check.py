"""bench/gpu_check.py's parts that run anywhere: trimming flashinfer's wheel, unpacking what a machine lacks,
and the whole check on CPU (tiny shapes, the fake flashinfer) so that the GPU run has at least run once."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "bench" / "gpu_check.py"


def _load():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trim_keeps_what_the_jit_reads(tmp_path):
    wheel = tmp_path / "flashinfer_python-0.7.4-py3-none-any.whl"
    kept = ["flashinfer/__init__.py", "flashinfer/py.typed", "flashinfer/data/include/flashinfer/x.cuh",
            "flashinfer/data/cutlass/include/c.h", "flashinfer/data/cccl/cub.h", "flashinfer/data/csrc/sampling.cu",
            "flashinfer_python-0.7.4.dist-info/METADATA"]
    dropped = ["flashinfer/data/csrc/nv_internal/big.cu", "flashinfer/data/spdlog/s.h", "flashinfer/lib.so"]
    with zipfile.ZipFile(wheel, "w") as z:
        for name in kept + dropped:
            z.writestr(name, "x")
    out = tmp_path / "trimmed.zip"
    _load().trim(str(wheel), str(out))
    assert sorted(zipfile.ZipFile(out).namelist()) == sorted(kept)


def test_install_unpacks_only_what_does_not_import(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "json-1.0-py3-none-any.whl", "w") as z:  # stdlib: importable already
        z.writestr("json/__init__.py", "")
    with zipfile.ZipFile(wheels / "nothere_pkg-1.0-py3-none-any.whl", "w") as z:
        z.writestr("nothere_pkg/__init__.py", "")
        z.writestr("nothere_pkg-1.0.data/scripts/", "")
        z.writestr("nothere_pkg-1.0.data/scripts/tool", "#!/bin/sh\n")
    site = tmp_path / "site"
    _load().install(str(wheels), str(site))
    assert (site / "nothere_pkg" / "__init__.py").exists() and not (site / "json").exists()
    assert (site / "bin" / "tool").stat().st_mode & 0o111


@pytest.mark.timeout(600)
def test_the_check_runs_on_cpu(tmp_path):
    out = tmp_path / "gpu-check.json"
    subprocess.run([sys.executable, str(SCRIPT), "run", "--cpu-smoke", "--out", str(out)], check=True, cwd=ROOT,
                   timeout=590, capture_output=True)
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert not report["skipped"] and all("error" not in s for s in sections.values()), sections
    assert sections["agreement"]["flashinfer+graphs_vs_torch"]["identical"] == "8/8"
    assert "needs 2 or more GPUs" in sections["tensor_parallel"]["skipped_why"]  # and says so
    assert set(sections["decode"]) == {"torch", "flashinfer", "flashinfer+graphs", "seconds"}
    assert sections["syncs"]["temperature@4"]["result_waits_per_step"] == 1
    texts = sections["lora"]["texts"]
    assert texts["flashinfer+segment+graphs_vs_flashinfer+grouped"] == "6/6" and texts["differs_from_base"] >= 4
    assert texts["lora_replays"]["flashinfer+segment+graphs"][0] > 0
    assert set(sections["lora"]["decode"]["flashinfer+segment+graphs"]["ms_per_step (batch x distinct adapters)"]) \
        == {"4x0", "4x1", "4x4"}
