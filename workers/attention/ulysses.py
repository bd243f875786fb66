"""Ulysses × ring (USP): all-to-all over heads inside a Ulysses group, ring attention across the
ring group.

Rank layout (the trainer builds its groups from `usp_group_ranks`): U = ulysses_size consecutive
global ranks form a Ulysses group (put them inside one node: the all-to-all is the heavy,
latency-bound exchange), and ranks u, u + U, u + 2U, … of one data-parallel replica form a ring
group (K/V cross nodes).

Sequence layout: the global sequence is first split over the R ring ranks by the ring layout
(contiguous, zigzag or striped, as in `shard_positions`); ring rank r's shard is then cut into U
contiguous pieces, one per Ulysses member (`usp_shard_positions`). The first all-to-all gathers the
U pieces (so each member holds ring rank r's whole shard) and scatters heads (each member keeps H/U
query heads); ring attention runs over the ring group; the second all-to-all restores [seq_local,
all heads].

GQA rule: H % U == 0 always. If kv_heads % U == 0 each member gets kv_heads/U K/V heads (no repeat).
If U > kv_heads (U % kv_heads == 0 required) each member needs exactly one K/V head — the one its
query heads use — so each K/V head is repeated U/kv_heads times before the exchange and never
more: the ring then circulates one K/V head per member. Other combinations raise ValueError naming
ulysses_size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from workers.attention.layouts import check_layout, shard_positions
from workers.attention.ring import ring_attention


def usp_group_ranks(
    world: int, ulysses_size: int, ring_size: int
) -> tuple[list[list[int]], list[list[int]]]:
    """(Ulysses groups, ring groups) as global rank lists for
    world = data_parallel × ring_size × ulysses_size.

    Global rank = (dp · ring_size + ring_rank) · ulysses_size + ulysses_rank: Ulysses innermost
    (one node), then the ring, then data parallel outermost.
    """
    if ulysses_size < 1 or ring_size < 1 or world % (ulysses_size * ring_size):
        raise ValueError(
            f"world {world} is not a multiple of ulysses_size {ulysses_size} x ring_size "
            f"{ring_size}"
        )
    u, r = ulysses_size, ring_size
    uly = [list(range(base, base + u)) for base in range(0, world, u)]
    rings = [
        [d * r * u + i * u + j for i in range(r)] for d in range(world // (r * u)) for j in range(u)
    ]
    return uly, rings


def usp_shard_positions(
    seq_len: int, layout: str, ulysses_rank: int, ulysses_size: int, ring_rank: int, ring_size: int
) -> torch.Tensor:
    """Global position ids of the tokens rank (ulysses_rank, ring_rank) holds (RoPE uses these)."""
    ring_shard = shard_positions(seq_len, layout, ring_rank, ring_size)
    if len(ring_shard) % ulysses_size:
        raise ValueError(
            f"sequence length {seq_len} does not split into {ring_size} ring shards of a multiple "
            f"of ulysses_size={ulysses_size} tokens"
        )
    n = len(ring_shard) // ulysses_size
    return ring_shard[ulysses_rank * n : (ulysses_rank + 1) * n]


def _rank_size(group: dist.ProcessGroup) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def usp_shard_sequence(
    x: torch.Tensor,
    dim: int,
    layout: str,
    ulysses_group: dist.ProcessGroup,
    ring_group: dist.ProcessGroup,
) -> torch.Tensor:
    """This rank's USP shard of the full tensor `x` along `dim` (a contiguous copy)."""
    (u, nu), (r, nr) = _rank_size(ulysses_group), _rank_size(ring_group)
    pos = usp_shard_positions(x.shape[dim], layout, u, nu, r, nr).to(x.device)
    return x.index_select(dim, pos).contiguous()


def usp_unshard_sequence(
    x_local: torch.Tensor,
    dim: int,
    layout: str,
    ulysses_group: dist.ProcessGroup,
    ring_group: dist.ProcessGroup,
) -> torch.Tensor:
    """All-gather every (Ulysses, ring) member's shard and restore the global order along `dim`."""
    (_, nu), (_, nr) = _rank_size(ulysses_group), _rank_size(ring_group)
    parts_u = [torch.empty_like(x_local) for _ in range(nu)]
    dist.all_gather(parts_u, x_local.contiguous(), group=ulysses_group)
    ring_local = torch.cat(parts_u, dim=dim).contiguous()
    parts_r = [torch.empty_like(ring_local) for _ in range(nr)]
    dist.all_gather(parts_r, ring_local, group=ring_group)
    seq_len = x_local.shape[dim] * nu * nr
    order = torch.cat([shard_positions(seq_len, layout, r, nr) for r in range(nr)]).to(
        x_local.device
    )
    gathered = torch.cat(parts_r, dim=dim)
    out = torch.empty_like(gathered)
    out.index_copy_(dim, order, gathered)
    return out


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """[B, n, H, D] (sequence piece, all heads) -> [B, U·n, H/U, D] (U pieces in member order, 1/U
    heads)."""
    b, n, h, d = x.shape
    send = (
        x.reshape(b, n, size, h // size, d).permute(2, 0, 1, 3, 4).contiguous()
    )  # [U dest, B, n, H/U, D]
    recv = torch.empty_like(send)  # [U src, B, n, H/U, D]
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, size * n, h // size, d)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """Inverse of `_seq_to_heads`: [B, U·n, H/U, D] -> [B, n, H, D]."""
    b, un, hu, d = x.shape
    n = un // size
    send = (
        x.reshape(b, size, n, hu, d).permute(1, 0, 2, 3, 4).contiguous()
    )  # [U dest (seq piece), B, n, H/U, D]
    recv = torch.empty_like(send)  # [U src (head group), B, n, H/U, D]
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, n, size * hu, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        return _seq_to_heads(x, group, size)

    @staticmethod
    def backward(ctx, g):
        return _heads_to_seq(g, ctx.group, ctx.size), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        return _heads_to_seq(x, group, size)

    @staticmethod
    def backward(ctx, g):
        return _seq_to_heads(g, ctx.group, ctx.size), None, None


def check_ulysses_heads(heads: int, kv_heads: int, ulysses_size: int) -> None:
    """Raise ValueError (naming ulysses_size) unless the heads split over U members (see module
    docstring)."""
    if ulysses_size < 1:
        raise ValueError(f"ulysses_size must be >= 1, got {ulysses_size}")
    if heads % ulysses_size:
        raise ValueError(
            f"ulysses_size={ulysses_size} must divide the number of query heads ({heads})"
        )
    if kv_heads % ulysses_size and ulysses_size % kv_heads:
        raise ValueError(
            f"ulysses_size={ulysses_size} and kv_heads={kv_heads}: one must divide the other "
            "(each member needs whole K/V heads)"
        )


def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    layout: str = "zigzag",
    ulysses_group: dist.ProcessGroup,
    ring_group: dist.ProcessGroup,
    softmax_scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention of this rank's USP shard ([B, seq_local, H, D], see `usp_shard_positions`).

    `ring_group` is the ring across which K/V travel (a one-rank group when ring_size is 1);
    `ulysses_group` the group the all-to-alls run in (a one-rank group skips them). `cu_seqlens` are
    global document boundaries, as for `ring_attention`. Returns [B, seq_local, H, D];
    differentiable.
    """
    check_layout(layout)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            "q, k, v must be [batch, seq_local, heads, head_dim]; "
            f"got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    size = dist.get_world_size(ulysses_group)
    h, hk = q.shape[2], k.shape[2]
    check_ulysses_heads(h, hk, size)
    if size == 1:
        return ring_attention(
            q,
            k,
            v,
            causal=causal,
            layout=layout,
            group=ring_group,
            softmax_scale=softmax_scale,
            cu_seqlens=cu_seqlens,
        )
    if hk < size:  # each member needs one K/V head: repeat each U/kv_heads times, no more
        k, v = (t.repeat_interleave(size // hk, dim=2) for t in (k, v))
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    qh, kh, vh = (_SeqToHeads.apply(t, ulysses_group, size) for t in (q, k, v))
    out = ring_attention(
        qh,
        kh,
        vh,
        causal=causal,
        layout=layout,
        group=ring_group,
        softmax_scale=scale,
        cu_seqlens=cu_seqlens,
    )
    return _HeadsToSeq.apply(out, ulysses_group, size)
