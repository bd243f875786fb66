"""Step checkpoints: `step-000050/` with weights (safetensors), training state and per-rank RNG.

Written atomically: everything goes into a hidden temporary directory, is fsynced, and the directory
is renamed into place; a reader only ever considers `step-NNNNNN` names, so a crash mid-write leaves
nothing that can be picked up. Rank 0 writes the replicated state (weights, optimizer, scheduler,
data position); each rank writes its own RNG states.

    step-000050/model.safetensors   fp32 weights
    step-000050/state.pt            {"step", "optimizer", "scheduler", "data", "extra"}
    step-000050/rng-rank00003.pt    torch/cuda (own device)/python/numpy RNG of rank 3
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

STEP_DIR = re.compile(r"^step-(\d{6,})$")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def _dist() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if _dist()[1] > 1:
        dist.barrier()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_steps(root: str | Path) -> list[int]:
    """Completed checkpoint steps in `root`, ascending (temporary directories are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / "model.safetensors").exists() and (p / "state.pt").exists():
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_step(root: str | Path) -> int | None:
    steps = list_steps(root)
    return steps[-1] if steps else None


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # This rank's device only: *_all would create a context on every GPU the process can see.
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(root: str | Path, step: int, model: nn.Module, state: dict[str, Any], keep: int) -> Path:
    """Collective: every rank calls it. Returns the final directory. `state` is rank 0's replicated state."""
    rank, _ = _dist()
    root = Path(root)
    final = step_dir(root, step)
    tmp = root / f".tmp-{final.name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a crash
        tmp.mkdir()
    _barrier()
    rng_file = tmp / f"rng-rank{rank:05d}.pt"
    torch.save(rng_state(), rng_file)
    _fsync(rng_file)
    if rank == 0:
        weights, seen = {}, set()
        for k, v in model.state_dict().items():
            t = v.detach().to("cpu", torch.float32).contiguous()
            if t.data_ptr() in seen:  # tied weights (a head sharing the embedding): safetensors refuses aliases
                t = t.clone()
            seen.add(t.data_ptr())
            weights[k] = t
        save_file(weights, tmp / "model.safetensors", metadata={"step": str(step)})
        torch.save({"step": step, **state}, tmp / "state.pt")
        for name in ("model.safetensors", "state.pt"):
            _fsync(tmp / name)
    _barrier()  # every rank's RNG file is on disk before the directory becomes visible
    if rank == 0:
        _fsync(tmp)
        if final.exists():  # re-saving a step (e.g. after a restart): swap, never leave a half state
            old = root / f".old-{final.name}"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        _fsync(root)
        for old_step in list_steps(root)[:-keep]:
            shutil.rmtree(step_dir(root, old_step), ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(root: str | Path, step: int, model: nn.Module) -> dict[str, Any]:
    """Load weights into `model` (on its device), restore this rank's RNG if saved; return the state dict."""
    path = step_dir(root, step)
    rank, _ = _dist()
    device = next(model.parameters()).device
    weights = load_file(path / "model.safetensors", device="cpu")
    missing, unexpected = model.load_state_dict({k: v.to(device) for k, v in weights.items()}, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}")
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    rng_file = path / f"rng-rank{rank:05d}.pt"
    if rng_file.exists():  # a different world size has no file for new ranks; their RNG is not used for math
        set_rng_state(torch.load(rng_file, weights_only=False))
    return state
