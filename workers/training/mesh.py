"""The job's device mesh: `data_parallel × ring × ulysses × tp`, named dims, flattened for sharding.

Rank = ((dp_index · ring_size + ring_rank) · ulysses_size + ulysses_rank) · tensor_size + tp_rank
(`workers.parallel_dims`): a tensor group is a contiguous block of ranks, a Ulysses group a block
of tensor groups, a ring a block of Ulysses groups, so the chattiest exchanges stay between
neighbours.

Every rank's weight gradient is a partial sum of the same loss (sequence-parallel ranks hold other
tokens of the same sequences, data-parallel replicas other sequences), so the training state is
sharded over every dimension but the tensor one: FSDP uses dp × ring × ulysses flattened into one
dimension (`shard_mesh`, torchtitan's `dp_shard_cp`), and its reduce-scatter is the gradient sum.
The tensor dimension (`tp_mesh`) splits heads and MLP columns instead (`parallelize`); its ranks
hold the same tokens, so they are not part of the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from workers.parallel_dims import ParallelDims

DIMS = ("dp", "ring", "ulysses", "tp")
SHARD_DIMS = ("dp", "ring", "ulysses")
SHARD_DIM = "dp_ring_ulysses"


@dataclass(frozen=True)
class Mesh:
    rank: int
    world: int
    data_parallel: int
    ring_size: int
    ring_group: dist.ProcessGroup | None  # None: single process without torch.distributed
    dp_group: dist.ProcessGroup | None
    ulysses_size: int = 1
    ulysses_group: dist.ProcessGroup | None = None
    device_mesh: DeviceMesh | None = None  # dims DIMS; None without torch.distributed
    shard_mesh: DeviceMesh | None = None  # SHARD_DIMS flattened: what FSDP shards over
    tensor_size: int = 1
    tp_mesh: DeviceMesh | None = None  # the "tp" dimension: what tensor parallelism splits over

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(self.data_parallel, self.ring_size, self.ulysses_size, self.tensor_size)

    @property
    def tp_rank(self) -> int:
        return self.dims.coordinates(self.rank).tp_rank

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return self.tp_mesh.get_group() if self.tp_mesh is not None else None

    @property
    def dp_index(self) -> int:
        return self.dims.coordinates(self.rank).dp_index

    @property
    def ring_rank(self) -> int:
        return self.dims.coordinates(self.rank).ring_rank

    @property
    def ulysses_rank(self) -> int:
        return self.dims.coordinates(self.rank).ulysses_rank

    @property
    def distributed(self) -> bool:
        return self.world > 1


def build_mesh(
    ring_size: int,
    data_parallel: int,
    ulysses_size: int = 1,
    device_type: str = "cpu",
    tensor_size: int = 1,
) -> Mesh:
    """The mesh over the initialized default group (collective: all ranks call it, in the same order).

    Without torch.distributed only a world of one is possible, and there is nothing to shard over."""
    dims = ParallelDims(data_parallel, ring_size, ulysses_size, tensor_size)
    if not (dist.is_available() and dist.is_initialized()):
        if dims.world_size != 1:
            raise RuntimeError(f"{dims.describe()} needs torch.distributed")
        return Mesh(0, 1, 1, 1, None, None)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != dims.world_size:
        raise RuntimeError(f"world size {world} != {dims.describe()}")
    mesh = init_device_mesh(
        device_type, (data_parallel, ring_size, ulysses_size, tensor_size), mesh_dim_names=DIMS
    )
    return Mesh(
        rank=rank,
        world=world,
        data_parallel=data_parallel,
        ring_size=ring_size,
        ring_group=mesh["ring"].get_group(),
        dp_group=mesh["dp"].get_group(),
        ulysses_size=ulysses_size,
        ulysses_group=mesh["ulysses"].get_group(),
        device_mesh=mesh,
        shard_mesh=mesh[SHARD_DIMS]._flatten(SHARD_DIM),
        tensor_size=tensor_size,
        tp_mesh=mesh["tp"] if tensor_size > 1 else None,
    )
