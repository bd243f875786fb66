"""TEMPORARY: exact but gather-based placeholder with the final signature; the real ring replaces it."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnf

from workers.attention.layouts import _rank_world, shard_positions


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    layout: str = "zigzag",
    group: dist.ProcessGroup | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    rank, world = _rank_world(group)
    if world > 1:
        k = torch.cat(dnf.all_gather(k.contiguous(), group=group), dim=1)
        v = torch.cat(dnf.all_gather(v.contiguous(), group=group), dim=1)
    s_local = q.shape[1]
    s = s_local * world
    qpos = shard_positions(s, layout, rank, world)
    kpos = torch.cat([shard_positions(s, layout, r, world) for r in range(world)])
    mask = None
    if causal:
        mask = (kpos[None, :] <= qpos[:, None]).to(q.device)
    rep = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=softmax_scale
    )
    return out.transpose(1, 2)
