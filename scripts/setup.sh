#!/usr/bin/env bash
# Create/reuse .venv and install ringtrain with its dev tools.
# torch first, chosen for this machine: a CUDA build where a GPU is visible, a CPU build otherwise
# (an unpinned `pip install torch` on a CPU box pulls a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
TORCH_VERSION="${RINGTRAIN_TORCH_VERSION:-2.13.0}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)

stamp=.venv/.ringtrain-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi

echo "ringtrain setup: installing into .venv (first run takes a few minutes)..."
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${PIP[@]}" install "torch==$TORCH_VERSION"
  elif curl -sfm 5 -o /dev/null https://download.pytorch.org/whl/cpu/torch/ 2>/dev/null; then
    "${PIP[@]}" install "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
  else
    # Package-registry-only networks (like CI here) serve a local CPU wheel for this pin.
    "${PIP[@]}" install "torch==$TORCH_VERSION"
  fi
fi
"${PIP[@]}" install -e ".[dev]"
if .venv/bin/python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  "${PIP[@]}" install -e ".[cuda]" --no-build-isolation || echo "flash-attn not installed; torch's CUDA attention kernels will be used."
fi
echo "$want" > "$stamp"
