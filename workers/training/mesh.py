"""The job's device mesh: `[pp ×] data_parallel × ring × ulysses × tp`, named dims, flattened for
sharding.

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

Pipeline parallelism (`parallel.pipeline_size` P > 1) adds `pp` as the outermost dimension: each
pipeline rank's slice is the 4-D mesh above, holding its stages' layers only, and `shard_mesh` is
that slice's dp × ring × ulysses (a stage's gradients are summed over its own slice; the stages
hold different parameters). Without a pipeline the mesh stays 4-D, exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from workers.data.batch import Batch, take_shard
from workers.parallel_dims import ParallelDims, RankCoordinates

DIMS = ("dp", "ring", "ulysses", "tp")
PP_DIM = "pp"
SHARD_DIMS = ("dp", "ring", "ulysses")
SHARD_DIM = "dp_ring_ulysses"


@dataclass(frozen=True)
class Mesh:
    """The shape (`dims`, the only copy of the degrees) and this rank's groups in it."""

    dims: ParallelDims = field(default_factory=ParallelDims)
    rank: int = 0
    device_mesh: DeviceMesh | None = None  # dims DIMS; None without torch.distributed
    shard_mesh: DeviceMesh | None = None  # SHARD_DIMS flattened: what FSDP shards over
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict, compare=False)  # by DIMS

    @property
    def world(self) -> int:
        return self.dims.world_size

    @property
    def data_parallel(self) -> int:
        return self.dims.data_parallel

    @property
    def ring_size(self) -> int:
        return self.dims.ring_size

    @property
    def ulysses_size(self) -> int:
        return self.dims.ulysses_size

    @property
    def tensor_size(self) -> int:
        return self.dims.tensor_size

    @property
    def pipeline_size(self) -> int:
        return self.dims.pipeline_size

    @property
    def pp_rank(self) -> int:
        return self.at.pp_rank

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The pipeline's stage-to-stage group (None without pipeline parallelism)."""
        return self.groups.get(PP_DIM) if self.pipeline_size > 1 else None

    @property
    def at(self) -> RankCoordinates:
        return self.dims.coordinates(self.rank)

    @property
    def dp_index(self) -> int:
        return self.at.dp_index

    @property
    def ring_rank(self) -> int:
        return self.at.ring_rank

    @property
    def ulysses_rank(self) -> int:
        return self.at.ulysses_rank

    @property
    def tp_rank(self) -> int:
        return self.at.tp_rank

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def ring_group(self) -> dist.ProcessGroup | None:
        """None: a single process without torch.distributed (the whole sequence is local)."""
        return self.groups.get("ring")

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.groups.get("dp")

    @property
    def ulysses_group(self) -> dist.ProcessGroup | None:
        """The Ulysses all-to-all's group; None when ulysses_size is 1 (there is no all-to-all)."""
        return self.groups.get("ulysses") if self.ulysses_size > 1 else None

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The "tp" dimension: what tensor parallelism splits over (None without it)."""
        return (
            self.device_mesh["tp"]
            if self.device_mesh is not None and self.tensor_size > 1
            else None
        )

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return self.groups.get("tp") if self.tensor_size > 1 else None

    def shard(self, batch: Batch, layout: str, *, replicated: bool = False) -> Batch:
        """This rank's part of a global batch: its replica's rows and its sequence shard.

        `replicated`: every replica runs every row (verification and the passkey grid run the
        same sequences everywhere), so only the sequence is split."""
        return take_shard(
            batch,
            dp_index=0 if replicated else self.dp_index,
            dp_size=1 if replicated else self.data_parallel,
            layout=layout,
            ring_group=self.ring_group,
            ulysses_group=self.ulysses_group,
        )


def build_mesh(dims: ParallelDims, device_type: str = "cpu") -> Mesh:
    """The mesh over the initialized default group (collective: all ranks call it, in the same
    order).

    Without torch.distributed only a world of one is possible, and there is nothing to shard
    over."""
    if not (dist.is_available() and dist.is_initialized()):
        if dims.world_size != 1:
            raise RuntimeError(f"{dims.describe()} needs torch.distributed")
        return Mesh(dims)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != dims.world_size:
        raise RuntimeError(f"world size {world} != {dims.describe()}")
    shape: tuple[int, ...] = (
        dims.data_parallel,
        dims.ring_size,
        dims.ulysses_size,
        dims.tensor_size,
    )
    names: tuple[str, ...] = DIMS
    if dims.pipeline_size > 1:  # outermost: a pipeline rank's slice is one contiguous block
        shape, names = (dims.pipeline_size, *shape), (PP_DIM, *DIMS)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    groups = {dim: mesh[dim].get_group() for dim in names}
    return Mesh(dims, rank, mesh, mesh[SHARD_DIMS]._flatten(SHARD_DIM), groups)
