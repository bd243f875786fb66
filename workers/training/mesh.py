"""The 2-D mesh `data_parallel × ring_size` and gradient reduction over it.

Rank = dp_index · ring_size + ring_rank, so each ring is a contiguous block of ranks (on a node, the
ring's neighbours are adjacent GPUs). Sequence-parallel ranks hold different tokens of the same
sequences, and data-parallel replicas hold different sequences; either way every rank's weight
gradient is a partial sum of the same loss, so gradients are summed over *all* ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

BUCKET_BYTES = 25 * 1024 * 1024


@dataclass(frozen=True)
class Mesh:
    rank: int
    world: int
    data_parallel: int
    ring_size: int
    ring_group: dist.ProcessGroup | None  # None: single process without torch.distributed
    dp_group: dist.ProcessGroup | None

    @property
    def dp_index(self) -> int:
        return self.rank // self.ring_size

    @property
    def ring_rank(self) -> int:
        return self.rank % self.ring_size

    @property
    def distributed(self) -> bool:
        return self.world > 1


def build_mesh(ring_size: int, data_parallel: int) -> Mesh:
    """Create the ring and data-parallel groups from the initialized default group (collective: all ranks call it)."""
    if not (dist.is_available() and dist.is_initialized()):
        if ring_size * data_parallel != 1:
            raise RuntimeError(f"ring_size={ring_size} × data_parallel={data_parallel} needs torch.distributed")
        return Mesh(0, 1, 1, 1, None, None)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != ring_size * data_parallel:
        raise RuntimeError(f"world size {world} != ring_size {ring_size} × data_parallel {data_parallel}")
    ring_group = dp_group = None
    # new_group is collective over the default group: every rank creates every group, in the same order.
    for d in range(data_parallel):
        g = dist.new_group(list(range(d * ring_size, (d + 1) * ring_size)))
        if rank // ring_size == d:
            ring_group = g
    for r in range(ring_size):
        g = dist.new_group(list(range(r, world, ring_size)))
        if rank % ring_size == r:
            dp_group = g
    return Mesh(rank, world, data_parallel, ring_size, ring_group, dp_group)


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive same-dtype/device runs of at most ~bucket_bytes each."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not out or size + nbytes > bucket_bytes or (t.dtype, t.device) != (out[-1][0].dtype, out[-1][0].device):
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return out


@torch.no_grad()
def all_reduce_grads(
    params: list[torch.nn.Parameter], extra: torch.Tensor | None = None, bucket_bytes: int = BUCKET_BYTES
) -> torch.Tensor | None:
    """Sum gradients over all ranks in a few flat buckets; `extra` (small stats) rides in the last one.

    Missing grads (parameters not used this step) count as zeros so every rank sends the same layout.
    Returns the reduced `extra`.
    """
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    tensors = [p.grad for p in params]
    if extra is not None:
        tensors.append(extra)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return extra
    for bucket in _buckets(tensors, bucket_bytes):
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat)
        for t, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            t.copy_(reduced)
    return extra
