"""Packed documents: ring attention with `cu_seqlens` equals float64 document-masked attention.

Every layout, causal and not, GQA/MQA, fp64 and fp32, on rings of 1–4 ranks. Documents of length 1,
documents spanning several ranks, one document covering the whole sequence, empty documents, and
per-row documents (flash-attn's flattened-batch convention).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.attention_cases import doc_ids, doc_ring_vs_reference, make_inputs, reference_doc_attention
from tests.dist import run_distributed
from workers.attention import ring_attention
from workers.attention.plan import Documents, block_for_step, ring_plan

LAYOUTS = ["contiguous", "zigzag", "striped"]
TOL = {"torch.float64": 1e-10, "torch.float32": 1e-5}


def _random_bounds(seed: int, s: int, mean: float) -> list[int]:
    """Document boundaries with lengths drawn around `mean`, including some length-1 documents."""
    g = torch.Generator().manual_seed(seed)
    bounds, pos = [0], 0
    while pos < s:
        length = 1 if torch.rand((), generator=g) < 0.25 else int(torch.randint(1, int(2 * mean) + 1, (), generator=g))
        pos = min(s, pos + length)
        bounds.append(pos)
    return bounds


def _cases(world: int) -> list[dict]:
    s = 8 * world
    layouts = {
        "random": _random_bounds(world, s, 3.0),
        "one document": [0, s],
        "all length 1": list(range(s + 1)),
        "spans ranks + empty": [0, 1, s // 2 + 1, s // 2 + 1, s - 1, s],
    }
    cases, seed = [], 100 * world
    for layout, causal, dtype in itertools.product(LAYOUTS, [True, False], [torch.float64, torch.float32]):
        for name, cu in layouts.items():
            seed += 1
            cases.append(
                dict(
                    seed=seed,
                    b=1,
                    s=s,
                    h=4,
                    hk=2,
                    d=8,
                    dtype=dtype,
                    layout=layout,
                    causal=causal,
                    cu_seqlens=cu,
                    name=name,
                )
            )
        # two rows with different documents (flattened batch) and MQA
        rows = _random_bounds(seed, s, 2.0) + [s + b for b in _random_bounds(seed + 1, s, 5.0)[1:]]
        cases.append(
            dict(
                seed=seed,
                b=2,
                s=s,
                h=3,
                hk=1,
                d=5,
                dtype=dtype,
                layout=layout,
                causal=causal,
                cu_seqlens=rows,
                name="per row",
            )
        )
    return cases


def _check(results: list[dict]) -> None:
    for res in results:
        case = res["case"]
        assert res["finite"], case
        assert set(res["dtypes"]) == {case["dtype"]}, res
        assert max(res["errors"]) <= TOL[case["dtype"]], res


def test_documents_world_one() -> None:
    _check(doc_ring_vs_reference(0, 1, _cases(1)))


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3, 4])
def test_documents_match_reference(world: int) -> None:
    for per_rank in run_distributed(doc_ring_vs_reference, world, _cases(world)):
        _check(per_rank)


def test_no_attention_across_documents() -> None:
    """Changing one document's keys/values leaves every other document's output bit-identical."""
    q, k, v, _ = make_inputs(4, 1, 24, 2, 2, 8, torch.float64)
    cu = torch.tensor([0, 7, 8, 20, 24], dtype=torch.int32)
    out = ring_attention(q, k, v, causal=False, layout="striped", cu_seqlens=cu)
    k2, v2 = k.clone(), v.clone()
    k2[:, 8:20] += 1.0
    v2[:, 8:20] -= 3.0
    out2 = ring_attention(q, k2, v2, causal=False, layout="striped", cu_seqlens=cu)
    same = torch.ones(24, dtype=torch.bool)
    same[8:20] = False
    assert torch.equal(out[:, same], out2[:, same])
    assert not torch.allclose(out[:, 8:20], out2[:, 8:20])
    # and without cu_seqlens the documents do mix (the check above could not pass by accident)
    dense = ring_attention(q, k, v, causal=False, layout="striped")
    assert not torch.allclose(dense, out)
    assert torch.allclose(out, reference_doc_attention(q, k, v, False, cu), atol=1e-12)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_plan_covers_exactly_the_visible_pairs(layout: str, world: int) -> None:
    """Every visible (query, key) pair is computed exactly once; no block has a row without a visible key."""
    n = 12
    s = n * world
    bounds = (0, 1, 2, 9, 9, 10, 23, s - 1, s)
    ids = doc_ids(torch.tensor(bounds), 1, s)[0]
    from workers.attention import shard_positions

    for causal in (True, False):
        count = torch.zeros(s, s, dtype=torch.int64)
        for rank in range(world):
            qp = shard_positions(s, layout, rank, world)
            for step, blocks in enumerate(ring_plan(layout, causal, rank, world, n, Documents(((0, 1, bounds),)))):
                kp = shard_positions(s, layout, (rank - step) % world, world)
                for blk in blocks:
                    qi, kj = qp[blk.q], kp[blk.kv]
                    vis = ids[qi][:, None] == ids[kj][None, :]
                    if blk.causal:
                        assert len(qi) == len(kj)
                        vis &= torch.ones(len(qi), len(kj), dtype=torch.bool).tril()
                    vis_causal = vis & (kj[None, :] <= qi[:, None]) if causal else vis
                    assert torch.equal(vis, vis_causal), "a block computes a pair the mask hides"
                    assert bool(vis.any(1).all()), "a block row with no visible key would corrupt the merge"
                    count[qi[:, None].expand_as(vis)[vis], kj[None, :].expand_as(vis)[vis]] += 1
        want = ids[:, None] == ids[None, :]
        if causal:
            want &= torch.ones(s, s, dtype=torch.bool).tril()
        assert torch.equal(count, want.long()), (layout, causal)


def test_dense_plan_unchanged_without_documents() -> None:
    for layout, causal, world in itertools.product(LAYOUTS, [True, False], [1, 2, 3, 4]):
        for rank in range(world):
            plan = ring_plan(layout, causal, rank, world, 8, None)
            for step, blocks in enumerate(plan):
                dense = block_for_step(layout, causal, rank, (rank - step) % world, 8)
                assert blocks == ([] if dense is None else [dense])


@pytest.mark.parametrize(
    ("cu", "message"),
    [
        (torch.tensor([1, 8, 16], dtype=torch.int32), "start at 0"),
        (torch.tensor([0, 8, 15], dtype=torch.int32), "end at the global sequence length S = 16"),
        (torch.tensor([0, 9, 8, 16], dtype=torch.int32), "non-decreasing"),
        (torch.tensor([0, 8, 16], dtype=torch.int64), "int32"),
        (torch.tensor([[0, 16]], dtype=torch.int32), "1-D"),
        ([0, 16], "torch.Tensor"),
        (torch.tensor([0, 10, 20, 32], dtype=torch.int32), "row boundary 16"),
    ],
)
def test_bad_cu_seqlens_raise_value_error(cu, message: str) -> None:  # type: ignore[no-untyped-def]
    q = torch.randn(2, 16, 2, 4)
    with pytest.raises(ValueError, match="cu_seqlens") as err:
        ring_attention(q, q, q, cu_seqlens=cu)
    assert message in str(err.value)
