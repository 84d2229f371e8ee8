"""Paged forward logits against transformers' own forward (sdpa, no paging), fp32.

Tolerance: max |Δlogit| <= 1e-4 (observed ~3e-6 at logit scale ~5 with these inits).
"""

from __future__ import annotations

import random

import torch

from services.scheduler.engine.attention import RowSpec
from services.scheduler.engine.attention.torch_backend import TorchPagedAttention
from services.scheduler.engine.kv_cache import SCRATCH_PAGE, KVCache, PagePool, pages_for
from services.scheduler.engine.model_geometry import attention_geometry
from services.scheduler.engine.model_runner import ModelRunner
from tests.unit.engine.util import clone_model, prompts

ATOL = 1e-4
PAGE = 4


def _runner(model, num_pages=128):
    engine_model = clone_model(model)
    kv = KVCache(attention_geometry(engine_model).kv_shape(PAGE), num_pages, torch.float32, "cpu")
    kv._k.fill_(float("nan"))  # never-written memory may hold anything: it must never reach an output
    kv._v.fill_(float("nan"))
    kv.zero_pages([SCRATCH_PAGE])  # as KVCache leaves it
    pool = PagePool(num_pages, shuffle_seed=11, on_alloc=kv.zero_pages)
    return ModelRunner(engine_model, TorchPagedAttention(kv), PAGE), pool


@torch.inference_mode()
def _reference(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def _run_chunks(runner, pool, seqs: list[list[int]], chunk: int) -> list[torch.Tensor]:
    """Prefill every sequence in chunks of at most `chunk` tokens, all sequences in each step."""
    pages = [pool.alloc(pages_for(len(s), PAGE)) for s in seqs]
    done = [0] * len(seqs)
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    while any(d < len(s) for d, s in zip(done, seqs, strict=True)):
        rows, ids, live = [], [], []
        for i, s in enumerate(seqs):
            n = min(chunk, len(s) - done[i])
            if n:
                rows.append((n != 1, i, RowSpec(pages[i], done[i], n)))
        rows.sort(key=lambda r: r[0])  # one-token rows first
        for _, i, row in rows:
            ids.extend(seqs[i][row.start:row.kv_len])
            live.append(i)
        out = runner.forward([r for _, _, r in rows], ids, list(range(len(ids))))
        at = 0
        for _, i, row in rows:
            logits[i].append(out[at:at + row.num_new])
            at += row.num_new
            done[i] += row.num_new
    for p in pages:
        pool.release(p)
    return [torch.cat(x) for x in logits]


def test_packed_prefill_logits_match_every_position(arch_model):
    runner, pool = _runner(arch_model)
    seqs = prompts([3, 17, 40, 8, 25, 1], arch_model.config.vocab_size)
    got = _run_chunks(runner, pool, seqs, chunk=10_000)
    for s, g in zip(seqs, got, strict=True):
        torch.testing.assert_close(g, _reference(arch_model, s), atol=ATOL, rtol=0)


def test_chunked_prefill_logits(arch_model):
    runner, pool = _runner(arch_model)
    seqs = prompts([23, 9, 31], arch_model.config.vocab_size, seed=1)
    got = _run_chunks(runner, pool, seqs, chunk=7)
    for s, g in zip(seqs, got, strict=True):
        torch.testing.assert_close(g, _reference(arch_model, s), atol=ATOL, rtol=0)
    assert pool.available() == pool.usable


def test_decode_logits_in_a_mixed_batch(demo_model):
    """Decodes of some sequences share a step with another's prefill; compare to a full forward."""
    runner, pool = _runner(demo_model)
    vocab = demo_model.config.vocab_size
    seqs = prompts([6, 13, 4], vocab, seed=2)
    newcomer = prompts([11], vocab, seed=3)[0]
    pages = [pool.alloc(pages_for(len(s) + 8, PAGE)) for s in [*seqs, newcomer]]
    rows = [RowSpec(pages[i], 0, len(s)) for i, s in enumerate(seqs)]
    runner.forward(rows, [t for s in seqs for t in s], [])
    rng = random.Random(0)
    for step in range(6):
        rows, ids = [], []
        for i, s in enumerate(seqs):
            s.append(rng.randrange(vocab))  # teacher-forced next token
            rows.append(RowSpec(pages[i], len(s) - 1, 1))
            ids.append(s[-1])
        if step == 2:
            rows.append(RowSpec(pages[3], 0, len(newcomer)))
            ids.extend(newcomer)
        out = runner.forward(rows, ids, list(range(len(seqs))) + ([len(ids) - 1] if step == 2 else []))
        for i, s in enumerate(seqs):
            torch.testing.assert_close(out[i], _reference(demo_model, s)[-1], atol=ATOL, rtol=0)
        if step == 2:
            torch.testing.assert_close(out[-1], _reference(demo_model, newcomer)[-1], atol=ATOL, rtol=0)
