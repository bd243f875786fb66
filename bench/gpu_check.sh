#!/usr/bin/env bash
# Ring attention on CUDA: every CUDA backend's forward and backward (dq/dk/dv) vs float64, dense and packed,
# block-kernel TFLOP/s vs torch SDPA, the ring (forward + backward) on every visible GPU, and pipeline
# parallel (pp 2) against one process (CPU always; CUDA where 2 or more GPUs are visible).
# Usage (repo root, .venv set up with a CUDA torch): bench/gpu_check.sh   — a few minutes at most.
# Every step runs even when an earlier one fails; the exit status is non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'" || exit 1
status=0
step() { echo "== $*"; "$@" || { echo "== FAILED: $*"; status=1; }; }
step "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/unit/workers/attention/test_attention_gpu.py tests/unit/workers/attention/test_attention.py
step "$PY" -m bench.gpu_check
n=$("$PY" -c "import torch; print(torch.cuda.device_count())")
step "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" -m bench.gpu_check
step "$PY" -m bench.gpu_check --pipeline   # pp 2 vs one process: CPU always, CUDA with >= 2 GPUs
exit $status
