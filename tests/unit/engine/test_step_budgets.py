"""Budgets of a decode step, counted on CPU: host syncs the engine makes per step for each sampling mode, and
aten ops dispatched per decode step with CUDA graphs (the replay counts as the one launch it is on a GPU),
both the same at every batch size. Plus the backend choices for fp32 and broken flashinfer installs."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from services.scheduler.engine import transfer
from services.scheduler.engine.attention import flashinfer_backend
from services.scheduler.engine.base import EngineRequest
from services.scheduler.engine.config import make_backend
from shared.messages import SamplingParams
from tests.unit.engine import fake_flashinfer
from tests.unit.engine.util import clone_model, engine, prompts, tiny_model

pytestmark = pytest.mark.timeout(300)

ENGINE_DIR = Path(transfer.__file__).parent
SIZES = (1, 4, 16)
MODES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=1.0),  # the API's default
    "top_k": SamplingParams(temperature=0.8, top_k=20),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "top_k_top_p_min_p": SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05),
    "seed": SamplingParams(temperature=1.0, top_p=0.95, seed=7),
    "penalties": SamplingParams(temperature=0.7, repetition_penalty=1.2, presence_penalty=0.5,
                                frequency_penalty=0.3),
    "logit_bias": SamplingParams(temperature=1.0, logit_bias={5: 3.0, 9: -100.0}),
    "min_tokens": SamplingParams(temperature=1.0, min_tokens=50, stop_token_ids=[4]),
    "logprobs": SamplingParams(temperature=1.0, logprobs=True, top_logprobs=5),
}


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


class SyncCounter:
    """Calls that wait for the device, made by engine code: `.item()`, `.tolist()`, `.cpu()`, `.numpy()` and
    `torch.tensor(..., device=...)` from a module of services/scheduler/engine/ (transfer.py's lists of
    host buffers excepted), and waits for a step's results (`DeviceResult.wait`, the one sanctioned sync)."""

    def __init__(self, monkeypatch):
        self.syncs: list[str] = []
        self.waits = 0
        for name in ("item", "tolist", "cpu", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, self._method(getattr(torch.Tensor, name), name))
        real_tensor = torch.tensor

        def tensor(*args, **kwargs):
            if "device" in kwargs and self._from_engine():
                self.syncs.append(f"torch.tensor(device=) at {self._where()}")
            return real_tensor(*args, **kwargs)

        monkeypatch.setattr(torch, "tensor", tensor)
        real_wait = transfer.DeviceResult.wait

        def wait(result):
            if result._lists is None:
                self.waits += 1
            return real_wait(result)

        monkeypatch.setattr(transfer.DeviceResult, "wait", wait)

    def _method(self, real, name):
        counter = self

        def counted(t, *args, **kwargs):
            if counter._from_engine():
                counter.syncs.append(f".{name}() at {counter._where()}")
            return real(t, *args, **kwargs)

        return counted

    @staticmethod
    def _from_engine() -> bool:
        path = Path(sys._getframe(2).f_code.co_filename)
        return path.parent in (ENGINE_DIR, ENGINE_DIR / "attention") and path.name != "transfer.py"

    @staticmethod
    def _where() -> str:
        f = sys._getframe(3)
        return f"{Path(f.f_code.co_filename).name}:{f.f_lineno}"


class OpCounter(TorchDispatchMode):
    """Non-view aten ops dispatched; a graph replay (the stand-in re-runs the captured forward) counts as one."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and not func.is_view:
            self.ops += 1
        return func(*args, **(kwargs or {}))

    def replay(self, graph) -> None:
        self.paused = True
        try:
            graph()
        finally:
            self.paused = False
        self.ops += 1


def _decoding_engine(model, monkeypatch, params: SamplingParams, batch: int, row_adapters=(), warm=None,
                     dtype=torch.float32, **kw):
    """A flashinfer (fake) engine with graphs and overlap, as on CUDA, with `batch` requests all decoding (row i
    with LoRA adapter row_adapters[i % len(row_adapters)] when some are given; None: the base), after `warm`
    requests (if any) ran to their end."""
    kw = {"backend": "flashinfer", "cuda_graphs": True, "overlap": True, **kw}
    eng = engine(clone_model(model).to(dtype), num_pages=128, max_running=16, prefill_budget=512, **kw)
    assert eng.runner.graphs is not None or not kw["cuda_graphs"]
    for req in warm or []:
        eng.add(req)
    while eng.has_work():
        eng.step()
    p = SamplingParams(**{**{f: getattr(params, f) for f in params.__struct_fields__},
                          "max_tokens": 60, "ignore_eos": True})
    for i, prompt in enumerate(prompts([6] * batch, model.config.vocab_size, seed=3)):
        adapter = row_adapters[i % len(row_adapters)] if row_adapters else None
        eng.add(EngineRequest(f"r{i}", prompt, p, adapter=adapter))
    for _ in range(3):  # prefill, then two decode steps: the overlapped loop's steady state
        eng.step()
    assert all(s.is_decode or s.unresolved for s in eng.scheduler.running) and len(eng.scheduler.running) == batch
    return eng


@pytest.mark.parametrize("mode", list(MODES))
def test_host_syncs_per_step_are_one_transfer_at_every_batch_size(model, monkeypatch, mode):
    with fake_flashinfer.installed(monkeypatch):
        per_size = {}
        for batch in SIZES:
            eng = _decoding_engine(model, monkeypatch, MODES[mode], batch)
            steps = 3
            with pytest.MonkeyPatch.context() as counting:
                counter = SyncCounter(counting)
                produced = sum(len(eng.step()) for _ in range(steps))
            assert produced == steps * batch
            per_size[batch] = (counter.waits / steps, counter.syncs)
    for batch, (waits, syncs) in per_size.items():
        assert syncs == [], f"{mode} at batch {batch} syncs besides its results: {syncs}"
        assert waits == 1, f"{mode} at batch {batch}: {waits} result transfers per step"


@pytest.mark.parametrize("mode", ["greedy", "temperature", "top_k_top_p_min_p", "penalties", "logprobs"])
def test_ops_per_decode_step_with_graphs_do_not_grow_with_the_batch(model, monkeypatch, mode):
    counts = {}
    with fake_flashinfer.installed(monkeypatch):
        for batch in SIZES:
            eng = _decoding_engine(model, monkeypatch, MODES[mode], batch)
            counter = OpCounter()
            monkeypatch.setattr(fake_flashinfer.StandInGraphs, "on_replay", staticmethod(counter.replay))
            with counter:
                eng.step()
            counts[batch] = counter.ops
            monkeypatch.setattr(fake_flashinfer.StandInGraphs, "on_replay", None)
    assert len(set(counts.values())) == 1, f"{mode}: ops per step by batch size {counts}"
    assert counts[1] < 60, f"{mode}: {counts[1]} ops around the replay (an eager step is ~57 per layer)"


def test_eager_torch_attention_makes_no_sync_either(model, monkeypatch):
    """The torch backend (CPU, and CUDA's fallback) copies its masks' inputs in one transfer per part."""
    eng = engine(clone_model(model), overlap=True, num_pages=128, max_running=16)
    for i, prompt in enumerate(prompts([6, 9, 3], model.config.vocab_size, seed=5)):
        eng.add(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)))
    eng.step()
    with pytest.MonkeyPatch.context() as counting:
        counter = SyncCounter(counting)
        eng.step()
        eng.add(EngineRequest("late", prompts([11], model.config.vocab_size, seed=6)[0], MODES["greedy"]))
        eng.step()  # a mixed step
    assert counter.syncs == [] and counter.waits == 2


# ---- which attention serves

def _cuda_kv():
    """Stands in for a KV cache on a CUDA device (make_backend reads only its device to choose)."""
    return types.SimpleNamespace(k=[types.SimpleNamespace(device=torch.device("cuda"))])


@pytest.fixture(scope="module")
def head64():
    """A tiny Qwen3 with 64-wide heads (flashinfer builds 64, 128 and 256)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.unit.engine.util import TINY

    return Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=64)).eval()


@pytest.fixture()
def warnings(caplog):
    caplog.set_level(logging.WARNING, logger="services.scheduler.engine.config")
    return lambda: [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_fp32_on_cuda_uses_torch_attention(head64, monkeypatch, warnings):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    backend = make_backend("auto", _cuda_kv(), head64, torch.float32)
    assert backend.name == "torch"
    assert any("no float32 paged attention kernels" in w for w in warnings())


@pytest.mark.parametrize("error", [ModuleNotFoundError("No module named 'tvm_ffi'", name="tvm_ffi"),
                                   OSError("libcudart.so.13: cannot open shared object file"),
                                   ModuleNotFoundError("No module named 'flashinfer'", name="flashinfer")])
def test_a_flashinfer_that_cannot_import_falls_back_to_torch(head64, monkeypatch, warnings, error):
    class Broken:
        def find_spec(self, name, path=None, target=None):
            if name == "flashinfer":
                raise error
            return None

    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    backend = make_backend("auto", _cuda_kv(), head64, torch.bfloat16)
    assert backend.name == "torch"
    (warning,) = warnings()
    assert "using torch attention on CUDA" in warning
    missing = getattr(error, "name", None) == "flashinfer"
    assert ("not installed" in warning) if missing else str(error) in warning


def test_bf16_on_cuda_with_flashinfer_uses_it(head64, monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    monkeypatch.setattr(flashinfer_backend, "device_sms", lambda device: 132)
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, device=None, **kw: real_zeros(*a, **kw))  # no CUDA here
    assert make_backend("auto", _cuda_kv(), head64, torch.bfloat16).name == "flashinfer"


def test_graphs_default_follows_the_device(model, caplog):
    eng = engine(clone_model(model))  # cuda_graphs unset on CPU: off, silently
    assert eng.runner.graphs is None and not eng.overlap
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    from shared.settings import SchedulerSettings

    assert SchedulerSettings().cuda_graphs is None and SchedulerSettings().overlap is None


def test_workspace_is_sized_from_the_heads():
    ws = flashinfer_backend.workspace_bytes
    assert ws(16, 8, 128, 132) == 128 << 20, "Qwen3-0.6B fits flashinfer's usual 128 MiB"
    assert ws(64, 8, 128, 132) >= 138_412_032 + (16 << 20), "64 query / 8 KV heads need ~138 MB for prefill"
    assert ws(64, 8, 128, 132) % (1 << 20) == 0


def test_the_sync_counter_sees_a_sync(model, monkeypatch):
    """The counter is not blind: scoring a prompt (echo with logprobs) reads its scores per sequence."""
    eng = engine(clone_model(model), num_pages=64)
    eng.add(EngineRequest("echo", [5, 6, 7, 8], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)))
    with pytest.MonkeyPatch.context() as counting:
        counter = SyncCounter(counting)
        eng.step()
    assert any("launch.py" in s for s in counter.syncs) and counter.waits == 1  # launch.py `score_prompts`


# ---- LoRA adapters: a base-only step costs what it cost without them; adapter rows add no sync


@pytest.fixture(scope="module")
def lora_source(model, tmp_path_factory):
    from services.scheduler.engine.lora_weights import AdapterFolders
    from tests.unit.engine.util import make_adapter

    root = tmp_path_factory.mktemp("budget-adapters")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for k in range(4):
        make_adapter(model, root / f"a{k}", seed=k, r=8, lora_alpha=16, target_modules=targets)
    return AdapterFolders({f"a{k}": root / f"a{k}" for k in range(4)})


def _loads(adapters) -> list[EngineRequest]:
    """Requests that make their adapters resident before the measured ones start."""
    return [EngineRequest(f"load-{a}", [5, 6], SamplingParams(max_tokens=2), adapter=a) for a in adapters]


def _ops_per_step(eng, monkeypatch) -> int:
    counter = OpCounter()
    monkeypatch.setattr(fake_flashinfer.StandInGraphs, "on_replay", staticmethod(counter.replay))
    with counter:
        eng.step()
    monkeypatch.setattr(fake_flashinfer.StandInGraphs, "on_replay", None)
    return counter.ops


@pytest.mark.parametrize("graphs", [False, True])
def test_a_base_only_step_costs_the_same_ops_with_adapters_on(model, lora_source, monkeypatch, graphs):
    """--max-loras 4 with an adapter resident: a step of base rows dispatches exactly the ops of an engine
    without adapters (eager: every op of the forward; with graphs: the replay and what surrounds it)."""
    counts = {}
    with fake_flashinfer.installed(monkeypatch):
        for loras in (0, 4):
            kw = dict(max_loras=loras, adapters=lora_source, cuda_graphs=graphs)
            if not graphs:
                kw["backend"] = "torch"
            if loras:
                kw["warm"] = _loads(["a0"])
            eng = _decoding_engine(model, monkeypatch, MODES["greedy"], 4, **kw)
            assert eng.resident_adapters() == (["a0"] if loras else [])
            counts[loras] = _ops_per_step(eng, monkeypatch)
    assert counts[0] == counts[4], f"ops per base-only decode step without / with adapters on: {counts}"


def test_lora_decode_steps_replay_one_graph_whatever_the_adapters(model, lora_source, monkeypatch):
    """bf16 (the segment GEMM's): a decode step of 16 rows on 0, 1 or 4 adapters is one replay and the same
    ops around it; the adapters' slots are copied with the other int64 inputs."""
    counts = {}
    with fake_flashinfer.installed(monkeypatch):
        for adapters in ((), ("a0",), ("a0", "a1", "a2", "a3")):
            eng = _decoding_engine(model, monkeypatch, MODES["greedy"], 16, row_adapters=adapters, max_loras=4,
                                   adapters=lora_source, warm=_loads(adapters), dtype=torch.bfloat16)
            assert eng.lora.segment_gemm is not None
            counts[len(adapters)] = _ops_per_step(eng, monkeypatch)
            graphs = eng.runner.graphs
            assert graphs.lora_replays == (graphs.replays if adapters else 0)
    assert len(set(counts.values())) == 1, f"ops per decode step by distinct adapters: {counts}"


@pytest.mark.parametrize("graphs", [False, True])
def test_lora_steps_make_no_sync(model, lora_source, monkeypatch, graphs):
    """Eager (fp32: grouped matmuls, their token indices in one transfer) and from graphs (bf16: segment GEMM,
    slots with the other inputs): one wait for the results per step, no other sync."""
    dtype = torch.bfloat16 if graphs else torch.float32
    with fake_flashinfer.installed(monkeypatch):
        eng = _decoding_engine(model, monkeypatch, MODES["temperature"], 8, row_adapters=("a0", None, "a1", "a2"),
                               max_loras=4, adapters=lora_source, cuda_graphs=graphs,
                               warm=_loads(("a0", "a1", "a2")), dtype=dtype)
        assert (eng.lora.segment_gemm is not None) == graphs
        steps = 3
        with pytest.MonkeyPatch.context() as counting:
            counter = SyncCounter(counting)
            produced = sum(len(eng.step()) for _ in range(steps))
    assert produced == steps * 8
    assert counter.syncs == [] and counter.waits == steps
