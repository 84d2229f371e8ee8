"""Tensor parallelism at the engine level: ranks in spawned processes over gloo (no Redis), each running its shard
of the model on the inputs rank 0 broadcasts; the logits equal the unsharded model's."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.scheduler.engine.attention import RowSpec
from services.scheduler.engine.tp_group import StepChannel, free_port, init_ranks
from services.scheduler.engine.tp_shard import UnshardableModel, plan, shard_model, weight_bytes

# Qwen3-0.6B's attention and MLP shape (16 query heads, 8 KV heads of 128, tied embeddings), two layers and an
# uneven vocabulary so the test stays fast and the last rank's vocabulary slice is padded
QWEN3_06B = dict(vocab_size=1001, hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
# 4 query heads, 2 KV heads: with 4 ranks the KV heads are replicated
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
PAGE = 4
_BUILT: list = []  # the model of the running test, built before the ranks fork


def _model(shape: dict):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**shape, initializer_range=0.1, max_position_embeddings=256))
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    return model.eval()


def _steps(runner, run) -> list[torch.Tensor]:
    """A prefill of two prompts, then two decode steps on the KV they left: each step's logits."""
    from services.scheduler.engine.model_runner import ModelRunner

    assert isinstance(runner, ModelRunner)
    pages = [[1, 2, 3], [4, 5, 6]]
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (6, 5)]
    rows = [RowSpec(pages[0], 0, 6), RowSpec(pages[1], 0, 5)]
    ids, keep = seqs[0] + seqs[1], [5, 10]
    out = []
    for _ in range(3):
        logits = run(rows, ids, keep)
        out.append(logits)
        nxt = logits.argmax(-1).tolist()
        for s, t in zip(seqs, nxt, strict=True):
            s.append(t)
        rows = [RowSpec(p, len(s) - 1, 1) for p, s in zip(pages, seqs, strict=True)]
        ids, keep = nxt, [0, 1]
    return out


def _runner(model):
    from services.scheduler.engine.attention.torch_backend import TorchPagedAttention
    from services.scheduler.engine.kv_cache import KVCache
    from services.scheduler.engine.model_geometry import attention_geometry
    from services.scheduler.engine.model_runner import ModelRunner

    kv = KVCache(attention_geometry(model).kv_shape(PAGE), 8, torch.float32, "cpu")
    kv.zero_pages(list(range(8)))
    return ModelRunner(model, TorchPagedAttention(kv), PAGE)


def _rank(rank: int, world: int, port: int, shape: dict, out: str) -> None:
    torch.set_num_threads(1)
    groups = init_ranks(rank, world, port, torch.device("cpu"), 60)
    model = copy.deepcopy(_BUILT[0])  # forked: the parent's model, built once
    full = weight_bytes(model)
    reference = None
    if rank == 0:
        ref_runner = _runner(copy.deepcopy(_BUILT[0]))
        reference = _steps(ref_runner, ref_runner.forward)
    shard_model(model, rank, world, groups.step)
    runner = _runner(model)
    channel = StepChannel(torch.device("cpu"), groups)

    def run(rows, ids, keep):
        if rank == 0:  # as the engine's rank 0 does: broadcast, then run
            t_ids, t_keep = torch.tensor(ids), torch.tensor(keep)
            channel.send(rows, t_ids, t_keep, [7])
            return runner.run_packed(rows, t_ids, t_keep)
        step = channel.receive()
        assert step is not None and step.zero == [7]
        return runner.run_packed(step.rows, step.ids, step.keep)

    got = _steps(runner, run)
    sizes = [None] * world
    dist.all_gather_object(sizes, weight_bytes(model), group=groups.control)
    if rank == 0:
        channel.stop()
        diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, reference, strict=True))
        same = all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(got, reference, strict=True))
        Path(out).write_text(json.dumps({"diff": diff, "same": same, "full": full, "ranks": sizes}))
    else:
        assert channel.receive() is None
    dist.destroy_process_group()


@pytest.mark.parametrize(("shape", "world"), [(QWEN3_06B, 2), (TINY, 4)], ids=["qwen3-0.6b-shape-tp2", "tiny-tp4"])
def test_sharded_forward_equals_unsharded(shape, world, tmp_path):
    out = tmp_path / "result.json"
    # fork: the ranks start with the model built and torch and transformers imported (spawn: seconds each)
    _BUILT[:] = [_model(shape)]
    mp.start_processes(_rank, args=(world, free_port(), shape, str(out)), nprocs=world, join=True, start_method="fork")
    result = json.loads(out.read_text())
    assert result["same"] and result["diff"] < 1e-5, result  # relative: sums in another order (fp32)
    if shape is QWEN3_06B:  # every weight but the norms is split: each rank holds ~1/N
        for size in result["ranks"]:
            assert abs(size - result["full"] / world) < 0.02 * result["full"], result


def test_plan_refuses_shapes_that_do_not_split():
    from transformers import Qwen3Config

    with pytest.raises(UnshardableModel, match="query heads"):
        plan(Qwen3Config(**{**TINY, "num_attention_heads": 6, "num_key_value_heads": 2}), 0, 4, 512)
    with pytest.raises(UnshardableModel, match="KV heads"):
        plan(Qwen3Config(**{**TINY, "num_attention_heads": 12, "num_key_value_heads": 3}), 0, 2, 512)
    replicated = [plan(Qwen3Config(**TINY), r, 4, 512) for r in range(4)]  # 1 query head each, 2 KV heads
    assert [(s.heads, s.kv_heads, s.kv_first) for s in replicated] == [(1, 1, 0), (1, 1, 0), (1, 1, 1), (1, 1, 1)]


# rank 0 as the scheduler builds it (the factory starts rank 1), then one request stepped when told on stdin
RANK0 = """
import sys
from services.scheduler.engine.base import EngineRequest
from services.scheduler.engine.factory import build_engine
from shared.messages import SamplingParams
from shared.settings import SchedulerSettings
engine = build_engine(SchedulerSettings(device="cpu", dtype="float32", threads=1, max_kv_tokens=512,
                                        tensor_parallel_size=2, tp_timeout_s=2), sys.argv[1])
print(" ".join(str(r["pid"]) for r in engine.group.ranks), flush=True)
if sys.stdin.readline().strip() == "close":
    engine.close()
    print("closed", flush=True)
    sys.exit(0)
engine.add(EngineRequest("u", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0)))
while engine.has_work():
    engine.step()
print("finished", flush=True)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.slow  # two processes start (~10 s on 2 cores)
@pytest.mark.timeout(120)
# a rank that exits (SIGKILL) is the pipeline test's: tests/e2e/test_tensor_parallel.py
@pytest.mark.parametrize("fault", ["hang", "close"])
def test_a_rank_that_hangs_takes_the_group_down_and_a_closed_engine_stops_its_ranks(random_model_dir, fault):
    """A hung rank (stopped) holds rank 0's next step past --tp-timeout-s; rank 0's watch then kills the other ranks
    and exits nonzero, none left running (a rank that exits is seen at once). An engine closed (its scheduler
    stopping) stops its ranks and exits 0."""
    import signal
    import subprocess
    import sys
    import time

    from tests.support.helpers import wait_for

    rank0 = subprocess.Popen([sys.executable, "-c", RANK0, str(random_model_dir)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        pids = [int(p) for p in rank0.stdout.readline().split()]
        assert len(pids) == 2 and pids[0] == rank0.pid, pids
        if fault == "close":
            rank0.stdin.write("close\n")
            rank0.stdin.flush()
            assert rank0.wait(30) == 0 and "closed" in rank0.stdout.read()
            wait_for(lambda: _gone(pids[1]), timeout=15)
            return
        os.kill(pids[1], signal.SIGSTOP)
        began = time.monotonic()
        rank0.stdin.write("go\n")
        rank0.stdin.flush()
        assert rank0.wait(30) != 0
        assert time.monotonic() - began < 20
        wait_for(lambda: _gone(pids[1]), timeout=10)
        assert "finished" not in rank0.stdout.read()
    finally:
        rank0.kill()
        rank0.wait()


def test_what_cannot_run_tensor_parallel_is_refused_before_any_rank_starts(random_model_dir):
    from services.scheduler.engine.factory import build_engine
    from shared.settings import SchedulerSettings

    def build(**kw):
        return build_engine(SchedulerSettings(device="cpu", threads=1, max_kv_tokens=256, **kw), str(random_model_dir))

    with pytest.raises(UnshardableModel, match="must divide the query heads"):
        build(tensor_parallel_size=3)  # the demo model has 4 query heads
    with pytest.raises(ValueError, match="not supported: LoRA slots would have to be split"):
        build(tensor_parallel_size=2, max_loras=1)
    with pytest.raises(ValueError, match="needs the paged engine"):
        build(tensor_parallel_size=2, engine="simple")
