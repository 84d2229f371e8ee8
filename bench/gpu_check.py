"""The engine on a GPU, in one prepared run (bench/gpu_check.sh runs it; see there for bringing flashinfer).

    python bench/gpu_check.py run [--out FILE] [--budget-s 270]   # on the GPU machine
    python bench/gpu_check.py run --cpu-smoke                      # here: every section on CPU, tiny shapes,
                                                                   # flashinfer stood in by the tests' fake
    python bench/gpu_check.py trim flashinfer_python-0.7.4-py3-none-any.whl flashinfer-trimmed.zip
    python bench/gpu_check.py install WHEELS_DIR SITE_DIR          # unpack what the machine lacks

Sections, each written to the results file as soon as it is done, and skipped once --budget-s is spent:
1. environment: torch, CUDA, device, whether flashinfer imports (and why not), the first plan's JIT time;
2. agreement on the Qwen3-0.6B-shaped random model (bf16): logits of chunked prefill and decode, flashinfer
   against torch attention, graph replay against eager flashinfer; greedy text of a mixed workload (chunked
   prefill, mixed steps, n = 2, a prefix hit) through torch, flashinfer and flashinfer + CUDA graphs engines
   (bf16: agreement reported, not asserted);
3. decode steps at batch 1/64/256 for each engine: ms per step, tok/s, host ms per step (time not waiting
   for results), GPU ms per step from back-to-back replays of the captured graph, and the share of a step
   the GPU is busy;
4. host syncs per step by sampling mode (torch.cuda.set_sync_debug_mode warnings, plus the result waits);
5. sampling: frequencies of flashinfer's fused kernels and of the torch path against the filtered softmax;
6. lora (bf16, random adapters of rank 16 on every projection and rank 8 on q/v): greedy text of the base and
   4 adapters mixed, through grouped torch matmuls (torch attention, and flashinfer attention) and flashinfer's
   segment GEMM (eager, and from the LoRA decode graphs); the first segment GEMM warm-up's time (a JIT
   compile); decode ms per step at batch 16 and 64 with 0, 1 and 4 distinct adapters per engine;
7. tensor_parallel (bench/gpu_check_tp.py), on 2 GPUs or more: TP=1 vs TP=2 greedy agreement, decode ms per
   step, all-reduce time per step; skipped, saying so, on one GPU and on CPU.
Without flashinfer it reports the torch engine alone. Figures only: nothing here fails on a slow result.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
import warnings
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rope_theta=1_000_000.0, tie_word_embeddings=True)
SMOKE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False)


# ---- bringing flashinfer (no network on the GPU machine)

def trim(wheel: str, out: str) -> None:
    """flashinfer's wheel less what the engine never builds: its Python, the headers and the top-level
    csrc files the decode, fa2 prefill and sampling JIT generators read (0.7.4: 101 MB -> ~37 MB)."""

    def keep(name: str) -> bool:
        if ".dist-info/" in name:
            return True
        if not name.startswith("flashinfer/"):
            return False
        if name.startswith("flashinfer/data/"):
            rest = name[len("flashinfer/data/"):]
            return rest.split("/")[0] in ("include", "cutlass", "cccl") or (
                rest.startswith("csrc/") and rest.count("/") == 1)
        return name.endswith((".py", "py.typed"))

    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if keep(info.filename):
                zout.writestr(info, zin.read(info.filename))
    print(f"{out}: {Path(out).stat().st_size / 1e6:.1f} MB")


def install(wheels: str, site: str) -> None:
    """Unpack every wheel (and trimmed zip) of `wheels` whose top-level module does not import already into
    `site`; scripts of a wheel (ninja's binary) go to site/bin, executable."""
    import importlib.util

    Path(site).mkdir(parents=True, exist_ok=True)
    bin_dir = Path(site) / "bin"
    for path in sorted(Path(wheels).glob("*")):
        if path.suffix not in (".whl", ".zip"):
            continue
        with zipfile.ZipFile(path) as z:
            tops = {n.split("/")[0] for n in z.namelist() if not n.split("/")[0].endswith((".dist-info", ".data"))}
            modules = {t.removesuffix(".py") for t in tops if "." not in t.removesuffix(".py")}
            have = [m for m in modules if importlib.util.find_spec(m) is not None]
            if modules and len(have) == len(modules):
                print(f"  {path.name}: already importable ({', '.join(sorted(have))})")
                continue
            z.extractall(site)
            for name in z.namelist():
                if ".data/scripts/" in name and not name.endswith("/"):
                    bin_dir.mkdir(exist_ok=True)
                    target = bin_dir / Path(name).name
                    target.write_bytes((Path(site) / name).read_bytes())
                    target.chmod(0o755)
            print(f"  {path.name}: unpacked")


# ---- helpers

def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_model(shape: dict, dtype, device):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(**shape, initializer_range=0.05, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)  # random weights: a larger init, or greedy repeats
    return model.to(dtype).eval()


def clone(model):
    copy = type(model)(model.config.__class__.from_dict(model.config.to_dict()))
    copy.load_state_dict(model.state_dict())
    p = next(model.parameters())
    return copy.to(p.device, p.dtype).eval()


def engine(model, adapters=None, **kw):
    from services.scheduler.engine.config import EngineConfig
    from services.scheduler.engine.paged import PagedEngine

    cfg = dict(num_pages=512, page_size=16, max_running=16, prefill_budget=128, seed=0)
    cfg.update(kw)
    return PagedEngine(model, set(), EngineConfig(**cfg), adapters=adapters)


def prompts(lengths, vocab, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def drain(eng, arrivals, max_steps=20_000):
    out: dict = {}
    for step in range(max_steps):
        for req in arrivals.get(step, []):
            eng.add(req)
        if not eng.has_work() and step > max(arrivals, default=-1):
            return out
        for o in eng.step():
            out.setdefault(f"{o.uid}/{o.index}", []).extend(o.ids)
    raise RuntimeError("engine did not finish")


class Check:
    def __init__(self, args):
        import torch

        self.args, self.t0 = args, time.perf_counter()
        self.device = torch.device("cpu" if args.cpu_smoke else "cuda")
        self.dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
        self.shape = SMOKE if args.cpu_smoke else QWEN3_06B
        self.out = Path(args.out)
        self.report: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu_smoke": args.cpu_smoke,
                             "sections": {}, "skipped": []}
        self.variants: dict[str, dict] = {}

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t0)

    def section(self, name: str, fn, need_s: float) -> None:
        if self.left() < need_s:
            print(f"[{name}] skipped: {self.left():.0f} s of the budget left, it needs ~{need_s:.0f}", flush=True)
            self.report["skipped"].append(name)
            return
        print(f"[{name}] ...", flush=True)
        t = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # a section's failure is a figure too; the others still run
            import traceback

            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = round(time.perf_counter() - t, 2)
        self.report["sections"][name] = result
        self.save()
        print(f"[{name}] {json.dumps(result)[:1500]}", flush=True)

    def save(self) -> None:
        self.report["elapsed_s"] = round(time.perf_counter() - self.t0, 2)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.report, indent=2) + "\n")

    # ---- 1. environment

    def environment(self) -> dict:
        import torch
        import transformers

        from services.scheduler.engine.attention.flashinfer_backend import load_flashinfer

        if self.args.cpu_smoke:
            self._stand_in()
        module, why = load_flashinfer()
        env = {"python": platform.python_version(), "torch": torch.__version__,
               "transformers": transformers.__version__, "cuda": torch.version.cuda,
               "device": torch.cuda.get_device_name() if self.device.type == "cuda" else "cpu",
               "flashinfer": getattr(module, "__version__", None), "flashinfer_unavailable": why}
        self.flashinfer = module is not None
        self.model = make_model(self.shape, self.dtype, self.device)
        if self.flashinfer:  # the first plan and run JIT-compile the kernels (or find them cached)
            t = time.perf_counter()
            eng = engine(clone(self.model), backend="flashinfer", cuda_graphs=False, max_running=2)
            eng.warm_up()
            env["flashinfer_first_warm_up_s"] = round(time.perf_counter() - t, 1)
            eng.close()
        return env

    def _stand_in(self) -> None:
        """CPU smoke: the tests' signature-checked fake flashinfer and CUDA-graph stand-in."""
        from services.scheduler.engine.cuda_graph import DecodeGraphs
        from tests.unit.engine import fake_flashinfer

        sys.modules["flashinfer"] = fake_flashinfer.module()
        DecodeGraphs.api = fake_flashinfer.StandInGraphs()

    def engines(self) -> dict[str, dict]:
        out = {"torch": dict(backend="torch", cuda_graphs=False)}
        if self.flashinfer:
            out["flashinfer"] = dict(backend="flashinfer", cuda_graphs=False)
            out["flashinfer+graphs"] = dict(backend="flashinfer", cuda_graphs=True)
        return out

    # ---- 2. agreement

    def agreement(self) -> dict:
        from services.scheduler.engine.base import EngineRequest
        from shared.messages import SamplingParams

        vocab = self.shape["vocab_size"]
        result: dict = {}
        if self.flashinfer:
            result["logits"] = self._logit_diffs()
        ps = prompts([40, 7, 130, 3, 260, 65], vocab, seed=4)
        shared = ps[0][:32] + prompts([20], vocab, seed=5)[0]
        greedy = lambda count, **kw: SamplingParams(max_tokens=count, temperature=0.0, ignore_eos=True, **kw)  # noqa: E731
        arrivals = {0: [EngineRequest(f"p{i}", p, greedy(32)) for i, p in enumerate(ps[:3])],
                    2: [EngineRequest("n2", ps[3], greedy(24, n=2)), EngineRequest("long", ps[4], greedy(16))],
                    5: [EngineRequest("hit", shared, greedy(24)), EngineRequest("mid", ps[5], greedy(24))]}
        texts = {}
        for name, kw in self.engines().items():
            eng = engine(clone(self.model), **kw)
            texts[name] = drain(eng, arrivals)
            result.setdefault("prefix_hit_tokens", {})[name] = eng.stats()["prefix_hit_tokens"]
            eng.close()
        ref = texts["torch"]
        result["distinct_tokens_torch"] = len({t for ids in ref.values() for t in ids})
        for name, got in texts.items():
            if name == "torch":
                continue
            same = [k for k in ref if got.get(k) == ref[k]]
            first_diff = {k: next((i for i, (a, b) in enumerate(zip(ref[k], got.get(k, []), strict=False))
                                   if a != b), None) for k in ref if k not in same}
            result[f"{name}_vs_torch"] = {"identical": f"{len(same)}/{len(ref)}", "first_divergence": first_diff}
        return result

    def _logit_diffs(self) -> dict:
        """Runner-level: chunked prefill then decode of the same rows through torch and flashinfer attention
        (each its own KV cache, the same shuffled pages), and a decode replayed against eager flashinfer."""
        import torch

        from services.scheduler.engine.attention import RowSpec
        from services.scheduler.engine.config import make_backend
        from services.scheduler.engine.kv_cache import KVCache, PagePool, pages_for
        from services.scheduler.engine.model_geometry import attention_geometry
        from services.scheduler.engine.model_runner import ModelRunner

        ps = 16
        seqs = prompts([40, 7, 1, 29, 64, 150], self.shape["vocab_size"], seed=1)

        def runner(name):
            m = clone(self.model)
            kv = KVCache(attention_geometry(m).kv_shape(ps), 96, self.dtype, self.device)
            be = make_backend(name, kv, m, self.dtype)
            pool = PagePool(96, shuffle_seed=1, on_alloc=kv.zero_pages if be.name == "torch" else None)
            return ModelRunner(m, be, ps), pool, kv

        def steps(r, pool):
            pages = [pool.alloc(pages_for(len(s) + 4, ps)) for s in seqs]
            done, outs = [0] * len(seqs), []
            for _ in range(200):
                rows = sorted([(min(33, len(s) + 4 - done[i]), i) for i, s in enumerate(seqs)
                               if done[i] < len(s) + 4], key=lambda x: x[0] != 1)
                if not rows:
                    break
                specs = [RowSpec(pages[i], done[i], n) for n, i in rows]
                ids = [(seqs[i] + [5, 6, 7, 8])[done[i] + j] for n, i in rows for j in range(n)]
                outs.append(r.forward(specs, ids, list(range(len(ids)))).float())
                for n, i in rows:
                    done[i] += n
            return outs, pages

        (fi, fi_pool, _), (tr, tr_pool, _) = runner("flashinfer"), runner("torch")
        with torch.inference_mode():
            a, pages = steps(fi, fi_pool)
            b, _ = steps(tr, tr_pool)
        diff = max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
        agree = statistics.fmean(float((x.argmax(-1) == y.argmax(-1)).float().mean())
                                 for x, y in zip(a, b, strict=True))
        out = {"flashinfer_vs_torch_max_abs": diff, "argmax_agreement": agree,
               "logit_scale": float(b[0].abs().max())}
        # graph replay against eager flashinfer, on one decode row per sequence
        from services.scheduler.engine.cuda_graph import DecodeGraphs

        graphs = DecodeGraphs.capture(fi, fi.backend.kv, 8, 64)
        if graphs is not None:
            rows = [RowSpec(p, len(s) + 3, 1) for p, s in zip(pages, seqs, strict=True)]
            ids = [8] * len(rows)
            with torch.inference_mode():
                replayed = graphs.run(rows, ids).clone()
                eager = fi._eager(rows, ids, list(range(len(rows))), None)
            out["graph_vs_eager_max_abs"] = float((replayed - eager).abs().max())
        return out

    # ---- 3. decode steps

    def decode(self) -> dict:
        from services.scheduler.engine import transfer

        batches = [int(b) for b in self.args.batches.split(",")]
        result: dict = {}
        blocked = [0.0]  # seconds the host waited for a step's result since it was reset
        real_wait = transfer.DeviceResult.wait

        def wait(res):
            t = time.perf_counter()
            try:
                return real_wait(res)
            finally:
                blocked[0] += time.perf_counter() - t

        transfer.DeviceResult.wait = wait
        try:
            for name, kw in self.engines().items():
                result[name] = "skipped: budget" if self.left() < 30 else self._decode_engine(kw, batches, blocked)
        finally:
            transfer.DeviceResult.wait = real_wait
        return result

    def _decode_engine(self, kw: dict, batches: list[int], blocked: list[float]) -> dict:
        """One engine configuration's decode figures per batch size."""
        import torch

        per_seq = -(-(self.args.prompt_len + self.args.steps + 16) // 16) + 1
        eng = engine(clone(self.model), num_pages=max(batches) * per_seq + 8, max_running=max(batches),
                     prefill_budget=2048, **kw)
        rows = {str(b): self._decode_batch(eng, b, blocked) for b in batches}
        eng.close()
        del eng
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return rows

    def _decode_batch(self, eng, b: int, blocked: list[float]) -> dict:
        """`b` sequences prefilled, then `--steps` decode steps timed (and the host's share of them)."""
        from services.scheduler.engine.base import EngineRequest
        from shared.messages import SamplingParams

        steps, prompt_len = self.args.steps, self.args.prompt_len
        params = SamplingParams(max_tokens=steps + 12, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts([prompt_len] * b, self.shape["vocab_size"], seed=b)):
            eng.add(EngineRequest(f"b{b}-{i}", p, params))
        while any(not s.is_decode for s in eng.scheduler.running) or eng.scheduler.waiting:
            eng.step()
        for _ in range(4):
            eng.step()
        sync(self.device)
        blocked[0], t0, tokens = 0.0, time.perf_counter(), 0
        for _ in range(steps):
            tokens += sum(len(o.ids) for o in eng.step())
        sync(self.device)
        wall = (time.perf_counter() - t0) / steps
        r = {"ms_per_step": 1e3 * wall, "tok_per_s": tokens / (wall * steps),
             "host_ms_per_step": 1e3 * (wall - blocked[0] / steps)}
        graphs = eng.runner.graphs
        if graphs is not None:
            r["gpu_ms_per_replay"] = self._replay_ms(graphs, b)
            r["gpu_busy_share"] = r["gpu_ms_per_replay"] / r["ms_per_step"]
            r["plans"] = graphs.plans
        for i in range(b):
            eng.abort(f"b{b}-{i}")
        while eng.has_work():
            eng.step()
        return r

    def _replay_ms(self, graphs, batch: int, reps: int = 50) -> float:
        """GPU time of one decode forward: back-to-back replays of the graph of that size, timed by events."""
        import bisect

        import torch

        bs = graphs.sizes[bisect.bisect_left(graphs.sizes, batch)]
        graph = graphs.graphs[bs][0]
        if self.device.type != "cuda":  # the stand-in re-runs the forward: under inference mode, as replays are
            with torch.inference_mode():
                t = time.perf_counter()
                for _ in range(reps):
                    graphs.api.replay(graph)
            return 1e3 * (time.perf_counter() - t) / reps
        graphs.api.replay(graph)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graphs.api.replay(graph)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps

    # ---- 4. host syncs per step by sampling mode

    def syncs(self) -> dict:
        from services.scheduler.engine import transfer
        from shared.messages import SamplingParams

        modes = {"greedy": dict(temperature=0.0), "temperature": dict(temperature=1.0),
                 "top_k": dict(temperature=0.8, top_k=40), "top_p": dict(temperature=0.8, top_p=0.9),
                 "min_p": dict(temperature=0.8, min_p=0.05), "seed": dict(temperature=1.0, seed=3),
                 "penalties": dict(temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.3),
                 "logit_bias": dict(temperature=1.0, logit_bias={5: 2.0}),
                 "logprobs": dict(temperature=1.0, logprobs=True, top_logprobs=5)}
        kw = self.engines()["flashinfer+graphs" if self.flashinfer else "torch"]
        eng = engine(clone(self.model), num_pages=2048, max_running=64, prefill_budget=2048, **kw)
        waits = [0]  # waits for a step's result that had to block, since it was reset
        real_wait = transfer.DeviceResult.wait

        def wait(res):
            waits[0] += res._lists is None
            return real_wait(res)

        transfer.DeviceResult.wait = wait
        result: dict = {"engine": "flashinfer+graphs" if self.flashinfer else "torch"}
        try:
            for mode, extra in modes.items():
                for batch in (1, 4 if self.args.cpu_smoke else 64):
                    params = SamplingParams(max_tokens=40, ignore_eos=True, **extra)
                    result[f"{mode}@{batch}"] = self._syncs_per_step(eng, mode, params, batch, waits)
        finally:
            transfer.DeviceResult.wait = real_wait
            eng.close()
        return result

    def _syncs_per_step(self, eng, mode: str, params, batch: int, waits: list[int]) -> dict:
        """Host syncs torch flags (on CUDA) and result waits that blocked, per decode step of `batch` requests."""
        import torch

        from services.scheduler.engine.base import EngineRequest

        for i, p in enumerate(prompts([32] * batch, self.shape["vocab_size"], seed=7)):
            eng.add(EngineRequest(f"{mode}{i}", p, params))
        for _ in range(3):
            eng.step()
        sync(self.device)
        waits[0], steps = 0, 5
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if self.device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(steps):
                    eng.step()
            finally:
                if self.device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
        flagged = [str(w.message)[:120] for w in caught if "synchroniz" in str(w.message).lower()]
        for i in range(batch):
            eng.abort(f"{mode}{i}")
        while eng.has_work():
            eng.step()
        return {"flagged_syncs_per_step": len(flagged) / steps, "result_waits_per_step": waits[0] / steps,
                "examples": sorted(set(flagged))[:3]}

    # ---- 5. sampling kernels against the filtered softmax

    def sampling(self) -> dict:
        import torch

        from services.scheduler.engine.sampling import Sampler, SampleRow
        from shared.messages import SamplingParams

        rows, vocab = 4096, 64
        g = torch.Generator().manual_seed(0)
        base = torch.randn(vocab, generator=g) * 0.7
        logits = base.repeat(rows, 1).to(self.device)
        result = {}
        for label, p in {"temperature": SamplingParams(temperature=0.8),
                         "top_k_top_p": SamplingParams(temperature=0.8, top_k=10, top_p=0.8)}.items():
            x = base / p.temperature
            keep = torch.ones(vocab, dtype=torch.bool)
            if p.top_k:
                order = x.argsort(descending=True)
                keep[:] = False
                keep[order[:p.top_k]] = True
                probs = x.masked_fill(~keep, float("-inf")).softmax(-1)
                sp, so = probs.sort(descending=True)
                drop = (sp.cumsum(-1) - sp) > p.top_p
                keep[so[drop]] = False
            want = x.masked_fill(~keep, float("-inf")).softmax(-1)
            for path in ("torch", "flashinfer"):
                sampler = Sampler(set(), self.device, seed=1,
                                  flashinfer=sys.modules.get("flashinfer") if path == "flashinfer" else None)
                if path == "flashinfer" and sampler.fused is None:
                    if not (self.args.cpu_smoke and self.flashinfer):
                        continue
                    sampler.fused = sys.modules["flashinfer"].sampling
                ids = torch.tensor(sampler(logits, [SampleRow(p, 0, 0, [0], 1)] * rows).ids)
                got = torch.bincount(ids, minlength=vocab).float() / rows
                result[f"{label}/{path}"] = {"total_variation": float((got - want).abs().sum() / 2),
                                             "outside_filter": float(got[~keep].sum())}
        return result


    # ---- 6. LoRA adapters: segment GEMM and LoRA graphs against grouped matmuls, and their step cost

    def lora(self) -> dict:
        import tempfile

        import torch

        from services.scheduler.engine.lora_weights import AdapterFolders

        model = clone(self.model).to(torch.bfloat16)  # the segment GEMM's kernels are 16-bit (CPU smoke too)
        with tempfile.TemporaryDirectory() as tmp:
            folders = {f"a{k}": Path(tmp) / f"a{k}" for k in range(4)}
            for k, folder in enumerate(folders.values()):
                write_adapter(model, folder, rank=16 if k % 2 == 0 else 8, seed=k,
                              targets=None if k % 2 == 0 else ("q_proj", "v_proj"))
            source = AdapterFolders(folders)
            kinds = {"torch": dict(backend="torch", cuda_graphs=False)}
            if self.flashinfer:
                kinds.update({"flashinfer+grouped": dict(backend="flashinfer", cuda_graphs=False, lora_backend="torch"),
                              "flashinfer+segment": dict(backend="flashinfer", cuda_graphs=False),
                              "flashinfer+segment+graphs": dict(backend="flashinfer", cuda_graphs=True)})
            result: dict = {"texts": self._lora_texts(model, source, kinds)}
            if self.left() > 40:
                result["decode"] = self._lora_decode(model, source, kinds)
        return result

    def _lora_texts(self, model, source, kinds: dict) -> dict:
        from services.scheduler.engine.base import EngineRequest
        from shared.messages import SamplingParams

        ps = prompts([40, 9, 130, 21, 64], self.shape["vocab_size"], seed=14)
        greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        arrivals = {0: [EngineRequest("base", ps[0], greedy), EngineRequest("a0", ps[1], greedy, adapter="a0")],
                    2: [EngineRequest(f"a{k}", ps[k + 1], greedy, adapter=f"a{k}") for k in (1, 2, 3)] +
                       [EngineRequest("a0-again", ps[0], greedy, adapter="a0")]}
        texts, out = {}, {}
        for name, kw in kinds.items():
            t = time.perf_counter()
            eng = engine(clone(model), max_loras=4, adapters=source, **kw)
            eng.warm_up()
            out.setdefault("warm_up_s", {})[name] = round(time.perf_counter() - t, 1)
            texts[name] = drain(eng, arrivals)
            graphs = eng.runner.graphs
            if graphs is not None:
                out.setdefault("lora_replays", {})[name] = [graphs.lora_replays, graphs.replays]
            eng.close()
        ref = next(iter(texts.values()))
        out["differs_from_base"] = sum(ref[k] != ref["base/0"] for k in ref if k != "base/0")
        for name, got in texts.items():
            out[f"{name}_vs_{next(iter(texts))}"] = f"{sum(got.get(k) == v for k, v in ref.items())}/{len(ref)}"
        if "flashinfer+grouped" in texts:
            grouped = texts["flashinfer+grouped"]
            for name in ("flashinfer+segment", "flashinfer+segment+graphs"):
                out[f"{name}_vs_flashinfer+grouped"] = f"{sum(texts[name].get(k) == v for k, v in grouped.items())}" \
                                                      f"/{len(grouped)}"
        return out

    def _lora_decode(self, model, source, kinds: dict) -> dict:
        from services.scheduler.engine.base import EngineRequest
        from shared.messages import SamplingParams

        steps, result = max(3, self.args.steps // 2), {}
        timed = ("flashinfer+segment+graphs",) if self.args.cpu_smoke else ("torch", "flashinfer+segment+graphs")
        for name in [k for k in kinds if k in timed]:
            eng = engine(clone(model), num_pages=2048, max_running=64, prefill_budget=2048, max_loras=4,
                         adapters=source, **kinds[name])
            rows = {}
            for batch in (4,) if self.args.cpu_smoke else (16, 64):
                for distinct in (0, 1, 4):
                    params = SamplingParams(max_tokens=steps + 12, temperature=0.0, ignore_eos=True)
                    for i, p in enumerate(prompts([32] * batch, self.shape["vocab_size"], seed=batch)):
                        eng.add(EngineRequest(f"r{i}", p, params, adapter=f"a{i % distinct}" if distinct else None))
                    while eng.scheduler.waiting or any(not s.is_decode for s in eng.scheduler.running):
                        eng.step()
                    for _ in range(3):
                        eng.step()
                    sync(self.device)
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        eng.step()
                    sync(self.device)
                    rows[f"{batch}x{distinct}"] = round(1e3 * (time.perf_counter() - t0) / steps, 3)
                    for i in range(batch):
                        eng.abort(f"r{i}")
                    while eng.has_work():
                        eng.step()
            result[name] = {"ms_per_step (batch x distinct adapters)": rows, **eng.stats()}
            eng.close()
        return result


def write_adapter(model, folder: Path, rank: int, seed: int, targets=None) -> None:
    """A random PEFT LoRA folder (what peft's save_pretrained writes) on `targets` (None: every projection)."""
    import torch
    from safetensors.torch import save_file

    from shared.lora_folder import LORA_TARGETS

    targets = targets or LORA_TARGETS
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, module in model.named_modules():
        if name.split(".")[-1] in targets and isinstance(module, torch.nn.Linear):
            weights[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=g) / 32
            weights[f"base_model.model.{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=g) / 8
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                            "target_modules": list(targets), "bias": "none"}))


def run(args: argparse.Namespace) -> None:
    import torch

    torch.manual_seed(0)
    if args.cpu_smoke:
        torch.set_num_threads(1)
        args.batches, args.steps, args.prompt_len = "1,4,8", 3, 20
    check = Check(args)
    check.section("environment", check.environment, 0)
    check.section("agreement", check.agreement, 60)
    check.section("decode", check.decode, 60)
    check.section("syncs", check.syncs, 30)
    check.section("sampling", check.sampling, 5)
    check.section("lora", check.lora, 60)
    from bench.gpu_check_tp import tp_section  # 7: two GPUs or more; skipped, saying so, on one

    check.section("tensor_parallel", lambda: tp_section(check), 90)
    check.save()
    print(f"wrote {check.out} after {check.report['elapsed_s']} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--cpu-smoke", action="store_true")
    r.add_argument("--out", default=os.path.join(os.environ.get("OUT") or str(ROOT / "bench" / "results"),
                                                 "gpu-check.json"))
    r.add_argument("--budget-s", type=float, default=270.0, help="sections start only while this much is left")
    r.add_argument("--batches", default="1,64,256")
    r.add_argument("--steps", type=int, default=30)
    r.add_argument("--prompt-len", type=int, default=128)
    t = sub.add_parser("trim")
    t.add_argument("wheel")
    t.add_argument("out")
    i = sub.add_parser("install")
    i.add_argument("wheels")
    i.add_argument("site")
    args = ap.parse_args()
    if args.cmd == "trim":
        trim(args.wheel, args.out)
    elif args.cmd == "install":
        install(args.wheels, args.site)
    else:
        with contextlib.suppress(KeyboardInterrupt):
            run(args)


if __name__ == "__main__":
    main()
