"""How a global sequence is split across a ring: contiguous, zigzag and striped layouts.

`shard_positions` is the single source of truth; sharding/unsharding are gathers by it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from workers.parallel_dims import LAYOUTS as LAYOUTS  # re-exported: `workers.attention.LAYOUTS`
from workers.parallel_dims import chunks_per_rank


def check_layout(layout: str) -> None:
    chunks_per_rank(layout)  # raises for a layout not in LAYOUTS


def seq_multiple(layout: str, world: int) -> int:
    """The global sequence length must be a multiple of this."""
    return chunks_per_rank(layout) * world


def shard_positions(seq_len: int, layout: str, rank: int, world: int) -> torch.Tensor:
    """Global position ids (int64, ascending) of the tokens that `rank` holds."""
    check_layout(layout)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a ring of {world}")
    multiple = seq_multiple(layout, world)
    if seq_len % multiple:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {multiple} "
            f"({layout} layout, {world} ranks)"
        )
    if layout == "contiguous":
        n = seq_len // world
        return torch.arange(rank * n, (rank + 1) * n)
    if layout == "striped":
        return torch.arange(rank, seq_len, world)
    c = seq_len // (2 * world)
    first = torch.arange(rank * c, (rank + 1) * c)
    second = torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c)
    return torch.cat([first, second])


def _rank_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def shard_sequence(
    x: torch.Tensor, dim: int, layout: str, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """This rank's shard of the full tensor `x` along `dim` (a contiguous copy)."""
    rank, world = _rank_world(group)
    pos = shard_positions(x.shape[dim], layout, rank, world).to(x.device)
    return x.index_select(dim, pos).contiguous()


def unshard_sequence(
    x_local: torch.Tensor, dim: int, layout: str, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-gather the shards of the group and restore the global order along `dim`."""
    _, world = _rank_world(group)
    if world == 1:
        return x_local
    parts = [torch.empty_like(x_local) for _ in range(world)]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    seq_len = x_local.shape[dim] * world
    order = torch.cat([shard_positions(seq_len, layout, r, world) for r in range(world)]).to(
        x_local.device
    )
    out = torch.empty_like(torch.cat(parts, dim=dim))
    out.index_copy_(dim, order, torch.cat(parts, dim=dim))
    return out
