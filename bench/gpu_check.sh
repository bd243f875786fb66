#!/usr/bin/env bash
# Ring attention on CUDA: exactness, block-kernel TFLOP/s vs torch SDPA, and the ring on every visible GPU.
# Usage (repo root, .venv set up with a CUDA torch): bench/gpu_check.sh   — a few minutes at most.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'"
"$PY" -m pytest -q -m gpu tests/test_attention.py
"$PY" -m bench.gpu_check
n=$("$PY" -c "import torch; print(torch.cuda.device_count())")
"$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" -m bench.gpu_check
