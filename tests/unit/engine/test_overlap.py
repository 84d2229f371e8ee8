"""Overlapped steps (paged.py) produce exactly what synchronous steps produce, one `step()` call later: the
same tokens, logprobs and finish reasons; EOS, stop tokens, max_tokens, n, aborts and stop-string aborts
honoured within one step; no page, no unresolved token and no result left behind."""

from __future__ import annotations

import json

import pytest

from services.scheduler.engine.base import EngineRequest
from services.scheduler.engine.sequence import UNRESOLVED
from shared.messages import Guided, SamplingParams
from tests.unit.engine.util import clone_model, engine, greedy, prompts, tiny_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


def _drive(eng, arrivals, reactions=None, max_steps=2_000):
    """Step until idle, adding arrivals[k] before call k; `reactions[(uid, index, n)]` runs once the choice has
    delivered n tokens (what the worker does on a stop string or a client's abort). Outputs by choice."""
    reactions = dict(reactions or {})
    got: dict[tuple[str, int], list] = {}
    for call in range(max_steps):
        for req in arrivals.get(call, []):
            eng.add(req)
        if not eng.has_work() and call > max(arrivals, default=-1):
            break
        for o in eng.step():
            key = (o.uid, o.index)
            assert o.start == sum(len(x.ids) for x in got.get(key, [])), "outputs are contiguous"
            assert UNRESOLVED not in o.ids
            got.setdefault(key, []).append(o)
            delivered = sum(len(x.ids) for x in got[key])
            action = reactions.pop((o.uid, o.index, delivered), None)
            if action is not None:
                action(eng)
    else:
        raise AssertionError("engine did not finish")
    assert eng.pool.available() == eng.pool.usable, "every page came back"
    assert not eng.scheduler.running and not eng.scheduler.waiting and not eng.has_work()
    return {k: ([t for o in v for t in o.ids], v[-1].finish_reason, [o.logprobs for o in v],
                [o.top_logprobs for o in v]) for k, v in got.items()}


def _both(model, arrivals, reactions=None, **kw):
    runs = []
    for overlap in (False, True):
        eng = engine(clone_model(model), overlap=overlap, **kw)
        read_on_device = []
        forward = eng.runner.forward

        def spy(rows, ids, sample_idx, device_tokens=None, adapters=None, forward=forward, seen=read_on_device):
            seen.append(device_tokens is not None)
            return forward(rows, ids, sample_idx, device_tokens, adapters)

        eng.runner.forward = spy
        runs.append(_drive(eng, arrivals, reactions))
        assert any(read_on_device) == overlap, "overlapped steps read their inputs from the step in flight"
    return runs


def test_overlap_gives_the_same_outputs(model):
    vocab = model.config.vocab_size
    ps = prompts([9, 30, 5, 17, 12, 40], vocab, seed=11)
    sampled = dict(temperature=0.9, top_p=0.95, ignore_eos=True)
    arrivals = {
        0: [EngineRequest("g", ps[0], greedy(25)),
            EngineRequest("s", ps[1], SamplingParams(max_tokens=20, seed=3, n=3, **sampled))],
        3: [EngineRequest("lp", ps[2], greedy(12, logprobs=True, top_logprobs=3)),
            EngineRequest("pen", ps[3], SamplingParams(max_tokens=15, seed=5, repetition_penalty=1.3,
                                                       frequency_penalty=0.4, **sampled))],
        7: [EngineRequest("min", ps[4], SamplingParams(max_tokens=14, min_tokens=10, temperature=1.0, seed=9)),
            EngineRequest("shared", ps[0][:8] + ps[5], greedy(10))],  # a prefix hit on g's first pages
    }
    sync, overlapped = _both(model, arrivals, page_size=4, num_pages=48, max_running=6, prefill_budget=16)
    assert overlapped == sync
    assert len(sync) == 8 and all(reason == "length" for _, reason, *_ in sync.values())


def test_eos_and_stop_tokens_stop_within_one_step(model):
    vocab = model.config.vocab_size
    ps = prompts([10, 14], vocab, seed=12)
    ref = _drive(engine(clone_model(model)), {0: [EngineRequest("a", ps[0], greedy(30)),
                                                  EngineRequest("b", ps[1], greedy(30))]})
    eos, stop = ref[("a", 0)][0][6], ref[("b", 0)][0][4]  # tokens the model produces: they end the texts
    arrivals = {0: [EngineRequest("a", ps[0], SamplingParams(max_tokens=30, temperature=0.0)),
                    EngineRequest("b", ps[1], SamplingParams(max_tokens=30, temperature=0.0,
                                                             stop_token_ids=[stop]))]}
    sync, overlapped = _both(model, arrivals, eos={eos} - {stop})
    assert overlapped == sync
    assert sync[("a", 0)][1] == "stop" and sync[("a", 0)][0][-1] == eos
    assert sync[("b", 0)][1] == "stop" and sync[("b", 0)][0][-1] == stop


def test_aborts_and_stop_strings_take_effect_within_one_step(model):
    vocab = model.config.vocab_size
    ps = prompts([8, 11, 6], vocab, seed=13)
    arrivals = {0: [EngineRequest("a", ps[0], greedy(40)), EngineRequest("n", ps[1], greedy(40, n=2)),
                    EngineRequest("w", ps[2], greedy(40))]}
    reactions = {("a", 0, 5): lambda e: e.abort("a"),  # the client went away after 5 tokens
                 ("n", 1, 3): lambda e: e.abort("n", 1),  # a stop string ended choice 1 after 3 tokens
                 ("w", 0, 2): lambda e: e.abort("w")}
    sync, overlapped = _both(model, arrivals, reactions, max_running=4)
    assert overlapped == sync
    assert len(sync[("a", 0)][0]) == 5 and len(sync[("n", 1)][0]) == 3 and len(sync[("w", 0)][0]) == 2
    assert len(sync[("n", 0)][0]) == 40


def test_preemption_withdraws_tokens_in_flight(model):
    """A pool too small for every sequence: preempted sequences drop their in-flight token and sample it again
    after recomputing, greedy and seeded alike."""
    vocab = model.config.vocab_size
    ps = prompts([10, 14, 9, 12, 11, 13], vocab, seed=14)
    reqs = [EngineRequest(f"r{i}", p, greedy(24) if i % 2 else SamplingParams(max_tokens=24, temperature=1.0,
                                                                             seed=i, ignore_eos=True))
            for i, p in enumerate(ps)]
    runs = []
    for overlap in (False, True):
        eng = engine(clone_model(model), overlap=overlap, num_pages=22, page_size=4)
        runs.append(_drive(eng, {0: reqs}))
        assert eng.stats()["preemptions"] > 0
    assert runs[0] == runs[1]


def test_grammar_rows_wait_for_their_token(demo_model, random_model_dir):
    """A constrained row's mask needs the tokens so far on the host: its steps do not overlap, and the text
    is what synchronous steps produce."""
    from transformers import AutoTokenizer

    from services.scheduler.engine.grammar import GrammarCache

    tok = AutoTokenizer.from_pretrained(random_model_dir)
    eos = {tok.convert_tokens_to_ids("<|im_end|>")}
    schema = {"type": "object", "properties": {"c": {"enum": ["red", "green", "blue"]}}, "required": ["c"],
              "additionalProperties": False}
    guided = Guided("json_schema", json.dumps(schema))
    runs = []
    for overlap in (False, True):
        eng = engine(clone_model(demo_model), eos=eos, overlap=overlap, num_pages=128)
        eng.grammars = GrammarCache(str(random_model_dir), demo_model.config.vocab_size, eos)
        ids = tok("Hi")["input_ids"]
        arrivals = {0: [EngineRequest("j", ids, SamplingParams(max_tokens=40, temperature=1.0, seed=2, guided=guided)),
                        EngineRequest("free", ids, SamplingParams(max_tokens=30, temperature=1.0, seed=4))]}
        runs.append(_drive(eng, arrivals))
        eng.close()
    assert runs[0] == runs[1]
    text = tok.decode([t for t in runs[1][("j", 0)][0] if t not in eos])
    assert runs[1][("j", 0)][1] == "stop" and json.loads(text)["c"] in ("red", "green", "blue")
