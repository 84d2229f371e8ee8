"""The metadata both attention backends consume, checked on CPU (flashinfer's conventions)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from services.scheduler.engine.attention import RowSpec, build_metadata
from services.scheduler.engine.attention.flashinfer_backend import sub_indptr
from services.scheduler.engine.attention.torch_backend import TorchPagedAttention
from services.scheduler.engine.kv_cache import KVCache, KVShape


def _rows() -> list[RowSpec]:
    return [
        RowSpec([7, 3], 5, 1),  # decode: 6 tokens over 2 pages, new token at position 5
        RowSpec([2], 3, 1),  # decode: fills page 2 exactly
        RowSpec([9, 1, 4], 0, 9),  # fresh prefill crossing two page boundaries
        RowSpec([5, 6], 4, 3),  # chunk after a cached page (prefix hit)
    ]


def test_csr_page_table_and_slots():
    m = build_metadata(_rows(), 4, "cpu")
    assert m.num_decode == 2 and m.num_rows == 4 and m.num_tokens == 14
    assert m.q_lens == [1, 1, 9, 3] and m.kv_lens == [6, 4, 9, 7]
    assert m.qo_indptr.tolist() == [0, 1, 2, 11, 14]
    assert m.kv_indptr.tolist() == [0, 2, 3, 6, 8]
    assert m.kv_indices.tolist() == [7, 3, 2, 9, 1, 4, 5, 6]
    assert m.kv_last_page_len.tolist() == [2, 4, 1, 3]
    assert m.positions.tolist() == [5, 3, *range(9), 4, 5, 6]
    assert m.slot_mapping.tolist() == [3 * 4 + 1, 2 * 4 + 3, 36, 37, 38, 39, 4, 5, 6, 7, 16, 24, 25, 26]
    for t in (m.qo_indptr, m.kv_indptr, m.kv_last_page_len, m.kv_indices):
        assert t.dtype == torch.int32


def test_unused_trailing_pages_are_left_out():
    m = build_metadata([RowSpec([1, 2, 3], 2, 1)], 4, "cpu")  # a page reserved ahead is not attended
    assert m.kv_indices.tolist() == [1] and m.kv_indptr.tolist() == [0, 1] and m.kv_last_page_len.tolist() == [3]


def test_rows_must_be_ordered_decodes_first():
    with pytest.raises(ValueError):
        build_metadata([RowSpec([1], 0, 3), RowSpec([2], 2, 1)], 4, "cpu")


def test_flashinfer_split_matches_torch_parts():
    """The prefill part the flashinfer backend plans is the same rows the torch backend masks."""
    m = build_metadata(_rows(), 4, "cpu")
    nd = m.num_decode
    assert sub_indptr(m.qo_indptr, nd).tolist() == [0, 9, 12]
    kv = sub_indptr(m.kv_indptr, nd)
    assert kv.tolist() == [0, 3, 5]
    assert m.kv_indices[int(m.kv_indptr[nd]):].tolist() == [9, 1, 4, 5, 6]
    cache = KVCache(KVShape(1, 1, 2, 4), 10, torch.float32, "cpu")
    backend = TorchPagedAttention(cache)
    backend.prepare(m)
    dec, pre = m.extra["decode"], m.extra["prefill"]
    assert dec.block_table.tolist() == [[7, 3], [2, 0]] and dec.max_kv == 6
    assert pre.block_table.tolist() == [[9, 1, 4], [5, 6, 0]] and pre.max_kv == 9 and pre.max_q == 9
    # bottom-right causal: the first new token of the chunk row (position 4) sees keys 0..4
    assert pre.mask[1, 0, 0].tolist() == [True] * 5 + [False] * 4
    assert pre.mask[0, 0, 0].tolist() == [True] + [False] * 8
    assert dec.mask[1, 0, 0].tolist() == [True] * 4 + [False] * 2


def test_cpu_engine_never_imports_flashinfer(random_model_dir):
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "from services.scheduler.engine.config import EngineConfig\n"
        "from services.scheduler.engine.paged import PagedEngine\n"
        "from services.scheduler.engine.base import EngineRequest\n"
        "from shared.messages import SamplingParams\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(random_model_dir)!r})\n"
        "e = PagedEngine(m, set(), EngineConfig(num_pages=32))\n"
        "e.add(EngineRequest('a', [1, 2, 3], SamplingParams(max_tokens=2)))\n"
        "while e.has_work(): e.step()\n"
        "assert 'flashinfer' not in sys.modules, 'flashinfer imported on CPU'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=100)
