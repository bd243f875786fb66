"""Step checkpoints with torch.distributed.checkpoint (DCP): every rank writes only the shards it
holds.

    step-000050/
        .metadata, __<rank>_0.distcp   model + optimizer state (DCP: sharded, global shapes)
        rng-rank00003.pt               torch/cuda (own device)/python/numpy RNG of rank 3
        state.pt                       {"step", "scheduler", "data", "extra"}: rank 0, written last

Because DCP records every tensor by its global shape and each shard by its offsets, a checkpoint
loads into any sharding: another ring size, data-parallel width or Ulysses size, or one unsharded
process (`read_weights`, `load_checkpoint` on a plain model). The model is saved under its clean
parameter names (`get_state_dict` drops FSDP and activation-checkpoint wrappers).

Atomic: everything goes into a hidden `.tmp-step-…` directory, is fsynced, then renamed into place,
and a `step-…` directory counts only with its `state.pt` (written after every rank's files are on
disk), so a crash mid-write leaves nothing that can be picked up. Re-saving a step swaps the old one
out whole, and retention renames a step out of sight (`.old-step-…`) before deleting it, so a crash
mid-delete cannot either.
"""

from __future__ import annotations

import os
import random
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from workers.checkpoint_layout import STATE_FILE, latest_step, list_steps, step_dir

__all__ = [
    "STATE_FILE",
    "latest_step",
    "list_steps",
    "load_checkpoint",
    "read_weights",
    "save_checkpoint",
    "step_dir",
]


def _dist() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if _dist()[1] > 1:
        dist.barrier()


@contextmanager
def _dcp(single: bool) -> Iterator[None]:
    """DCP warns on every single-process save/load that it assumes one process: that is the intent
    here."""
    with warnings.catch_warnings():
        if single:
            warnings.filterwarnings(
                "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
            )
        yield


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _tensor_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What DCP saves and loads in place: {"model": …, "optim": …} with sharded (DTensor) values
    under FSDP."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _hide(step: Path) -> None:
    """Rename a step out of sight; `_sweep` deletes it. A process killed mid-delete must not leave a
    visible step whose marker survived and whose shards did not."""
    step.rename(step.with_name(f".old-{step.name}"))


def _sweep(root: Path) -> None:
    """Delete the hidden old steps (this save's, or a crashed save's)."""
    _fsync(root)
    for hidden in root.glob(".old-step-*"):
        shutil.rmtree(hidden, ignore_errors=True)


def save_checkpoint(
    root: str | Path,
    step: int,
    model: nn.Module,
    state: dict[str, Any],
    keep: int,
    optimizer: torch.optim.Optimizer | None = None,
) -> Path:
    """Collective: every rank calls it. Returns the final directory. `state` is rank 0's replicated
    state."""
    rank, _ = _dist()
    root = Path(root)
    final = step_dir(root, step)
    tmp = root / f".tmp-{final.name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a crash
        _sweep(root)
        tmp.mkdir()
    _barrier()
    single = _dist()[1] == 1
    with _dcp(single):
        # collective; fsyncs
        dcp_save(_tensor_state(model, optimizer), checkpoint_id=tmp, no_dist=single)
    rng_file = tmp / f"rng-rank{rank:05d}.pt"
    torch.save(rng_state(), rng_file)
    _fsync(rng_file)
    _barrier()  # every rank's shards and RNG are on disk before the marker is written
    if rank == 0:
        torch.save({"step": step, **state}, tmp / STATE_FILE)
        _fsync(tmp / STATE_FILE)
        _fsync(tmp)
        # re-saving a step (e.g. after a restart): swap, never leave a half state
        if final.exists():
            _hide(final)
        tmp.rename(final)
        for old_step in list_steps(root)[:-keep]:
            _hide(step_dir(root, old_step))
        _sweep(root)
    _barrier()
    return final


def load_checkpoint(
    root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load the weights (and optimizer state) into this rank's shards, restore its RNG if saved;
    return state.pt.

    Collective when the model is sharded; a plain model on one process loads the whole state."""
    path = step_dir(root, step)
    rank, _ = _dist()
    tensors = _tensor_state(model, optimizer)
    single = _dist()[1] == 1
    with _dcp(single):
        # raises naming any key the checkpoint lacks
        dcp_load(tensors, checkpoint_id=path, no_dist=single)
    if optimizer is None:
        set_model_state_dict(model, tensors["model"])
    else:
        set_state_dict(
            model, optimizer, model_state_dict=tensors["model"], optim_state_dict=tensors["optim"]
        )
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    rng_file = path / f"rng-rank{rank:05d}.pt"
    # a different world size has no file for new ranks; their RNG is not used for math
    if rng_file.exists():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return state


def read_weights(root: str | Path, step: int) -> dict[str, torch.Tensor]:
    """The full (unsharded) model weights of a checkpoint on CPU, by parameter name; needs no
    process group."""
    path = step_dir(root, step)
    meta = FileSystemReader(str(path)).read_metadata()
    want = {
        key: torch.empty(m.size, dtype=m.properties.dtype)
        for key, m in meta.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    with _dcp(True):
        dcp_load(want, checkpoint_id=path, no_dist=True)
    return {key.removeprefix("model."): value for key, value in want.items()}
