"""The engine's flashinfer path on CPU, through the signature-checked fake (fake_flashinfer.py): greedy output
equals the torch path's (and transformers') with and without the CUDA-graph stand-in and with overlapped
steps, on Qwen3-0.6B's attention shape, chunked prefill, mixed steps, n > 1 and prefix-cache hits included;
the warm-up covers every kernel the fake saw first used while serving."""

from __future__ import annotations

import pytest
import torch

from services.scheduler.engine.base import EngineRequest
from tests.unit.engine import fake_flashinfer
from tests.unit.engine.util import clone_model, drain, engine, greedy, hf_greedy, prompts, tokens

pytestmark = pytest.mark.timeout(300)

# Qwen3-0.6B's attention: 16 query heads, 8 KV heads of 128 (flashinfer builds 128), q/k norms, hidden 1024;
# two layers and a small vocabulary keep it fast on CPU.
SHAPE = dict(vocab_size=512, hidden_size=1024, intermediate_size=512, num_hidden_layers=2, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, max_position_embeddings=512, tie_word_embeddings=False,
             initializer_range=0.05, eos_token_id=None, bos_token_id=None, pad_token_id=None)
PAGE = 16


@pytest.fixture(scope="module")
def qwen06b_shape():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**SHAPE))
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    return model.eval()


def _workload(vocab: int) -> dict[int, list[EngineRequest]]:
    """Staggered arrivals: prompts longer than the 32-token budget (chunked, in steps with decodes), a one-token
    prompt, n = 2, and a prompt sharing two full pages with the first (a prefix-cache hit)."""
    a, b, c, d = prompts([40, 7, 29, 64], vocab, seed=4)
    e = a[:2 * PAGE] + prompts([5], vocab, seed=5)[0]
    return {0: [EngineRequest("a", a, greedy(12)), EngineRequest("b", b, greedy(10))],
            2: [EngineRequest("c", c, greedy(9)), EngineRequest("one", [17], greedy(6))],
            5: [EngineRequest("d", d, greedy(8, n=2))],
            9: [EngineRequest("e", e, greedy(7))]}


def _run(model, monkeypatch, backend: str, graphs: bool, overlap: bool):
    with fake_flashinfer.installed(monkeypatch, graphs=graphs) as record:
        eng = engine(clone_model(model), backend=backend, page_size=PAGE, num_pages=48, max_running=8,
                     prefill_budget=32, cuda_graphs=graphs, overlap=overlap)
        out = drain(eng, _workload(model.config.vocab_size))
        monkeypatch.undo()
    assert eng.pool.available() == eng.pool.usable, "every page came back"
    assert eng.stats()["prefix_hit_tokens"] >= 2 * PAGE
    texts = {key: tokens(outs) for key, outs in out.items()}
    assert all(outs[-1].finish_reason == "length" for outs in out.values())
    return eng, record, texts


def test_flashinfer_path_matches_torch_path_and_transformers(qwen06b_shape, monkeypatch):
    _, _, reference = _run(qwen06b_shape, monkeypatch, "torch", graphs=False, overlap=False)
    vocab = qwen06b_shape.config.vocab_size
    wl = _workload(vocab)
    for req in (wl[0][0], wl[2][0], wl[5][0]):
        assert reference[(req.uid, 0)] == hf_greedy(qwen06b_shape, req.input_ids, req.params.max_tokens)
    assert reference[("d", 1)] == reference[("d", 0)]
    assert len(set(reference[("a", 0)])) > 3, "greedy output varies (a meaningful comparison)"

    eng, record, eager = _run(qwen06b_shape, monkeypatch, "flashinfer", graphs=False, overlap=False)
    assert eng.runner.backend.name == "flashinfer" and eng.runner.graphs is None and record.runs > 0
    assert eager == reference

    eng, record, replayed = _run(qwen06b_shape, monkeypatch, "flashinfer", graphs=True, overlap=False)
    assert eng.runner.graphs is not None and eng.runner.graphs.replays > 0
    assert eng.runner.graphs.plans < eng.runner.graphs.replays, "replays with unchanged pages skip plan()"
    assert replayed == reference

    _, _, overlapped = _run(qwen06b_shape, monkeypatch, "flashinfer", graphs=True, overlap=True)
    assert overlapped == reference


def test_mixed_steps_replay_their_decodes(qwen06b_shape, monkeypatch):
    """A step with decodes and a prompt chunk replays the decodes from a graph and runs the chunk eagerly."""
    with fake_flashinfer.installed(monkeypatch):
        eng = engine(clone_model(qwen06b_shape), backend="flashinfer", page_size=PAGE, num_pages=48, max_running=8,
                     prefill_budget=32, cuda_graphs=True)
        ps = prompts([20, 70], qwen06b_shape.config.vocab_size, seed=8)
        eng.add(EngineRequest("x", ps[0], greedy(6)))
        eng.step()  # x prefills
        eng.add(EngineRequest("y", ps[1], greedy(3)))
        replays = eng.runner.graphs.replays
        eng.step()  # x decodes while y's first chunk prefills
        assert eng.runner.graphs.replays == replays + 1
        out = drain(eng)
    assert tokens(out[("y", 0)]) == hf_greedy(qwen06b_shape, ps[1], 3)


def test_warm_up_compiles_every_kernel_serving_uses(qwen06b_shape, monkeypatch):
    """Every (kind, backend) the fake saw planned while serving was first planned during the warm-up, short
    prompts (fa2 under "auto") and long ones (fa3 under "auto") included, and the sampling kernels."""
    with fake_flashinfer.installed(monkeypatch) as record:
        record.phase = "start-up"  # graph capture and warm-up, before the worker reports ready
        eng = engine(clone_model(qwen06b_shape), backend="flashinfer", page_size=PAGE, num_pages=64, max_running=4,
                     prefill_budget=128, cuda_graphs=True)
        eng.sampler.fused = fake_flashinfer.sampling  # flashinfer's sampling kernels, as on CUDA
        eng.warm_up()
        record.phase = "serve"
        vocab = qwen06b_shape.config.vocab_size
        ps = prompts([5, 100, 30], vocab, seed=9)
        from shared.messages import SamplingParams

        drain(eng, {0: [EngineRequest("short", ps[0], greedy(4)),
                        EngineRequest("long", ps[1], SamplingParams(max_tokens=4, temperature=0.9, top_p=0.9))],
                    1: [EngineRequest("t", ps[2], SamplingParams(max_tokens=4, temperature=1.0))]})
    late = [key for key, phase in record.compiled.items() if phase == "serve"]
    assert not late, f"first used while serving (a JIT compile mid-request on a GPU): {late}"
    assert any(k[0] == "prefill" for k in record.compiled) and any(k[0] == "sampling" for k in record.compiled)
    assert eng.pool.available() == eng.pool.usable


def test_auto_prefill_backend_would_compile_mid_serving(monkeypatch):
    """What pinning fa2 avoids: under "auto" the fake (as flashinfer 0.7.4 on SM90) picks fa3 for a row of
    more than 64 new tokens and fa2 for short ones, two kernels where one prompt length warms only one."""
    with fake_flashinfer.installed(monkeypatch, graphs=False) as record:
        ws = torch.zeros(1 << 10, dtype=torch.uint8)
        wrapper = fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        for q_len in (100, 10):
            qo = torch.tensor([0, q_len], dtype=torch.int32)
            kv = torch.tensor([0, -(-q_len // PAGE)], dtype=torch.int32)
            last = torch.tensor([q_len - (int(kv[1]) - 1) * PAGE], dtype=torch.int32)
            wrapper.plan(qo, kv, torch.arange(int(kv[1]), dtype=torch.int32), last, 16, 8, 128, PAGE, causal=True,
                         q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    assert {k[1] for k in record.compiled if k[0] == "prefill"} == {"fa3", "fa2"}


def test_a_wrong_call_fails_against_the_signatures():
    ws = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(TypeError, match=r"0\.7\.0"):  # 0.7.0 has no jit_kwargs
        fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", jit_kwargs={})
    wrapper = fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    indptr, last = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    with pytest.raises(AssertionError, match="by keyword"):
        wrapper.plan(indptr, torch.zeros(1, dtype=torch.int32), last, 16, 8, 128, PAGE, "NONE")
    with pytest.raises(TypeError, match="unexpected keyword"):
        wrapper.plan(indptr, torch.zeros(1, dtype=torch.int32), last, 16, 8, 128, PAGE, causal=True)
    with pytest.raises(AssertionError, match="q_data_type"):
        wrapper.plan(indptr, torch.zeros(1, dtype=torch.int32), last, 16, 8, 128, PAGE)


# ---- LoRA adapters (lora.py) on the flashinfer path


@pytest.fixture(scope="module")
def qwen06b_adapters(qwen06b_shape, tmp_path_factory):
    """Two adapters of the Qwen3-0.6B shape (rank 8 on q/v, rank 16 on every projection) and their merged
    references."""
    from services.scheduler.engine.lora_weights import AdapterFolders
    from tests.unit.engine.util import make_adapter

    root = tmp_path_factory.mktemp("qwen-adapters")
    specs = {"qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
             "all": dict(r=16, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"])}
    merged = {name: make_adapter(qwen06b_shape, root / name, seed=k, **spec)
              for k, (name, spec) in enumerate(specs.items())}
    return AdapterFolders({name: root / name for name in specs}), merged


def _lora_workload(vocab: int) -> dict[int, list[EngineRequest]]:
    """The base and both adapters in mixed steps: a chunked prompt, decodes next to prefills, n = 2."""
    a, b, c = prompts([40, 9, 21], vocab, seed=12)
    return {0: [EngineRequest("qv", a, greedy(8), adapter="qv"), EngineRequest("base", b, greedy(8))],
            2: [EngineRequest("all", c, greedy(8), adapter="all"), EngineRequest("qv-b", b, greedy(6), adapter="qv")],
            4: [EngineRequest("all-n2", b, greedy(5, n=2), adapter="all")]}


def _lora_run(model, source, monkeypatch, dtype=torch.float32, **kw):
    with fake_flashinfer.installed(monkeypatch, graphs=kw.get("cuda_graphs", False)) as record:
        eng = engine(clone_model(model).to(dtype), page_size=PAGE, num_pages=48, max_running=8, prefill_budget=32,
                     max_loras=2, adapters=source, **kw)
        eng.warm_up()
        out = drain(eng, _lora_workload(model.config.vocab_size))
        monkeypatch.undo()
    assert eng.pool.available() == eng.pool.usable, "every page came back"
    return eng, record, {key: tokens(outs) for key, outs in out.items()}


def test_lora_on_the_flashinfer_path_matches_the_torch_path_fp32(qwen06b_shape, qwen06b_adapters, monkeypatch):
    """fp32 (the segment GEMM has no fp32 kernels): grouped LoRA matmuls under flashinfer attention, base
    decodes from graphs and adapter decodes eager, equal the torch engine and transformers on the merged models."""
    source, merged = qwen06b_adapters
    _, _, reference = _lora_run(qwen06b_shape, source, monkeypatch, backend="torch")
    wl = _lora_workload(qwen06b_shape.config.vocab_size)
    for req in (wl[0][0], wl[2][0]):
        assert reference[(req.uid, 0)] == hf_greedy(merged[req.adapter], req.input_ids, req.params.max_tokens)
    assert reference[("base", 0)] == hf_greedy(qwen06b_shape, wl[0][1].input_ids, 8)
    eng, record, got = _lora_run(qwen06b_shape, source, monkeypatch, backend="flashinfer", cuda_graphs=True)
    assert eng.lora.segment_gemm is None and eng.runner.graphs is not None and not eng.runner.graphs.lora_graphs
    assert not [k for k in record.compiled if k[0] == "segment_gemm"], "no fp32 segment GEMM call"
    assert eng.runner.graphs.replays > 0 and got == reference


def test_segment_gemm_and_lora_graphs_match_grouped_matmuls_bf16(qwen06b_shape, qwen06b_adapters, monkeypatch):
    """bf16 on the fake flashinfer: LoRA through the segment GEMM, eager, from decode graphs (their slot indices
    static inputs) and with overlapped steps, gives the tokens of grouped torch matmuls; and the warm-up ran every
    segment GEMM kernel that serving used."""
    source, _ = qwen06b_adapters
    _, _, reference = _lora_run(qwen06b_shape, source, monkeypatch, torch.bfloat16, backend="flashinfer",
                                lora_backend="torch")
    assert len({tuple(v) for v in reference.values()}) >= 4, "adapters change the output (a meaningful comparison)"
    for kw in (dict(cuda_graphs=False), dict(cuda_graphs=True), dict(cuda_graphs=True, overlap=True)):
        eng, record, got = _lora_run(qwen06b_shape, source, monkeypatch, torch.bfloat16, backend="flashinfer", **kw)
        assert eng.lora.segment_gemm is not None and eng.lora.segment_gemm.runs > 0
        assert got == reference, kw
        if kw["cuda_graphs"]:
            graphs = eng.runner.graphs
            assert graphs.lora_graphs.keys() == graphs.graphs.keys()
            assert graphs.lora_replays > 0 and graphs.replays > graphs.lora_replays, "both kinds replayed"
        assert ("segment_gemm", "sm90", torch.bfloat16) in record.compiled


def test_warm_up_runs_the_segment_gemm_before_serving(qwen06b_shape, qwen06b_adapters, monkeypatch):
    source, _ = qwen06b_adapters
    with fake_flashinfer.installed(monkeypatch) as record:
        record.phase = "start-up"
        eng = engine(clone_model(qwen06b_shape).to(torch.bfloat16), backend="flashinfer", page_size=PAGE,
                     num_pages=64, max_running=4, prefill_budget=128, cuda_graphs=True, max_loras=2, adapters=source)
        eng.warm_up()
        record.phase = "serve"
        drain(eng, _lora_workload(qwen06b_shape.config.vocab_size))
    assert ("segment_gemm", "sm90", torch.bfloat16) in record.compiled
    late = [key for key, phase in record.compiled.items() if phase == "serve"]
    assert not late, f"first used while serving: {late}"


def test_a_wrong_segment_gemm_call_fails():
    ws = torch.zeros(16, dtype=torch.uint8)
    gemm = fake_flashinfer.SegmentGEMMWrapper(ws)
    x, w = torch.zeros(3, 8, dtype=torch.bfloat16), torch.zeros(2, 4, 8, dtype=torch.bfloat16)
    bounds, index = torch.tensor([0, 1, 3]), torch.tensor([1, 0])
    assert gemm.run(x, w, 2, True, seg_indptr=bounds, weight_indices=index).shape == (3, 4)
    with pytest.raises(AssertionError, match="int64"):
        gemm.run(x, w, 2, True, seg_indptr=bounds.int(), weight_indices=index)
    with pytest.raises(AssertionError, match="fp16/bf16"):
        gemm.run(x.float(), w.float(), 2, True, seg_indptr=bounds, weight_indices=index)
    with pytest.raises(TypeError, match="unexpected keyword"):
        gemm.run(x, w, 2, True, indptr=bounds, weight_indices=index)
