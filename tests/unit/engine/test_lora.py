"""LoRA adapters in the paged engine (lora.py) on the demo model, fp32: random PEFT adapters of rank 8 and 16 on
different target modules give transformers' greedy output on the adapter merged into the base; the base and
several adapters mixed in one step give each one's output alone; more adapters in use than slots all complete;
bad folders are refused with the reason and never stop the step loop; the prefix cache is per adapter."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from services.scheduler.engine.base import EngineRequest, RequestRejected
from services.scheduler.engine.lora_weights import AdapterFolders, stack_bytes
from shared.messages import SamplingParams
from shared.pages import adapter_root, chain_digest, extend_digests
from tests.unit.engine.util import clone_model, drain, engine, greedy, hf_greedy, make_adapter, prompts, tokens

pytestmark = pytest.mark.timeout(300)

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SPECS = {  # name -> LoraConfig arguments
    "sql": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "chat": dict(r=16, lora_alpha=32, target_modules=ALL),
    "mlp": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "kv": dict(r=8, lora_alpha=8, target_modules=["k_proj", "o_proj"], layers_to_transform=[1, 3]),
}
N = 10  # tokens per request


@pytest.fixture(scope="module")
def adapters(demo_model, tmp_path_factory):
    """name -> (folder, merged reference model)."""
    root = tmp_path_factory.mktemp("adapters")
    return {name: (root / name, make_adapter(demo_model, root / name, seed=k, **spec))
            for k, (name, spec) in enumerate(SPECS.items())}


@pytest.fixture(scope="module")
def source(adapters):
    return AdapterFolders({name: folder for name, (folder, _) in adapters.items()})


@pytest.fixture(scope="module")
def ps(demo_model):
    return prompts([13, 37, 6], demo_model.config.vocab_size, seed=21)  # 37: chunked at the 32-token budget


@pytest.fixture(scope="module")
def reference(demo_model, adapters, ps):
    """(adapter or None, prompt index) -> transformers' greedy tokens."""
    ref = {(None, i): hf_greedy(demo_model, p, N) for i, p in enumerate(ps)}
    for name, (_, merged) in adapters.items():
        ref.update({(name, i): hf_greedy(merged, p, N) for i, p in enumerate(ps)})
    return ref


def _engine(demo_model, source, **kw):
    kw.setdefault("max_loras", 4)
    return engine(clone_model(demo_model), adapters=source, **kw)


def _req(uid, prompt, adapter=None, n=N, **kw):
    return EngineRequest(uid, prompt, greedy(n, **kw), adapter=adapter)


def _check_idle(eng):
    assert eng.pool.available() == eng.pool.usable, "every page came back"
    assert not eng.has_work()
    for module in (m for ms in eng.lora.layout.modules.values() for m in ms):
        assert "forward" not in module.__dict__, "projections run their own forward between LoRA steps"


def test_each_adapter_matches_transformers_on_the_merged_model(demo_model, source, ps, reference):
    eng = _engine(demo_model, source)
    for adapter in [None, *SPECS]:
        for i, p in enumerate(ps):
            out = drain(eng, {0: [_req(f"{adapter}-{i}", p, adapter)]})
            assert tokens(out[(f"{adapter}-{i}", 0)]) == reference[(adapter, i)], (adapter, i)
    _check_idle(eng)
    for name in SPECS:  # a meaningful comparison: every adapter changes the output
        assert reference[(name, 1)] != reference[(None, 1)], name
    stats = eng.stats()
    assert stats["lora_loads"] == 4 and stats["lora_evictions"] == 0 and stats["lora_resident"] == 4
    assert sorted(eng.resident_adapters()) == sorted(SPECS) == sorted(stats["lora_adapters"])


@pytest.mark.parametrize("overlap", [False, True])
def test_a_batch_mixing_the_base_and_three_adapters_gives_each_alone(demo_model, source, ps, reference, overlap):
    eng = _engine(demo_model, source, overlap=overlap)
    steps = []
    batch_of = eng.lora.step_batch

    def spy(slots, q_lens):
        steps.append(list(slots))
        return batch_of(slots, q_lens)

    eng.lora.step_batch = spy
    arrivals = {0: [_req("b0", ps[0]), _req("sql0", ps[0], "sql"), _req("chat1", ps[1], "chat")],
                1: [_req("mlp2", ps[2], "mlp"), _req("b1", ps[1])],
                3: [EngineRequest("chat0", ps[0], greedy(N, n=2), adapter="chat"), _req("sql2", ps[2], "sql")]}
    out = drain(eng, arrivals)
    want = {"b0": (None, 0), "b1": (None, 1), "sql0": ("sql", 0), "sql2": ("sql", 2), "chat1": ("chat", 1),
            "mlp2": ("mlp", 2), "chat0": ("chat", 0)}
    for uid, key in want.items():
        assert tokens(out[(uid, 0)]) == reference[key], uid
    assert tokens(out[("chat0", 1)]) == reference[("chat", 0)], "a forked choice keeps its adapter"
    mixed = [s for s in steps if 0 in s and len(set(s) - {0}) >= 3]
    assert mixed, f"some step ran the base and three adapters together: {steps}"
    _check_idle(eng)


def test_more_adapters_in_use_than_slots_all_complete(demo_model, source, ps, reference):
    eng = _engine(demo_model, source, max_loras=2)
    arrivals = {0: [_req(f"{name}-{i}", ps[i], name) for name in SPECS for i in (0, 1)] +
                   [_req("base-2", ps[2])]}
    for req in arrivals[0]:
        eng.add(req)
    out: dict = {}
    for _ in range(2000):
        if not eng.has_work():
            break
        for o in eng.step():
            out.setdefault((o.uid, o.index), []).append(o)
        lora = eng.lora
        for seq in list(eng.scheduler.running) + list(eng.scheduler.waiting):
            if seq.adapter_slot:  # a bound sequence's slot holds its adapter, always
                assert lora.slots[seq.adapter_slot].name == seq.req.adapter
        assert len(lora.resident()) <= 2
    for name in SPECS:
        for i in (0, 1):
            assert tokens(out[(f"{name}-{i}", 0)]) == reference[(name, i)], (name, i)
    assert tokens(out[("base-2", 0)]) == reference[(None, 2)]
    stats = eng.stats()
    assert stats["lora_loads"] >= 4 and stats["lora_evictions"] >= 2, stats
    _check_idle(eng)


def test_an_adapter_in_steady_use_does_not_starve_another(demo_model, source, ps, reference):
    """One slot; a request for `sql` arrives every step for 60 steps and `chat` is asked for at step 2: its
    request completes while `sql` requests keep coming (the busy slot is drained for it), and so do they all."""
    eng = _engine(demo_model, source, max_loras=1, max_running=4)
    arrivals = {k: [_req(f"sql-{k}", ps[0], "sql", n=4)] for k in range(60)}
    arrivals[2].append(_req("chat", ps[2], "chat"))
    done_at: dict[str, int] = {}
    out: dict = {}
    for step in range(3000):
        for req in arrivals.get(step, []):
            eng.add(req)
        if not eng.has_work() and step >= 60:
            break
        for o in eng.step():
            out.setdefault(o.uid, []).append(o)
            if o.finish_reason:
                done_at[o.uid] = step
    assert done_at["chat"] < 60, f"chat finished at step {done_at['chat']}, after every sql request had arrived"
    assert tokens(out["chat"]) == reference[("chat", 2)]
    assert all(tokens(out[f"sql-{k}"]) == reference[("sql", 0)][:4] for k in range(60))
    assert eng.stats()["lora_evictions"] >= 2


class GatedSource(AdapterFolders):
    """Folders whose fetch blocks until `gate` is set (a slow download), or raises `error` once."""

    def __init__(self, folders):
        super().__init__(folders)
        self.gate = threading.Event()
        self.error: Exception | None = None
        self.fetches = 0

    def fetch(self, name):
        self.fetches += 1
        assert self.gate.wait(30), "the test never opened the gate"
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return super().fetch(name)


def test_a_loading_adapter_does_not_stop_the_step_loop(demo_model, adapters, ps, reference):
    source = GatedSource({"chat": adapters["chat"][0]})
    eng = _engine(demo_model, source)
    eng.add(_req("chat", ps[1], "chat"))
    eng.add(_req("base", ps[0]))
    out = {}
    for _ in range(200):  # the base request runs to its end while the adapter's fetch blocks
        for o in eng.step():
            out.setdefault(o.uid, []).append(o)
        if "base" in out and out["base"][-1].finish_reason:
            break
    assert tokens(out["base"]) == reference[(None, 0)] and "chat" not in out
    assert eng.stats()["lora_loading"] == 1 and eng.stats()["waiting"] == 1
    assert eng.room() > 0, "a request waiting for its adapter does not close admission"
    source.gate.set()
    rest = drain(eng)
    assert tokens(rest[("chat", 0)]) == reference[("chat", 1)]
    _check_idle(eng)


def test_an_abort_while_the_adapter_loads_leaves_nothing(demo_model, adapters, ps):
    source = GatedSource({"chat": adapters["chat"][0]})
    eng = _engine(demo_model, source)
    eng.add(_req("chat", ps[1], "chat"))
    eng.step()
    assert eng.abort("chat")
    source.gate.set()
    assert drain(eng) == {}
    eng.step()
    assert eng.lora.entries == {} and eng.stats()["lora_loads"] == 0
    _check_idle(eng)


def test_a_storage_failure_fails_the_request_and_a_later_one_loads(demo_model, adapters, ps, reference):
    source = GatedSource({"chat": adapters["chat"][0]})
    source.error = OSError("storage unreachable")
    source.gate.set()
    eng = _engine(demo_model, source)
    eng.add(_req("first", ps[1], "chat"))
    out = drain(eng)
    (last,) = out[("first", 0)]
    assert last.finish_reason == "error" and "could not be loaded" in last.error and "unreachable" in last.error
    assert last.error_status == 500
    eng.add(_req("second", ps[1], "chat"))  # not remembered as bad: tried again
    assert tokens(drain(eng)[("second", 0)]) == reference[("chat", 1)]
    assert source.fetches == 2


def _bad_rank(demo_model, folder):
    make_adapter(demo_model, folder, seed=9, r=32, target_modules=["q_proj"])


def _missing_weights(demo_model, folder):
    make_adapter(demo_model, folder, seed=9, r=8, target_modules=["q_proj"])
    (folder / "adapter_model.safetensors").unlink()


def _other_model(demo_model, folder):
    from tests.unit.engine.util import tiny_model

    make_adapter(tiny_model("qwen3"), folder, seed=9, r=8, target_modules=["q_proj"])


def _lm_head(demo_model, folder):
    make_adapter(demo_model, folder, seed=9, r=8, target_modules=["lm_head"])


def _not_finite(demo_model, folder):
    from safetensors.torch import load_file, save_file

    make_adapter(demo_model, folder, seed=9, r=8, target_modules=["v_proj"])
    path = folder / "adapter_model.safetensors"
    weights = load_file(path)
    next(iter(weights.values()))[0, 0] = float("nan")
    save_file(weights, path)


def _int_weights(demo_model, folder):
    from safetensors.torch import load_file, save_file

    make_adapter(demo_model, folder, seed=9, r=8, target_modules=["v_proj"])
    path = folder / "adapter_model.safetensors"
    save_file({k: v.to(torch.int32) for k, v in load_file(path).items()}, path)


def _not_json(demo_model, folder):
    make_adapter(demo_model, folder, seed=9, r=8, target_modules=["q_proj"])
    (folder / "adapter_config.json").write_text("{not json")


def _dora(demo_model, folder):
    make_adapter(demo_model, folder, seed=9, r=8, target_modules=["q_proj"], use_dora=True)


def _prompt_tuning(demo_model, folder):
    make_adapter(demo_model, folder, seed=9, r=8, target_modules=["q_proj"])
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "PROMPT_TUNING"}))


def _no_folder(demo_model, folder):
    pass


@pytest.mark.parametrize("make, why", [
    (_bad_rank, "rank 32 exceeds --max-lora-rank 16"),
    (_missing_weights, "adapter_model.safetensors is missing"),
    (_other_model, "has shape"),
    (_lm_head, "target_modules ['lm_head']"),
    (_not_finite, "not all finite"),
    (_int_weights, "weights must be F32, F16 or BF16"),
    (_not_json, "is not JSON"),
    (_dora, "use_dora"),
    (_prompt_tuning, "only LORA adapters"),
    (_no_folder, "no adapter folder"),
])
def test_a_bad_folder_fails_its_request_then_is_refused_at_add(demo_model, tmp_path, ps, reference, make, why):
    folder = tmp_path / "bad"
    make(demo_model, folder)
    eng = _engine(demo_model, AdapterFolders({"bad": folder}))
    out = drain(eng, {0: [_req("bad", ps[0], "bad"), _req("base", ps[0])]})
    (failed,) = out[("bad", 0)]
    assert failed.finish_reason == "error" and why in failed.error and "LoRA adapter 'bad'" in failed.error
    assert failed.error_status == 400 and failed.error_param == "model", "the client's folder: a 400"
    assert tokens(out[("base", 0)]) == reference[(None, 0)], "the step loop went on"
    with pytest.raises(RequestRejected, match="cannot be used") as e:
        eng.add(_req("again", ps[0], "bad"))
    assert e.value.code == "invalid_lora_adapter" and e.value.param == "model" and why in str(e.value)
    assert eng.stats()["lora_loads"] == 0
    assert eng.evict_adapter("bad"), "an unload forgets the verdict"
    eng.add(_req("retried", ps[0], "bad"))
    assert drain(eng)[("retried", 0)][-1].finish_reason == "error"
    _check_idle(eng)


def test_an_adapter_unregistered_while_its_request_waits_is_a_404(demo_model, adapters, ps):
    source = GatedSource({"chat": adapters["chat"][0]})
    source.error = KeyError("chat")  # the registry forgot it before the loader fetched it
    eng = _engine(demo_model, source)
    eng.add(_req("waits", ps[1], "chat"))
    source.gate.set()
    (last,) = drain(eng)[("waits", 0)]
    assert last.finish_reason == "error" and last.error_status == 404 and last.error_param == "model"
    assert "no LoRA adapter named 'chat'" in last.error
    _check_idle(eng)


def test_unknown_adapters_are_refused_at_add(demo_model, source, ps):
    eng = _engine(demo_model, source)
    with pytest.raises(RequestRejected, match="no LoRA adapter named 'nope'") as e:
        eng.add(_req("x", ps[0], "nope"))
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(RequestRejected, match="1 to 256 characters"):
        eng.add(_req("x", ps[0], "a" * 257))
    off = engine(clone_model(demo_model))
    with pytest.raises(RequestRejected, match="--max-loras is 0") as e:
        off.add(_req("x", ps[0], "sql"))
    assert e.value.code == "model_not_found"
    assert not eng.has_work() and not off.has_work()


def test_the_prefix_cache_is_per_adapter(demo_model, source, ps, reference):
    eng = _engine(demo_model, source)
    prompt = ps[1]  # 37 tokens: 9 full pages of 4
    hits = []
    for uid, adapter in (("base", None), ("sql", "sql"), ("chat", "chat"), ("sql-again", "sql"),
                         ("base-again", None)):
        before = eng.stats()["prefix_hit_tokens"]
        out = drain(eng, {0: [_req(uid, prompt, adapter)]})
        assert tokens(out[(uid, 0)]) == reference[(adapter, 1)], uid
        hits.append(eng.stats()["prefix_hit_tokens"] - before)
    assert hits[:3] == [0, 0, 0], "the same prompt under another adapter shares no page"
    assert hits[3] > 0 and hits[4] > 0, "the same prompt under the same adapter does"
    held = set(eng.prefix_digests())
    for root in (b"", adapter_root("sql"), adapter_root("chat")):
        digests: list[bytes] = []
        extend_digests(digests, prompt, 4, 9, root)
        assert digests[0] in held
    base_digests: list[bytes] = []
    extend_digests(base_digests, prompt, 4, 9)
    assert base_digests[0] == chain_digest(b"", prompt[:4]), "base digests are what they were (prefix routing)"


def test_a_resumed_request_reloads_its_adapter(demo_model, source, ps, reference):
    eng = _engine(demo_model, source)
    ref = reference[("chat", 0)]
    req = EngineRequest("resumed", ps[0], greedy(N), output_ids=[ref[:4]], adapter="chat")
    out = drain(eng, {0: [req]})
    outs = out[("resumed", 0)]
    assert outs[0].start == 4 and [t for o in outs for t in o.ids] == ref[4:]
    assert eng.stats()["lora_loads"] == 1


def test_base_only_steps_run_no_lora_op(demo_model, source, ps):
    with_lora = _engine(demo_model, source)
    calls = []
    with_lora.lora.step_batch = lambda *a: calls.append(a)
    without = engine(clone_model(demo_model))
    arrivals = {0: [EngineRequest("s", ps[1], SamplingParams(max_tokens=N, temperature=0.8, seed=4, logprobs=True))],
                1: [_req("g", ps[0])]}
    a, b = drain(with_lora, arrivals), drain(without, arrivals)
    assert not calls, "a step without adapter rows runs no LoRA op"
    assert {k: [(o.ids, o.logprobs) for o in v] for k, v in a.items()} == \
        {k: [(o.ids, o.logprobs) for o in v] for k, v in b.items()}


def test_evict_adapter_unloads_and_a_new_request_reloads(demo_model, source, ps, reference):
    eng = _engine(demo_model, source, max_loras=2)
    drain(eng, {0: [_req("a", ps[0], "sql"), _req("b", ps[0], "chat")]})
    assert sorted(eng.resident_adapters()) == ["chat", "sql"]
    eng.add(_req("running", ps[1], "sql"))
    eng.step()
    assert eng.evict_adapter("sql") and eng.resident_adapters() == ["chat"]
    assert not eng.evict_adapter("never-loaded")
    eng.add(_req("after", ps[2], "sql"))  # loads anew, into the other slot once `chat` is idle
    out = drain(eng)
    assert tokens(out[("running", 0)]) == reference[("sql", 1)], "a sequence bound before the unload finishes"
    assert tokens(out[("after", 0)]) == reference[("sql", 2)]
    # the new `sql` took the idle `chat` slot; the unloaded one's slot is free once `running` ended
    assert eng.stats()["lora_loads"] == 3 and eng.stats()["lora_evictions"] == 1
    assert eng.resident_adapters() == ["sql"]


def test_slot_memory_is_what_the_stacks_take(demo_model, source):
    eng = _engine(demo_model, source, max_loras=3, max_lora_rank=12)  # rank padded to 16
    stacks = sum(t.nbytes for t in [*eng.lora.stacks.a.values(), *eng.lora.stacks.b.values()])
    assert stacks == eng.lora.stacks.nbytes == stack_bytes(eng.lora.layout, 3, 12, torch.float32)
    cfg = demo_model.config
    per_layer = (cfg.hidden_size * 3 + cfg.num_attention_heads * cfg.head_dim * 2 +
                 cfg.num_key_value_heads * cfg.head_dim * 4 + (cfg.hidden_size + cfg.intermediate_size) * 3)
    assert stacks == cfg.num_hidden_layers * 4 * 16 * per_layer * 4


def test_adapter_source_folders(tmp_path):
    src = AdapterFolders({"x": tmp_path})
    assert src.knows("x") and not src.knows("y") and src.fetch("x") == Path(tmp_path)
    with pytest.raises(KeyError):
        src.fetch("y")


def test_a_constrained_request_waits_for_both_its_grammar_and_its_adapter(demo_model, random_model_dir, adapters):
    """Structured output with an adapter: it runs once both are ready, and its text matches the regex."""
    import re

    from services.scheduler.engine.grammar import GrammarCache
    from shared.messages import Guided

    source = GatedSource({"chat": adapters["chat"][0]})
    eng = _engine(demo_model, source)
    eng.grammars = GrammarCache(str(random_model_dir), demo_model.config.vocab_size, set())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(random_model_dir)
    params = SamplingParams(max_tokens=12, temperature=0.0, guided=Guided("regex", "[a-z]{3} [0-9]{2}"))
    eng.add(EngineRequest("g", tok("Hi")["input_ids"], params, adapter="chat"))
    eng.add(EngineRequest("g-base", tok("Hi")["input_ids"], params))
    out: dict = {}
    for _ in range(200):
        for o in eng.step():
            out.setdefault((o.uid, o.index), []).append(o)
        if ("g-base", 0) in out and out[("g-base", 0)][-1].finish_reason:
            break
    assert eng.stats()["waiting"] == 1 and ("g", 0) not in out, "its grammar compiled, its adapter loads: it waits"
    source.gate.set()
    out.update(drain(eng))
    texts = {uid: tok.decode(tokens(out[(uid, 0)])) for uid in ("g", "g-base")}
    assert all(re.fullmatch("[a-z]{3} [0-9]{2}", t) for t in texts.values()), texts
    eng.close()


def test_a_drained_slot_takes_requests_again_once_nothing_waits_for_it(demo_model, source, ps, reference):
    """Two slots busy (sql long, chat short), mlp asked for: the least recently used busy slot (sql's) is drained,
    but chat's goes idle first and mlp takes that one; sql's slot must then take new sql requests again."""
    eng = _engine(demo_model, source, max_loras=2)
    out = drain(eng, {0: [_req("sql-long", ps[0], "sql", n=N), _req("chat", ps[1], "chat", n=3)],
                      2: [_req("mlp", ps[2], "mlp", n=3)],
                      8: [_req("sql-more", ps[2], "sql", n=4)]}, max_steps=500)
    assert tokens(out[("sql-long", 0)]) == reference[("sql", 0)]
    assert tokens(out[("mlp", 0)]) == reference[("mlp", 2)][:3]
    assert tokens(out[("sql-more", 0)]) == reference[("sql", 2)][:4]
    assert eng.stats()["lora_evictions"] == 1, "mlp took chat's idle slot, sql stayed"


def test_adapters_from_the_object_store(demo_model, adapters, ps, reference, tmp_path):
    """StoredAdapters: the folder is uploaded to a local object store and fetched (shared/object_store.py
    fetch_folder, on an event loop of its own thread, as the worker's) by the loader thread."""
    import asyncio

    from services.scheduler.engine.lora_weights import StoredAdapters
    from shared.local_store import LocalStore

    store = LocalStore(tmp_path / "store", max_bytes=1 << 30, cache_dir=tmp_path / "cache")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        folder = adapters["mlp"][0]
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            data = (folder / name).read_bytes()
            asyncio.run_coroutine_threadsafe(store.put(f"adapters/mlp/{name}", data), loop).result(30)
        eng = _engine(demo_model, StoredAdapters(store, loop, {"mlp": "adapters/mlp", "gone": "adapters/gone"}))
        out = drain(eng, {0: [_req("x", ps[1], "mlp"), _req("y", ps[0], "gone")]})
        assert tokens(out[("x", 0)]) == reference[("mlp", 1)]
        (failed,) = out[("y", 0)]
        assert failed.finish_reason == "error" and "could not be loaded" in failed.error and "NotFound" in failed.error
        with pytest.raises(RequestRejected, match="no LoRA adapter named 'sql'"):
            eng.add(_req("z", ps[0], "sql"))
        eng.close()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
