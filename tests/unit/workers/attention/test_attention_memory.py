"""What ring attention's backward (with its recomputed forward) holds, counted tensor by tensor
(`LiveTensors`), under activation checkpointing, the way the trainer runs it: one rank and an odd ring
of three.

The unit is one Q-sized fp32 tensor (MHA here, so K, V, out and dQ are one unit each; the leaves'
`.grad`, made contiguous by autograd, are counted too). Measured now: 8.0 units on one rank, 8.5-8.7
on three (forward and backward run in K/V-head chunks there: `MAX_RING_HEAD_CHUNKS`). Before: 13.0
and 19.6 (a second stack of K/V beside the saved K and V, one rank's accumulators, each step's block
gradients kept into the next step), 14.6 on three without head chunks, 9.6-11.1 with them in the
backward only. The bounds sit below all of those, so any of them coming back fails them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from tests.support.dist import run_distributed
from workers.attention import ring_attention, shard_positions
from workers.training.memory import LiveTensors

B, S_LOCAL, H, D = 1, 256, 4, 32
UNIT = B * S_LOCAL * H * D * 4


def _peak_units(world: int, rank: int, group: Any) -> tuple[float, float]:
    """(peak units live during backward, max |grad error| vs the same backward without checkpointing)."""
    gen = torch.Generator().manual_seed(7)
    s = S_LOCAL * world
    full = [torch.randn(B, s, H, D, generator=gen) for _ in range(4)]
    rows = shard_positions(s, "zigzag", rank, world)
    q, k, v, dout = (x[:, rows].contiguous() for x in full)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, layout="zigzag", group=group)

    plain = [x.clone().requires_grad_() for x in (q, k, v)]
    attend(*plain).backward(dout)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = checkpoint(attend, *leaves, use_reentrant=False)
    tracker = LiveTensors()
    tracker.phase = "backward"
    with tracker:
        out.backward(dout)
    error = max(float((a.grad - b.grad).abs().max()) for a, b in zip(leaves, plain, strict=True))
    return tracker.peak / UNIT, error


def _ring_rank(rank: int, world: int) -> tuple[float, float]:
    return _peak_units(world, rank, None)


def test_one_rank_backward_holds_only_its_gradients_and_the_recomputed_forward() -> None:
    # recomputed: K/V stacked (2) and out (1); the kernel's dQ, dK, dV (3); the leaves' .grad
    peak, error = _peak_units(1, 0, None)
    assert error == 0.0
    assert peak <= 9.0, f"{peak:.2f} units live in a one-rank backward (8.0 measured)"


def test_ring_backward_frees_what_has_left_and_what_is_added() -> None:
    results = run_distributed(_ring_rank, 3)
    for peak, error in results:
        assert error == 0.0
        # recomputed out (1) and the local K/V, which take their dK/dV (2); dQ (1); the leaves' .grad
        # (3); per head chunk (1/4 of the heads) K/V held and in flight, dK/dV travelling and arriving
        assert peak <= 9.3, f"{peak:.2f} units live in a ring-of-3 backward (8.5-8.7 measured)"
