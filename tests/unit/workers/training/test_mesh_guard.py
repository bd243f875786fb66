"""The mesh's in-process parts (workers/training/mesh.py): which rows a rank takes, which groups it
exposes, and that a multi-rank shape needs torch.distributed. No process group: `Mesh` is built
directly, and a world of one is what `build_mesh` gives without torch.distributed."""

from __future__ import annotations

import pytest
import torch

from workers.data.batch import from_windows
from workers.parallel_dims import ParallelDims
from workers.training.mesh import Mesh, build_mesh


def _batch(rows: int = 4, seq: int = 8) -> torch.Tensor:
    return torch.arange(rows * (seq + 1)).reshape(rows, seq + 1)


def test_a_replica_takes_its_rows_unless_the_batch_is_replicated() -> None:
    windows = _batch()
    batch = from_windows(windows)
    mesh = Mesh(ParallelDims(data_parallel=2), rank=1)  # replica 1 of 2
    assert mesh.dp_index == 1
    mine = mesh.shard(batch, "zigzag")
    assert mine.inputs.tolist() == windows[2:4, :-1].tolist()
    assert mine.labels.tolist() == windows[2:4, 1:].tolist()
    every = mesh.shard(batch, "zigzag", replicated=True)
    assert every.inputs.tolist() == windows[:, :-1].tolist()
    assert every.positions.tolist() == list(range(8))


def test_groups_of_a_size_one_dimension_are_none() -> None:
    """A dimension of size one has no collective to run, even if a group object exists for it."""
    fake = {"ulysses": object(), "tp": object(), "pp": object(), "ring": object()}
    mesh = Mesh(ParallelDims(ring_size=2), rank=0, groups=fake)  # type: ignore[arg-type]
    assert mesh.ring_group is fake["ring"]
    assert mesh.ulysses_group is None and mesh.tp_group is None and mesh.pp_group is None
    wide = Mesh(ParallelDims(1, 1, 2, 2, 2), rank=0, groups=fake)  # type: ignore[arg-type]
    assert wide.ulysses_group is fake["ulysses"] and wide.tp_group is fake["tp"]
    assert wide.pp_group is fake["pp"]


def test_build_mesh_without_torch_distributed() -> None:
    assert build_mesh(ParallelDims()).world == 1
    with pytest.raises(RuntimeError, match=r"needs torch\.distributed"):
        build_mesh(ParallelDims(ring_size=2))
