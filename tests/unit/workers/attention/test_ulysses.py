"""Ulysses × ring (USP) attention equals float64 single-process attention: outputs and gradients."""

from __future__ import annotations

import pytest
import torch

from tests.support.attention_cases import usp_vs_reference
from tests.support.dist import run_distributed
from workers.attention.layouts import shard_positions
from workers.attention.ulysses import check_ulysses_heads, usp_group_ranks, usp_shard_positions

TOL = {"torch.float64": 1e-10, "torch.float32": 1e-5}


def _case(seed: int, ulysses: int, ring: int, layout: str, **kw) -> dict:  # type: ignore[no-untyped-def]
    base = dict(
        seed=seed,
        b=2,
        s=16 * ring,
        h=4,
        hk=2,
        d=8,
        dtype=torch.float64,
        causal=True,
        cu_seqlens=None,
    )
    return {**base, "ulysses": ulysses, "ring": ring, "layout": layout, **kw}


def _check(results: list[list[dict]]) -> None:
    for per_rank in results:
        for res in per_rank:
            assert set(res["dtypes"]) == {res["case"]["dtype"]}, res
            assert max(res["errors"]) <= TOL[res["case"]["dtype"]], res


@pytest.mark.multiprocess
def test_ulysses_two() -> None:
    """U = 2, no ring: heads split over two ranks; GQA with kv_heads = U and kv_heads < U (MQA)."""
    cases = [
        _case(1, 2, 1, "contiguous"),
        _case(2, 2, 1, "zigzag", causal=False, dtype=torch.float32),
        _case(3, 2, 1, "striped", hk=1),  # U > kv_heads: the one K/V head goes to both members
        _case(4, 2, 1, "zigzag", cu_seqlens=[0, 1, 7, 7, 12, 16]),
    ]
    _check(run_distributed(usp_vs_reference, 2, cases))


@pytest.mark.multiprocess
def test_ulysses_two_by_ring_two() -> None:
    """U = 2 × ring 2 (zigzag, striped, contiguous), fp64 and fp32, causal and not, packed documents; and
    U = 4 over kv_heads = 2 (each K/V head on two members); and U = 2 × data-parallel 2 (two replicas)."""
    cases = []
    for i, layout in enumerate(["zigzag", "striped", "contiguous"]):
        cases.append(_case(10 + i, 2, 2, layout))
        cases.append(_case(20 + i, 2, 2, layout, dtype=torch.float32, causal=False))
        cases.append(_case(30 + i, 2, 2, layout, cu_seqlens=[0, 3, 4, 17, 17, 30, 32], hk=1, h=6))
    cases.append(_case(40, 4, 1, "zigzag", s=32, h=8, hk=2))
    cases.append(_case(41, 2, 1, "striped", cu_seqlens=[0, 5, 16]))  # × data-parallel 2
    _check(run_distributed(usp_vs_reference, 4, cases))


def test_group_ranks_layout() -> None:
    uly, rings = usp_group_ranks(8, 2, 2)
    assert uly == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rings == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with pytest.raises(ValueError, match="ulysses_size"):
        usp_group_ranks(6, 4, 1)


def test_usp_positions_partition_the_sequence() -> None:
    for layout in ("contiguous", "zigzag", "striped"):
        s, u, r = 48, 2, 3
        pos = torch.cat(
            [usp_shard_positions(s, layout, i, u, j, r) for j in range(r) for i in range(u)]
        )
        assert torch.equal(pos.sort().values, torch.arange(s))
        # the Ulysses members of ring rank j together hold exactly ring rank j's shard, in order
        for j in range(r):
            both = torch.cat([usp_shard_positions(s, layout, i, u, j, r) for i in range(u)])
            assert torch.equal(both, shard_positions(s, layout, j, r))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "u", "message"),
    [
        (6, 2, 4, "divide the number of query heads"),
        (12, 4, 6, "one must divide the other"),
        (4, 4, 0, ">= 1"),
    ],
)
def test_bad_ulysses_size(heads: int, kv_heads: int, u: int, message: str) -> None:
    with pytest.raises(ValueError, match="ulysses_size") as err:
        check_ulysses_heads(heads, kv_heads, u)
    assert message in str(err.value)
