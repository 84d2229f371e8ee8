"""Structured outputs in the paged engine: grammar-constrained choices next to free ones, n > 1, replay
after a crash or preemption, `after` (the grammar starts past a reasoning model's </think>), priority."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import msgspec
import pytest

from services.scheduler.engine.base import EngineRequest
from services.scheduler.engine.grammar import GrammarCache
from shared.grammars import check
from shared.messages import Guided, SamplingParams
from tests.unit.engine.util import clone_model, drain, engine, tokens

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{2,6} [0-9]{1,3}"


@pytest.fixture(scope="module")
def tok(random_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(random_model_dir)


@pytest.fixture(scope="module")
def eng(demo_model, random_model_dir, tok):
    model = clone_model(demo_model)
    eos = {tok.convert_tokens_to_ids("<|im_end|>")}
    e = engine(model, eos=eos, num_pages=128)
    e.grammars = GrammarCache(str(random_model_dir), model.config.vocab_size, eos)
    yield e
    e.close()


def sampled(max_tokens: int, guided: Guided | None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=kw.pop("seed", 1), guided=guided, **kw)


def text_of(tok, ids: list[int], eos: int) -> str:
    return tok.decode([t for t in ids if t != eos])


def test_constrained_and_free_requests_share_a_batch(eng, tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    schema = Guided("json_schema", json.dumps(SCHEMA))
    reqs = [EngineRequest(f"j{i}", tok("Hi")["input_ids"], sampled(120, schema, seed=i, n=2)) for i in range(4)]
    reqs += [EngineRequest("re", tok("Go")["input_ids"], sampled(40, Guided("regex", REGEX)))]
    reqs += [EngineRequest(f"free{i}", tok("Hi")["input_ids"], sampled(30, None, seed=i)) for i in range(3)]
    out = drain(eng, {0: reqs})
    stopped = 0
    for i in range(4):
        for c in range(2):
            outs = out[(f"j{i}", c)]
            if outs[-1].finish_reason == "stop":
                stopped += 1
                jsonschema.validate(json.loads(text_of(tok, tokens(outs), eos)), SCHEMA)
    assert stopped >= 4, "too few constrained answers finished"
    assert out[("re", 0)][-1].finish_reason == "stop"
    assert re.fullmatch(REGEX, text_of(tok, tokens(out[("re", 0)]), eos))
    free = "".join(text_of(tok, tokens(out[(f"free{i}", 0)]), eos) for i in range(3))
    assert not free.lstrip().startswith("{")  # nothing leaked into unconstrained rows
    assert eng.pool.available() == eng.pool.usable


def test_a_resumed_request_replays_its_tokens_into_the_matcher(eng, tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    guided = Guided("regex", r"\{\"n\": [0-9]{1,4}, \"w\": \"[a-z]{1,8}\"\}")
    prompt = tok("Go")["input_ids"]
    full = tokens(drain(eng, {0: [EngineRequest("a", prompt, sampled(60, guided, seed=3))]})[("a", 0)])
    cut = len(full) // 2
    resumed = drain(eng, {0: [EngineRequest("b", prompt, sampled(60, guided, seed=3), [full[:cut]])]})
    tail = [t for o in resumed[("b", 0)] for t in o.ids]
    assert resumed[("b", 0)][0].start == cut and full[:cut] + tail == full  # same seed and grammar state
    assert re.fullmatch(r"\{\"n\": [0-9]{1,4}, \"w\": \"[a-z]{1,8}\"\}", text_of(tok, full, eos))


def test_grammar_applies_only_after_the_marker(eng, tok):
    """With `after` the tokens before it are free: a bias makes the marker the first token, then the
    grammar holds; without `after`, the grammar refuses the marker itself."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    end_think = tok.convert_tokens_to_ids("</think>")
    bias = {end_think: 100.0}
    after = Guided("regex", "[0-9]{3}", after=[end_think])
    out = drain(eng, {0: [EngineRequest("t", tok("Go")["input_ids"], sampled(20, after, logit_bias=bias)),
                          EngineRequest("u", tok("Go")["input_ids"], sampled(20, Guided("regex", "[0-9]{3}"),
                                                                            logit_bias=bias))]})
    ids = tokens(out[("t", 0)])
    assert ids[0] == end_think and re.fullmatch("[0-9]{3}", text_of(tok, ids[1:], eos))
    assert end_think not in tokens(out[("u", 0)])


def test_bad_grammars_are_refused_with_the_reason():
    assert "strin" in check(Guided("json_schema", '{"type": "strin"}'))
    assert "unclosed" in check(Guided("regex", "[a-"))
    assert check(Guided("ebnf", 'root ::= "a" | "b"')) is None
    assert check(Guided("json_schema", json.dumps(SCHEMA))) is None


def test_a_compiling_grammar_does_not_hold_back_other_requests(eng, tok):
    """While a new grammar is being prepared, free requests still step; the constrained one waits."""
    gate = eng.grammars._executor.submit(time.sleep, 0.5)  # the grammar thread is busy
    guided = Guided("regex", "[a-z]{4}")
    eng.add(EngineRequest("slow", tok("Go")["input_ids"], sampled(8, guided)))
    eng.add(EngineRequest("fast", tok("Go")["input_ids"], sampled(8, None)))
    produced: dict[str, int] = {}
    while not gate.done():
        for o in eng.step():
            produced[o.uid] = produced.get(o.uid, 0) + len(o.ids)
    assert produced.get("fast") == 8 and "slow" not in produced
    rest = drain(eng)
    assert rest[("slow", 0)][-1].finish_reason == "stop"


def test_priority_orders_admission(demo_model, tok):
    eng = engine(clone_model(demo_model), max_running=1)
    low = [EngineRequest(f"l{i}", tok("Go")["input_ids"], sampled(2, None), priority=5) for i in range(2)]
    high = EngineRequest("h", tok("Go")["input_ids"], sampled(2, None), priority=-1)
    order = []
    for req in [*low, high]:
        eng.add(req)
    while eng.has_work():
        order += [o.uid for o in eng.step() if o.finish_reason]
    assert order == ["h", "l0", "l1"]


def test_a_reasoning_model_may_think_before_a_constrained_answer(eng, tok):
    """With `think`, the first token may open the thinking (free until `after`) or start the answer;
    the mask admits exactly that."""
    import torch

    from services.scheduler.engine.grammar import SeqGrammar, apply_masks

    start, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    prepared = eng.grammars.get(Guided("regex", "[0-9]{3}")).result()
    digit = tok.convert_tokens_to_ids("7")
    g = SeqGrammar(prepared, [end], [], think=start)
    logits = torch.zeros(2, eng.runner.vocab_size)
    apply_masks(logits, [None, g])
    allowed = set(torch.nonzero(logits[1] == 0).flatten().tolist())
    assert start in allowed and digit in allowed and end not in allowed and (logits[0] == 0).all()
    thinking = [start, *tok("so hmm", add_special_tokens=False)["input_ids"], end]
    for k in range(len(thinking)):
        assert g.accept(thinking[:k + 1]) and g.active == (k == len(thinking) - 1)
    assert g.accept([*thinking, digit]) and not g.accept([*thinking, digit, start])  # constrained now
    direct = SeqGrammar(prepared, [end], [digit], think=start)  # answered at once: constrained from token 1
    assert direct.active and not direct.may_open_thinking


BOMB = "(a{1000}){1000}"  # 15 bytes: llguidance's default limits took 1-5 s for its first mask


def test_the_tokenizers_check_refuses_a_grammar_bomb_within_the_limits():
    started = time.thread_time()
    problem = check(Guided("regex", BOMB))
    assert problem and "too many expressions" in problem, problem
    assert time.thread_time() - started < 2.0  # ~0.2 s of CPU here
    assert check(Guided("regex", "(a{100}){100}")) is None  # large, and within them
    assert check(Guided("lark", 'start: <tool_call> "x"')) is None  # special tokens: not probed over bytes


def test_a_grammar_bomb_fails_in_the_grammar_thread_as_a_400_and_the_batch_keeps_stepping(demo_model, random_model_dir,
                                                                                         tok):
    """Its first mask is computed when the grammar is prepared, off the step thread: it fails there as the
    request's error (400 naming its field) while a free request's steps go on, short."""
    eos = {tok.convert_tokens_to_ids("<|im_end|>")}
    e = engine(clone_model(demo_model), eos=eos, num_pages=128)
    e.grammars = GrammarCache(str(random_model_dir), demo_model.config.vocab_size, eos)
    prepare, prepared = e.grammars._prepare, threading.Event()
    e.grammars._prepare = lambda guided: prepared.wait(30) and prepare(guided)  # held until the test says
    try:
        e.add(EngineRequest("free", tok("Go")["input_ids"], sampled(400, None, ignore_eos=True)))
        e.add(EngineRequest("bomb", tok("Go")["input_ids"], sampled(8, Guided("regex", BOMB, param="regex"))))
        out, longest = {}, 0.0
        while e.has_work():
            if len(out.get("free", ())) == 20:  # the free request stepped on while the bomb's grammar was held
                assert "bomb" not in out
                prepared.set()
            began = time.thread_time()  # the step thread's CPU, which other busy processes do not stretch
            for o in e.step():
                out.setdefault(o.uid, []).append(o)
            longest = max(longest, time.thread_time() - began)
        [failed] = out["bomb"]
        assert failed.finish_reason == "error" and failed.error_status == 400 and failed.error_param == "regex"
        # past llguidance's limits, or its copy's first mask past the step's budget: the client's grammar at fault
        assert "`regex`" in failed.error and ("too many expressions" in failed.error
                                              or "too expensive" in failed.error), failed.error
        assert len(tokens(out["free"])) == 400
        assert longest < 1.0, f"a step took {longest:.2f} s of CPU"  # no mask of the bomb's computed in it
    finally:
        prepared.set()
        e.close()


def test_a_mask_over_the_step_budget_fails_its_request_not_the_batch(eng, tok):
    """Past the grammar thread's check, every step bounds each constrained choice's mask by CPU time: one over
    the budget fails its request with a 400 after that step; the others in the batch go on."""
    from services.scheduler.engine.grammar import Prepared, SeqGrammar, apply_masks

    guided = Guided("regex", "[a-z]{2,40}")
    prepared = eng.grammars.get(guided).result()
    cheap = SeqGrammar(prepared, [], [])
    costly = SeqGrammar(Prepared(prepared.matcher, prepared.specials, budget_s=0.0), [], [])
    import torch

    logits = torch.zeros(2, eng.runner.vocab_size)
    apply_masks(logits, [cheap, costly])
    assert not cheap.failure and "too expensive" in costly.failure and "0 ms a step allows" in costly.failure
    allowed = int(torch.isfinite(logits[0]).to(torch.int8).argmax())
    assert cheap.accept([allowed]) and not costly.accept([allowed])
    assert costly.refusal == costly.failure
    # in the engine: a budget no mask fits fails the constrained request with a 400 at its first step
    budget, eng.grammars.budget_s = eng.grammars.budget_s, 0.0
    try:
        out = drain(eng, {0: [EngineRequest("over", tok("Go")["input_ids"], sampled(8, Guided("regex", "[0-9]{5}"))),
                              EngineRequest("ok", tok("Go")["input_ids"], sampled(8, None))]})
    finally:
        eng.grammars.budget_s = budget
    [failed] = out[("over", 0)]
    assert failed.error_status == 400 and "too expensive" in failed.error
    assert len(tokens(out[("ok", 0)])) == 8 or out[("ok", 0)][-1].finish_reason == "stop"


def test_grammar_caches_are_bounded_by_bytes(random_model_dir):
    """Both caches keyed by spec text (the tokenizer's checks, the engine's prepared grammars) drop entries
    past a byte budget, not only past a count: a spec can be as large as a request body."""
    from services.scheduler.engine import grammar as engine_grammar
    from shared import grammars

    big = Guided("json_schema", json.dumps({"type": "object", "description": "x" * (4 * 2**20)}))
    for _ in range(12):  # 48 MiB of specs through a cache of 32 MiB
        check(msgspec.structs.replace(big, spec=big.spec.replace("x", "y", 1) + " " * _))
    assert grammars._checked.bytes <= grammars.CHECK_CACHE_BYTES and len(grammars._checked) <= 8
    cache = GrammarCache(str(random_model_dir), 1030, {0})
    try:
        for k in range(20):  # 80 MiB through a cache of 64 MiB
            cache.get(msgspec.structs.replace(big, spec=big.spec + " " * k))
        assert cache._prepared.bytes <= engine_grammar.CACHE_BYTES and len(cache._prepared) <= 16
    finally:
        cache.close()
