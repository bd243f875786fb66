"""Online-softmax merge of partial attention results over disjoint key sets.

(out_a, lse_a) and (out_b, lse_b) are attention of the same queries over two disjoint key sets.
Their union is  lse = log(e^lse_a + e^lse_b)  and  out = w_a·out_a + w_b·out_b  with
w_b = sigmoid(lse_b - lse_a). Written with sigmoid/logaddexp so it never overflows, however far
apart the two log-sum-exps are. The running side may be empty (out = 0, lse = −inf: rows no block
has reached yet, as with packed documents); the block side must be finite: never merge a
fully-masked block (CPU kernels report lse = 0 for rows without a visible key, not −inf).
"""

from __future__ import annotations

import torch


def merge_(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """In place: fold (block_out, block_lse) into the running (out, lse).

    out, block_out: [B, S, H, D] in the accumulation dtype; lse, block_lse: [B, H, S] (same dtype).
    `out`/`lse` may be views (a slice of the rows), which is how partial-query blocks are merged.
    """
    block_lse = block_lse.to(lse.dtype)
    weight_b = torch.sigmoid(block_lse - lse).transpose(1, 2).unsqueeze(-1)  # [B, S, H, 1]
    out.sub_(weight_b * (out - block_out.to(out.dtype)))
    lse.copy_(torch.logaddexp(lse, block_lse))
