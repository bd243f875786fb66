"""Packed documents: ring attention with `cu_seqlens` equals float64 document-masked attention.

Every layout, causal and not, GQA/MQA, fp64 and fp32, on rings of 1–4 ranks. Documents of length 1,
documents spanning several ranks, one document covering the whole sequence, empty documents, and
per-row documents (flash-attn's flattened-batch convention).
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest
import torch

from tests.support.attention_cases import (
    doc_ids,
    doc_ring_vs_reference,
    make_inputs,
    reference_doc_attention,
)
from tests.support.dist import run_distributed
from workers.attention import ring_attention
from workers.attention.kernels import TorchCpuFlash
from workers.attention.plan import Documents, block_for_step, ring_plan
from workers.attention.ring import documents, kernel_calls
from workers.attention.varlen import LoopVarlen, ring_packs, select_varlen
from workers.parallel_dims import ring_head_chunks

LAYOUTS = ["contiguous", "zigzag", "striped"]
TOL = {"torch.float64": 1e-10, "torch.float32": 1e-5}


def _random_bounds(seed: int, s: int, mean: float) -> list[int]:
    """Document boundaries with lengths drawn around `mean`, including some length-1 documents."""
    g = torch.Generator().manual_seed(seed)
    bounds, pos = [0], 0
    while pos < s:
        length = (
            1
            if torch.rand((), generator=g) < 0.25
            else int(torch.randint(1, int(2 * mean) + 1, (), generator=g))
        )
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
    for layout, causal, dtype in itertools.product(
        LAYOUTS, [True, False], [torch.float64, torch.float32]
    ):
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
            for step, blocks in enumerate(
                ring_plan(layout, causal, rank, world, n, Documents(((0, 1, bounds),)))
            ):
                kp = shard_positions(s, layout, (rank - step) % world, world)
                for blk in blocks:
                    qi, kj = qp[blk.q], kp[blk.kv]
                    vis = ids[qi][:, None] == ids[kj][None, :]
                    if blk.causal:
                        assert len(qi) == len(kj)
                        vis &= torch.ones(len(qi), len(kj), dtype=torch.bool).tril()
                    vis_causal = vis & (kj[None, :] <= qi[:, None]) if causal else vis
                    assert torch.equal(vis, vis_causal), "a block computes a pair the mask hides"
                    assert bool(vis.any(1).all()), (
                        "a block row with no visible key would corrupt the merge"
                    )
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


# -- the packed (varlen) path: what flash-attn's varlen kernels run on CUDA, exercised on CPU ---------------------
def packed_vs_reference(rank: int, world: int, cases: list[dict]) -> dict[str, Any]:
    """`doc_ring_vs_reference` with the packed path forced (RINGTRAIN_ATTN_VARLEN=loop, inherited
    by each rank), plus the block-kernel calls that really ran on this rank, by strategy, and the
    calls the packs imply."""
    assert isinstance(select_varlen(torch.device("cpu"), torch.float64, 8), LoopVarlen)
    before = Counter(kernel_calls)
    results = doc_ring_vs_reference(rank, world, cases)
    ran = Counter(kernel_calls)
    ran.subtract(before)
    # one varlen call per pack and K/V-head chunk, each way, per case
    packs = calls_each_way = 0
    for c in cases:
        docs = documents(torch.tensor(c["cu_seqlens"], dtype=torch.int32), c["b"], c["s"])
        steps = ring_packs(c["layout"], c["causal"], rank, world, c["s"] // world, docs, c["b"])
        n = sum(len(step) for step in steps)
        packs += n
        calls_each_way += n * ring_head_chunks(c["hk"], world)
    calls = {"/".join(k): n for k, n in ran.items() if n}
    return {"results": results, "calls": calls, "packs": packs, "each_way": calls_each_way}


@pytest.mark.parametrize("world", [1, 3])
def test_packed_varlen_path_matches_reference(world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ring step as at most two varlen calls (gather, merge, scatter) is as exact as the
    per-block path, and that path is the one that ran: on every rank, one packed call per pack and
    K/V-head chunk each way, and no per-block call."""
    monkeypatch.setenv("RINGTRAIN_ATTN_VARLEN", "loop")
    cases = [c for c in _cases(world) if c["dtype"] == torch.float64 or c["name"] == "per row"]
    run = run_distributed if world > 1 else lambda fn, _, *a: [fn(0, 1, *a)]
    ranks = run(packed_vs_reference, world, cases)
    assert len(ranks) == world
    for rank, got in enumerate(ranks):
        _check(got["results"])
        assert got["packs"] > 0
        want = {"packed/forward": got["each_way"], "packed/backward": got["each_way"]}
        assert got["calls"] == want, (rank, got["calls"], want)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_packs_hold_exactly_the_plan_blocks(world: int) -> None:
    """Per step: at most two packs (causal, dense); each query row once per pack; the packs' segments, read back
    as blocks per batch row, are exactly the plan's blocks."""
    n, b = 12, 2
    s = n * world
    per_row = (0, 1, 2, 9, 9, 10, s - 1, s)
    other = tuple(sorted({0, 5, 6, s // 2, s}))
    for layout, causal in itertools.product(LAYOUTS, [True, False]):
        docs = Documents(((0, 1, per_row), (1, 2, other)))
        for rank in range(world):
            plan = ring_plan(layout, causal, rank, world, n, docs)
            packs = ring_packs(layout, causal, rank, world, n, docs, b)
            for blocks, step in zip(plan, packs, strict=True):
                assert len(step) <= 2 and len({p.causal for p in step}) == len(step)
                want = sorted(
                    (row, blk.q.start, blk.q.stop, blk.kv.start, blk.kv.stop, blk.causal)
                    for blk in blocks
                    for row in range(b)[blk.rows]
                )
                got = []
                for p in step:
                    assert p.q_index.unique().numel() == p.q_index.numel()
                    for q0, q1, k0, k1 in p.segments():
                        qi, ki = p.q_index[q0:q1], p.k_index[k0:k1]
                        row = int(qi[0]) // n
                        assert torch.equal(qi, torch.arange(int(qi[0]), int(qi[-1]) + 1)), (
                            "a segment is one range"
                        )
                        assert int(ki[0]) // n == row and int(qi[-1]) // n == row, (
                            "a segment stays in its row"
                        )
                        got.append(
                            (
                                row,
                                int(qi[0]) % n,
                                int(qi[-1]) % n + 1,
                                int(ki[0]) % n,
                                int(ki[-1]) % n + 1,
                                p.causal,
                            )
                        )
                        assert p.max_q >= q1 - q0 and p.max_k >= k1 - k0
                assert sorted(got) == want, (layout, causal, rank)


def test_varlen_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU the per-block path is the default (no gather needed); `loop` forces packing; bad values are refused."""
    cpu = torch.device("cpu")
    monkeypatch.delenv("RINGTRAIN_ATTN_VARLEN", raising=False)
    assert select_varlen(cpu, torch.float32, 64) is None
    monkeypatch.setenv("RINGTRAIN_ATTN_VARLEN", "loop")
    assert select_varlen(cpu, torch.float32, 64) == LoopVarlen(TorchCpuFlash())
    monkeypatch.setenv("RINGTRAIN_ATTN_VARLEN", "yes")
    with pytest.raises(ValueError, match="RINGTRAIN_ATTN_VARLEN"):
        select_varlen(cpu, torch.float32, 64)
