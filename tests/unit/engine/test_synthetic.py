"""The synthetic engine: deterministic tokens with no model, honouring every request field the engines honour."""

from __future__ import annotations

import math

import pytest

from services.scheduler.engine.base import EngineRequest, RequestRejected
from services.scheduler.engine.factory import build_engine
from services.scheduler.engine.synthetic import SyntheticEngine, SyntheticVocab
from shared.messages import SamplingParams
from shared.settings import SchedulerSettings

VOCAB = list(range(10, 500))
EOS = 2


class Clock:
    """Records the sleeps a step asks for instead of sleeping."""

    def __init__(self):
        self.sleeps: list[float] = []

    def __call__(self, s: float) -> None:
        self.sleeps.append(s)


def make(eos_ids: frozenset[int] = frozenset(), eos_every: int = 0, **kw) -> SyntheticEngine:
    kw.setdefault("sleep", Clock())
    return SyntheticEngine(SyntheticVocab(VOCAB, 512, frozenset(eos_ids), eos_every), kw.pop("max_context", 256),
                           **kw)


def req(uid: str, max_tokens: int | None = 8, prompt: int = 5, **kw) -> EngineRequest:
    return EngineRequest(uid, list(range(3, 3 + prompt)), SamplingParams(max_tokens=max_tokens, **kw))


def run(eng: SyntheticEngine, limit: int = 10_000) -> dict[tuple[str, int], tuple[list[int], str | None]]:
    """Step until idle: each choice's tokens from here on (checked contiguous) and its finish reason."""
    got: dict[tuple[str, int], tuple[list[int], str | None]] = {}
    first: dict[tuple[str, int], int] = {}
    for _ in range(limit):
        if not eng.has_work():
            return got
        for o in eng.step():
            key = (o.uid, o.index)
            ids, finish = got.get(key, ([], None))
            assert finish is None, f"{o.uid}/{o.index} produced after its end"
            assert o.start == first.setdefault(key, o.start) + len(ids)
            got[key] = (ids + o.ids, o.finish_reason)
    raise AssertionError("engine never went idle")


def test_tokens_are_a_pure_function_of_uid_choice_and_index():
    a, b = make(), make()
    a.add(req("x", 20))
    a.add(req("y", 20))
    b.add(req("y", 20))  # alone, in another order, another engine
    b.add(req("x", 20))
    ra, rb = run(a), run(b)
    assert ra == rb
    assert ra[("x", 0)][0] == a.expected_ids("x", 0, 20)
    assert ra[("x", 0)][0] != ra[("y", 0)][0]
    assert all(t in set(VOCAB) for ids, _ in ra.values() for t in ids)
    assert len(set(ra[("x", 0)][0])) > 10  # spread over the vocabulary


def test_max_tokens_exact_and_omitted_means_the_context_left():
    eng = make(max_context=40)
    assert eng.add(req("a", 7)) == 7
    assert eng.add(req("b", None, prompt=30)) == 10
    out = run(eng)
    assert len(out[("a", 0)][0]) == 7 and out[("a", 0)][1] == "length"
    assert len(out[("b", 0)][0]) == 10 and out[("b", 0)][1] == "length"


def test_never_eos_by_default():
    eng = make(eos_ids={EOS}, max_context=4096)
    assert eng.eos_every == 0
    eng.add(req("a", 3000))
    ids, finish = run(eng)[("a", 0)]
    assert len(ids) == 3000 and finish == "length" and EOS not in ids


def test_eos_every_stops_unless_ignored_and_min_tokens_holds_it():
    eng = make(eos_ids={EOS}, eos_every=4)
    eng.add(req("a", 200))
    eng.add(req("b", 200, ignore_eos=True))
    ids_a, fin_a = run(eng)[("a", 0)]
    assert fin_a == "stop" and ids_a[-1] == EOS and EOS not in ids_a[:-1]
    eng.add(req("b", 200, ignore_eos=True))
    ids_b, fin_b = run(eng)[("b", 0)]
    assert fin_b == "length" and len(ids_b) == 200 and EOS in ids_b
    first = ids_b.index(EOS)
    eng.add(req("b", 200, min_tokens=first + 2))
    ids_m, fin_m = run(eng)[("b", 0)]
    assert fin_m == "stop" and len(ids_m) > first + 1 and EOS in ids_m[:first + 1]


def test_stop_token_ids_stop_at_first_hit_after_min_tokens():
    eng = make()
    stream = eng.expected_ids("s", 0, 50)
    stop = stream[5]
    first = stream.index(stop)
    eng.add(req("s", 50, stop_token_ids=[stop]))
    ids, finish = run(eng)[("s", 0)]
    assert finish == "stop" and ids == stream[:first + 1]
    eng.add(req("s", 50, stop_token_ids=[stop], min_tokens=first + 1 + 1))
    ids, finish = run(eng)[("s", 0)]
    later = [i for i, t in enumerate(stream) if t == stop and i + 1 >= first + 2]
    assert ids == (stream[:later[0] + 1] if later else stream) and finish == ("stop" if later else "length")


def test_n_choices_are_distinct_streams_each_to_its_end():
    eng = make()
    eng.add(req("n", 12, n=3))
    out = run(eng)
    assert sorted(k for k in out if k[0] == "n") == [("n", 0), ("n", 1), ("n", 2)]
    assert all(len(ids) == 12 and f == "length" for ids, f in out.values())
    assert len({tuple(ids) for ids, _ in out.values()}) == 3
    assert out[("n", 2)][0] == eng.expected_ids("n", 2, 12)


def test_abort_running_and_waiting():
    eng = make(max_running=2)
    for u in "abc":
        eng.add(req(u, 100))
    eng.step()
    assert eng.stats()["running"] == 2 and eng.stats()["waiting"] == 1
    assert eng.abort("a") and eng.abort("c") and not eng.abort("zzz")
    out = run(eng)
    assert set(out) == {("b", 0)} and len(out[("b", 0)][0]) == 99
    assert not eng.has_work()


def test_room_is_the_free_running_slots_and_steps_take_step_ms():
    clock = Clock()
    eng = make(max_running=4, step_s=0.02, sleep=clock)
    assert eng.room() == 4
    eng.add(req("a", 3, n=3))
    eng.step()
    assert eng.room() == 1
    eng.add(req("b", 3, n=2))  # one slot: one choice waits
    eng.step()
    assert eng.room() == 0 and eng.stats()["waiting"] == 1
    run(eng)
    assert eng.room() == 4
    assert len(clock.sleeps) == eng.steps and all(0.015 < s <= 0.02 for s in clock.sleeps)
    eng.step()  # nothing runs: no sleep
    assert len(clock.sleeps) == eng.steps


def test_real_sleep_paces_the_steps():
    import time

    eng = SyntheticEngine(SyntheticVocab(VOCAB), 256, step_s=0.01)
    eng.add(req("a", 5))
    t0 = time.perf_counter()
    run(eng)
    assert time.perf_counter() - t0 >= 0.045


def test_logprobs_are_well_formed():
    eng = make()
    eng.add(req("l", 6, logprobs=True, top_logprobs=3))
    eng.add(req("m", 6))
    outs = []
    while eng.has_work():
        outs += eng.step()
    for o in outs:
        if o.uid == "m":
            assert o.logprobs is None and o.top_logprobs is None
            continue
        (lp,), (top,) = o.logprobs, o.top_logprobs
        assert lp < 0 and len(top) == 3 and top[0] == (o.ids[0], lp)
        assert len({t for t, _ in top}) == 3 and all(t in set(VOCAB) for t, _ in top)
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert sum(math.exp(v) for _, v in top) < 1


def test_resumed_request_continues_the_same_stream():
    eng = make()
    full = eng.expected_ids("r", 0, 10)
    eng.add(EngineRequest("r", [5, 6], SamplingParams(max_tokens=10), output_ids=[full[:4]]))
    ids, finish = run(eng)[("r", 0)]
    assert ids == full[4:] and finish == "length"
    eng.add(EngineRequest("r", [5, 6], SamplingParams(max_tokens=4), output_ids=[full[:4]]))
    out = eng.step()  # already at max_tokens: ends without producing
    assert [(o.start, o.ids, o.finish_reason) for o in out] == [(4, [], "length")] and not eng.has_work()


@pytest.mark.parametrize(("kw", "param", "code"), [
    (dict(prompt=0), None, "invalid_request"),
    (dict(prompt=256), None, "context_length_exceeded"),
    (dict(max_tokens=300), "max_tokens", "context_length_exceeded"),
    (dict(max_tokens=0), "max_tokens", "invalid_request"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens", "invalid_request"),
    (dict(max_tokens=None, min_tokens=300), "min_tokens", "context_length_exceeded"),
])
def test_refusals(kw, param, code):
    eng = make()
    with pytest.raises(RequestRejected) as e:
        eng.add(req("bad", **kw))
    assert e.value.param == param and e.value.code == code
    with pytest.raises(RequestRejected):
        eng.add(EngineRequest("big", [600], SamplingParams(max_tokens=2)))
    assert not eng.has_work()


def test_factory_builds_it_from_config_and_tokenizer_without_weights(random_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def no_weights(*a, **k):
        raise AssertionError("the synthetic engine must not load weights")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    eng = build_engine(SchedulerSettings(engine="synthetic", step_ms=0, max_running=7), str(random_model_dir))
    assert isinstance(eng, SyntheticEngine) and eng.max_running == 7 and eng.step_s == 0
    tok = AutoTokenizer.from_pretrained(random_model_dir)
    special = set(tok.all_special_ids)
    assert special and not special & set(eng.vocab) and len(eng.vocab) > 900
    assert eng.stats()["engine"] == "synthetic"
    eng.add(EngineRequest("f", tok.encode("hello world"), SamplingParams(max_tokens=5)))
    assert len(run(eng)[("f", 0)][0]) == 5


def test_it_refuses_what_it_cannot_honour():
    """Random tokens cannot follow a grammar or score a prompt: refused by name, not faked."""
    from shared.messages import Guided

    eng = make()
    for params, param in ((SamplingParams(max_tokens=4, guided=Guided(kind="regex", spec="a+")), "response_format"),
                          (SamplingParams(max_tokens=4, prompt_logprobs=1), "logprobs")):
        with pytest.raises(RequestRejected) as e:
            eng.add(EngineRequest("x", [5, 6], params))
        assert e.value.param == param
    assert not eng.has_work()
