"""Layouts and dense ring plans at their edges, against brute force over global positions.

The equivalence tests use 8+ tokens per rank; here a rank holds 1, 2 or 4 tokens, where a striped
rank's one token sees nothing of a later rank (the plan must skip that step, not hand the kernel an
empty block), and ranks outside the ring must be refused.
"""

from __future__ import annotations

import itertools
from typing import cast

import pytest
import torch
import torch.distributed as dist

from workers.attention import ring_attention, shard_positions, shard_sequence
from workers.attention.plan import ring_plan

LAYOUTS = ["contiguous", "zigzag", "striped"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dense_plans_cover_exactly_the_causal_pairs_with_few_tokens(layout: str) -> None:
    """Every block is non-empty, and the blocks of all ranks and steps compute each pair j <= i of
    global positions exactly once (and every pair once without causality)."""
    for world, n, causal in itertools.product([1, 2, 3, 4], [1, 2, 4], [True, False]):
        if layout == "zigzag" and n % 2:
            continue
        s = n * world
        count = torch.zeros(s, s, dtype=torch.int64)
        for rank in range(world):
            qp = shard_positions(s, layout, rank, world)
            for step, blocks in enumerate(ring_plan(layout, causal, rank, world, n, None)):
                kp = shard_positions(s, layout, (rank - step) % world, world)
                for blk in blocks:
                    qi, kj = qp[blk.q], kp[blk.kv]
                    assert len(qi) > 0 and len(kj) > 0, (layout, world, n, rank, step, blk)
                    vis = torch.ones(len(qi), len(kj), dtype=torch.bool)
                    if blk.causal:
                        vis = vis.tril()
                    rows, cols = vis.nonzero(as_tuple=True)
                    count[qi[rows], kj[cols]] += 1
        want = torch.ones(s, s, dtype=torch.int64)
        if causal:
            want = want.tril()
        assert torch.equal(count, want), (layout, world, n, causal)


def test_striped_single_token_skips_later_ranks() -> None:
    """One token per rank, striped: rank 0 (position 0) sees only itself; rank 1 sees both."""
    plan0 = ring_plan("striped", True, 0, 2, 1, None)
    assert [len(step) for step in plan0] == [1, 0]
    plan1 = ring_plan("striped", True, 1, 2, 1, None)
    assert [len(step) for step in plan1] == [1, 1]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ranks_outside_the_ring_are_refused(layout: str) -> None:
    for rank in (-1, 4):
        with pytest.raises(ValueError, match="outside a ring of 4"):
            shard_positions(16, layout, rank, 4)
    with pytest.raises(ValueError, match="outside a ring of 0"):
        shard_positions(16, layout, 0, 0)


def test_a_group_without_torch_distributed_is_refused() -> None:
    """A group handed in while torch.distributed is off cannot be a ring of one: refused, not
    silently treated as rank 0 of 1 (which would shard and attend over the wrong tokens)."""
    group = cast(dist.ProcessGroup, object())
    x = torch.arange(16.0).reshape(1, 16)
    if dist.is_initialized():
        pytest.skip("torch.distributed is initialized in this process")
    with pytest.raises(ValueError, match="not initialized"):
        shard_sequence(x, 1, "zigzag", group)
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="not initialized"):
        ring_attention(q, q, q, group=group)
