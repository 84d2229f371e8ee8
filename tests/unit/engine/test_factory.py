"""The factory builds the engine the settings ask for; the simple fallback still works."""

from __future__ import annotations

import json

import pytest
import torch

from services.scheduler.engine import factory
from services.scheduler.engine.base import EngineRequest, RequestRejected
from services.scheduler.engine.factory import build_engine, cpu_has_native_bf16, kv_num_pages, pick_dtype
from services.scheduler.engine.paged import PagedEngine
from services.scheduler.engine.simple import SimpleEngine
from shared.messages import SamplingParams
from shared.settings import SchedulerSettings
from tests.unit.engine.util import drain, greedy, hf_greedy, prompts, tokens


def _settings(**kw) -> SchedulerSettings:
    return SchedulerSettings(threads=1, max_kv_tokens=2048, page_size=8, **kw)


def test_paged_is_the_default_and_matches_the_reference(random_model_dir, demo_model):
    eng = build_engine(_settings(), str(random_model_dir))
    assert isinstance(eng, PagedEngine) and torch.get_num_threads() == 1
    stats = eng.stats()
    assert stats["kv_total_tokens"] == 2048 and stats["total_pages"] == 256
    p = prompts([11], demo_model.config.vocab_size, seed=8)[0]
    out = drain(eng, {0: [EngineRequest("a", p, greedy(12))]})
    assert tokens(out[("a", 0)]) == hf_greedy(demo_model, p, 12)


def test_simple_engine_still_works(random_model_dir, demo_model):
    eng = build_engine(_settings(engine="simple"), str(random_model_dir))
    assert isinstance(eng, SimpleEngine)
    p = prompts([7], demo_model.config.vocab_size, seed=9)[0]
    eng.add(EngineRequest("a", p, greedy(8)))
    ids = []
    while eng.has_work():
        ids += [t for o in eng.step() for t in o.ids]
    assert ids == hf_greedy(demo_model, p, 8)


def test_simple_engine_omitted_max_tokens_means_the_context(random_model_dir):
    eng = build_engine(_settings(engine="simple"), str(random_model_dir))
    assert eng.add(EngineRequest("a", [5, 6, 7], SamplingParams(temperature=0.0, ignore_eos=True))) == \
        eng.max_context - 3
    for _ in range(3):
        assert [o.finish_reason for o in eng.step()] == [None]
    assert eng.abort("a") and not eng.has_work()
    with pytest.raises(RequestRejected) as e:
        eng.add(EngineRequest("b", [5, 6, 7], SamplingParams(max_tokens=2, min_tokens=3)))
    assert e.value.param == "min_tokens"


def test_kv_sizing_and_dtype_rules():
    s = SchedulerSettings(max_kv_tokens=0, page_size=16, max_running=4)
    pages = kv_num_pages(s, bytes_per_token=2048, max_context=1000)
    assert pages == 4 * 1000 // 16 + 1  # capped at max_running full contexts, plus the scratch page
    assert kv_num_pages(_settings(), 2048, 10**6) == 2048 // 8 + 1

    class Cfg:
        dtype = torch.float32

    assert pick_dtype("auto", torch.device("cuda"), Cfg) == torch.bfloat16
    assert pick_dtype("auto", torch.device("cpu"), Cfg) == torch.float32
    assert pick_dtype("bfloat16", torch.device("cpu"), Cfg) == torch.bfloat16


def _cfg(dtype):
    class Cfg:
        pass

    Cfg.dtype = dtype
    return Cfg


@pytest.mark.parametrize(("native", "expected"), [(False, torch.float32), (True, torch.bfloat16)])
def test_auto_dtype_runs_bf16_checkpoints_in_fp32_on_cpus_without_native_bf16(monkeypatch, native, expected):
    monkeypatch.setattr(factory, "cpu_has_native_bf16", lambda: native)
    cpu = torch.device("cpu")
    assert pick_dtype("auto", cpu, _cfg(torch.bfloat16)) == expected
    assert pick_dtype("auto", cpu, _cfg("bfloat16")) == expected
    assert pick_dtype("auto", cpu, _cfg(torch.float16)) == torch.float32  # fp16 is slow either way
    assert pick_dtype("auto", cpu, _cfg(torch.float32)) == torch.float32
    # an explicit --dtype wins; CUDA keeps the checkpoint's 16-bit dtype and makes fp32 bf16
    assert pick_dtype("bfloat16", cpu, _cfg(torch.float32)) == torch.bfloat16
    assert pick_dtype("float32", cpu, _cfg(torch.bfloat16)) == torch.float32
    assert pick_dtype("auto", torch.device("cuda"), _cfg(torch.bfloat16)) == torch.bfloat16
    assert pick_dtype("auto", torch.device("cuda"), _cfg(torch.float16)) == torch.float16


@pytest.mark.parametrize(("flags", "native"), [
    ("flags\t\t: fpu sse avx2 avx512f avx512bw avx512vl", False),
    ("flags\t\t: fpu avx512f avx512_bf16 avx512_vnni", True),
    ("flags\t\t: fpu amx_bf16 amx_tile", True),
    ("Features\t: fp asimd bf16 i8mm", True),
    ("Features\t: fp asimd", False),
])
def test_native_bf16_from_cpu_flags(tmp_path, flags, native):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: some cpu\n{flags}\n\n")
    assert cpu_has_native_bf16(str(info)) is native
    assert cpu_has_native_bf16(str(tmp_path / "missing")) is False


def test_heartbeat_says_which_dtype_auto_chose(random_model_dir, tmp_path, monkeypatch):
    import shutil

    bf16 = tmp_path / "bf16-model"
    shutil.copytree(random_model_dir, bf16)
    config = json.loads((bf16 / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (bf16 / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(factory, "cpu_has_native_bf16", lambda: False)
    assert build_engine(_settings(), str(bf16)).stats()["dtype"] == "float32"
    monkeypatch.setattr(factory, "cpu_has_native_bf16", lambda: True)
    assert build_engine(_settings(), str(bf16)).stats()["dtype"] == "bfloat16"
    assert build_engine(_settings(engine="simple", dtype="float32"), str(bf16)).stats()["dtype"] == "float32"


def test_lora_settings_reach_the_engine_and_its_adapters_load(random_model_dir, demo_model, tmp_path):
    from services.scheduler.engine.lora_weights import AdapterFolders
    from tests.unit.engine.util import make_adapter

    merged = make_adapter(demo_model, tmp_path / "a", seed=3, r=8, lora_alpha=16, target_modules=["q_proj", "up_proj"])
    eng = build_engine(_settings(max_loras=3, max_lora_rank=8), str(random_model_dir),
                       adapters=AdapterFolders({"a": tmp_path / "a"}))
    assert eng.lora.max_loras == 3 and eng.lora.max_rank == 8 and eng.stats()["lora_slots"] == 3
    p = prompts([9], demo_model.config.vocab_size, seed=4)[0]
    out = drain(eng, {0: [EngineRequest("x", p, greedy(8), adapter="a")]})
    assert tokens(out[("x", 0)]) == hf_greedy(merged, p, 8)
    assert eng.resident_adapters() == ["a"]


def test_cpu_kv_sizing_leaves_the_lora_slots_their_memory(monkeypatch, demo_model):
    monkeypatch.setattr(factory, "_available_ram", lambda: 64 << 20)
    s = SchedulerSettings(max_kv_tokens=0, page_size=16, max_running=1000, kv_memory_fraction=1.0)
    budget = int((64 << 20) * factory.CPU_KV_SHARE)
    assert kv_num_pages(s, 1024, 10**6) == budget // 1024 // 16 + 1
    assert kv_num_pages(s, 1024, 10**6, reserved=budget // 2) == budget // 2 // 1024 // 16 + 1
    with pytest.raises(RuntimeError, match="lower --max-loras"):
        kv_num_pages(s, 1024, 10**6, reserved=budget)
    lora = SchedulerSettings(max_loras=4, max_lora_rank=16)
    from services.scheduler.engine.lora_weights import LoraLayout, stack_bytes

    assert factory.lora_bytes(lora, demo_model) == stack_bytes(LoraLayout.of(demo_model), 4, 16, torch.float32) > 0
    assert factory.lora_bytes(SchedulerSettings(), demo_model) == 0
