"""Ulysses × ring bookkeeping refusals: a world the groups do not tile, and a ring shard the Ulysses
members cannot split evenly, are refused rather than silently dropping ranks or tokens."""

from __future__ import annotations

import pytest

from workers.attention import usp_group_ranks, usp_shard_positions


def test_world_must_be_a_multiple_of_both_sizes() -> None:
    """6 ranks are a multiple of ulysses_size 2 but not of 2 × ring 2: refused (the groups would
    leave ranks 4 and 5 with half a ring)."""
    with pytest.raises(ValueError, match="ring_size 2"):
        usp_group_ranks(6, 2, 2)
    with pytest.raises(ValueError, match="ring_size 3"):
        usp_group_ranks(8, 1, 3)
    uly, rings = usp_group_ranks(12, 2, 3)  # two data-parallel replicas
    assert uly == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert rings == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_ring_shard_must_split_over_the_ulysses_members(layout: str) -> None:
    """24 tokens on a ring of 2 are 12 per ring rank: 4 members take 3 each; 5 members cannot."""
    assert len(usp_shard_positions(24, layout, 3, 4, 1, 2)) == 3
    with pytest.raises(ValueError, match="ulysses_size=5"):
        usp_shard_positions(24, layout, 0, 5, 0, 2)
