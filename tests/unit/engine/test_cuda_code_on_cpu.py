"""What the CUDA-only code does that CPU can check: how CUDA-graph capture runs and fails, and the
flashinfer workspace (flashinfer replaced by a recording fake; its kernels need a GPU, test_cuda.py)."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from services.scheduler.engine.attention import flashinfer_backend
from services.scheduler.engine.base import EngineRequest
from services.scheduler.engine.cuda_graph import DecodeGraphs
from services.scheduler.engine.kv_cache import KVCache
from services.scheduler.engine.model_geometry import attention_geometry
from tests.unit.engine.util import clone_model, drain, engine, greedy, hf_greedy, prompts, tokens

GRAPH_LOG = "services.scheduler.engine.cuda_graph"


def _capture_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == GRAPH_LOG and r.levelno == logging.WARNING]


def test_a_failed_capture_warns_with_its_cause_and_decode_runs_eagerly(demo_model, caplog):
    caplog.set_level(logging.INFO, logger=GRAPH_LOG)
    eng = engine(clone_model(demo_model), cuda_graphs=True)  # asked for graphs, on CPU
    assert eng.runner.graphs is None
    (warning,) = _capture_warnings(caplog)
    assert "decoding eagerly" in warning.getMessage()
    assert "CUDA graphs need a CUDA device" in warning.getMessage(), "the message names the cause"
    p = prompts([9], demo_model.config.vocab_size, seed=2)[0]
    out = drain(eng, {0: [EngineRequest("a", p, greedy(8))]})
    assert tokens(out[("a", 0)]) == hf_greedy(demo_model, p, 8)


def test_the_error_under_a_failed_capture_end_is_named(monkeypatch, caplog):
    """A capture interrupted mid-graph fails again when torch.cuda.graph's __exit__ ends it; the error
    that interrupted it is the cause, and the warning names both."""
    def capture_all(self):
        try:
            raise ValueError("operation not permitted when stream is capturing")
        except ValueError:
            raise RuntimeError("operation failed due to a previous error during capture")  # noqa: B904

    monkeypatch.setattr(DecodeGraphs, "__init__", lambda self, *a: None)
    monkeypatch.setattr(DecodeGraphs, "_capture_all", capture_all)
    caplog.set_level(logging.WARNING, logger=GRAPH_LOG)
    assert DecodeGraphs.capture(None, None, 8, 4) is None
    (warning,) = _capture_warnings(caplog)
    assert ("RuntimeError: operation failed due to a previous error during capture <- "
            "ValueError: operation not permitted when stream is capturing") in warning.getMessage()


def test_graphs_are_captured_under_inference_mode(monkeypatch):
    modes = []
    monkeypatch.setattr(DecodeGraphs, "__init__", lambda self, *a: setattr(self, "sizes", [1]))
    monkeypatch.setattr(DecodeGraphs, "_capture_all", lambda self: modes.append(torch.is_inference_mode_enabled()))
    assert DecodeGraphs.capture(None, None, 1, 1) is not None
    assert modes == [True], "captured outside inference mode: autograd state would be recorded into the graph"


class _Wrapper:
    """Stands in for flashinfer's paged prefill/decode wrappers: keeps the workspace it was given."""

    def __init__(self, workspace, layout, **kw):
        self.workspace = workspace


def test_flashinfer_workspace_starts_zeroed(demo_model, monkeypatch):
    fake = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_Wrapper,
                                 BatchDecodeWithPagedKVCacheWrapper=_Wrapper, __version__="fake")
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(flashinfer_backend, "workspace_bytes", lambda *heads: 1 << 16)
    g = attention_geometry(demo_model)
    kv = KVCache(g.kv_shape(4), 4, torch.float32, "cpu")
    real_empty = torch.empty

    def uninitialised(*args, **kw):  # what fresh device memory may hold: anything
        return real_empty(*args, **kw).fill_(0xA5 if kw.get("dtype") == torch.uint8 else 7)

    monkeypatch.setattr(torch, "empty", uninitialised)
    backend = flashinfer_backend.FlashInferPagedAttention(kv, g, torch.float32)
    monkeypatch.undo()
    ws = backend.workspace
    assert ws.dtype == torch.uint8 and ws.numel() == 1 << 16
    assert not ws.any(), "flashinfer's decode wrapper needs its float workspace zero-initialised"
    assert backend.decode_wrapper.workspace is ws and backend.prefill_wrapper.workspace is ws


@pytest.mark.parametrize("installed", [[], ["flashinfer_jit_cache"]])
def test_prebuilt_kernel_packages_are_reported(monkeypatch, installed):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name in installed else
                        (None if name.startswith("flashinfer_") else real(name, *a)))
    assert flashinfer_backend.prebuilt_kernel_packages() == installed
