"""Pass-Q decoding: a new token's attention over a sequence whose K/V stay sharded on the ring.

After a ring prefill every rank keeps the keys and values of its own tokens (its shard, in the
prefill's layout) as its cache. A decode step's query is one token while the caches are the whole
sequence, so the query travels, not the keys: each rank attends the query over the keys it holds
(all of them precede the new token: no mask), and the partial results (out, log-sum-exp) are
all-gathered over the ring and folded, in rank order on every rank, with the merge ring attention
uses (`merge.merge_`). Nothing gathers the sequence; per layer and step a rank sends
heads x (head_dim + 1) numbers per query token, and every rank ends with the same output.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from workers.attention.kernels import select_kernel
from workers.attention.layouts import _rank_world
from workers.attention.merge import merge_


def pass_q_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    softmax_scale: float | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of new tokens over every rank's cached keys, [batch, seq, heads, head_dim] in/out.

    `q`: the new tokens' queries (the same on every rank of `group`); `k`, `v`: this rank's cache
    (fewer heads for GQA); `keep`: bool [k's length], the cache slots this rank contributes (its
    real prompt tokens, and each decoded token on exactly one rank), all of them by default. With
    several new tokens each attends all kept keys (they are earlier tokens), not each other."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[0] != k.shape[0]:
        raise ValueError(
            f"pass_q_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} are not a multiple of key heads {k.shape[2]}")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    if keep is not None:
        k, v = k[:, keep], v[:, keep]
    b, sq, h, d = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if k.shape[1]:
        out, lse = select_kernel(q.device, q.dtype, d).forward(q, k, v, False, scale)
        out, lse = out.to(acc), lse.to(acc)
    else:  # nothing kept here: an empty partial, which the merge skips
        out = torch.zeros(b, sq, h, d, dtype=acc, device=q.device)
        lse = torch.full((b, h, sq), float("-inf"), dtype=acc, device=q.device)
    world = _rank_world(group)[1]
    if world == 1:
        return out.to(q.dtype)
    outs = [torch.empty_like(out) for _ in range(world)]
    lses = [torch.empty_like(lse) for _ in range(world)]
    dist.all_gather(outs, out.contiguous(), group=group)
    dist.all_gather(lses, lse.contiguous(), group=group)
    total = torch.zeros_like(out)
    total_lse = torch.full_like(lse, float("-inf"))
    for part, part_lse in zip(outs, lses, strict=True):
        if torch.isfinite(part_lse).all():  # never merge an empty partial (the merge's rule)
            merge_(total, total_lse, part, part_lse)
    return total.to(q.dtype)
