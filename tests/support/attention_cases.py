"""Distributed check bodies for the ring-attention tests (module level so spawned ranks can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from workers.attention import ring_attention, shard_sequence, unshard_sequence


def reference_attention(q, k, v, causal, scale=None):  # type: ignore[no-untyped-def]
    """Plain float64 softmax attention on the full sequence ([B, S, H, D]), GQA by head grouping."""
    b, s, h, d = q.shape
    hk = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    qg = q.double().reshape(b, s, hk, h // hk, d)
    scores = torch.einsum("bqkgd,bskd->bkgqs", qg, k.double()) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("bkgqs,bskd->bqkgd", p, v.double()).reshape(b, s, h, d)


def make_inputs(seed, b, s, h, hk, d, dtype, logit_scale=1.0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64) * logit_scale
    k = torch.randn(b, s, hk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, s, hk, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, dout)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def ring_vs_reference(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """For each case: ring forward+backward on the shards vs float64 reference on the full sequence."""
    results = []
    for case in cases:
        dtype = case["dtype"]
        q, k, v, dout = make_inputs(
            case["seed"],
            case["b"],
            case["s"],
            case["h"],
            case["hk"],
            case["d"],
            dtype,
            case.get("logit_scale", 1.0),
        )
        layout, causal = case["layout"], case["causal"]
        # reference in float64 from the same (dtype-rounded) inputs
        qr, kr, vr = (t.detach().double().clone().requires_grad_() for t in (q, k, v))
        ref = reference_attention(qr, kr, vr, causal)
        ref.backward(dout.double())
        # the same attention in the input dtype, single process: the precision floor of this dtype
        qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
        single = torch.nn.functional.scaled_dot_product_attention(
            qs.transpose(1, 2),
            ks.transpose(1, 2),
            vs.transpose(1, 2),
            is_causal=causal,
            enable_gqa=True,
        ).transpose(1, 2)
        single.backward(dout)
        shards = [shard_sequence(t, 1, layout).requires_grad_() for t in (q, k, v)]
        out = ring_attention(*shards, causal=causal, layout=layout)
        out.backward(shard_sequence(dout, 1, layout))
        full = [unshard_sequence(x, 1, layout) for x in (out.detach(), *(t.grad for t in shards))]
        results.append(
            {
                "case": case,
                "out_dtype": str(out.dtype),
                "grad_dtypes": [str(t.grad.dtype) for t in shards],
                "errors": [
                    rel_err(a, b)
                    for a, b in zip(full, (ref, qr.grad, kr.grad, vr.grad), strict=True)
                ],
                "single_errors": [
                    rel_err(a, b)
                    for a, b in zip(
                        (single, qs.grad, ks.grad, vs.grad),
                        (ref, qr.grad, kr.grad, vr.grad),
                        strict=True,
                    )
                ],
                "finite": all(bool(torch.isfinite(x).all()) for x in full),
            }
        )
    return results


class _Shard(torch.autograd.Function):
    """Full tensor (identical on every rank) -> this rank's shard; backward gathers every rank's shard grad."""

    @staticmethod
    def forward(ctx, x, layout):  # type: ignore[no-untyped-def, override]
        ctx.layout = layout
        return shard_sequence(x, 1, layout)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        return unshard_sequence(g.contiguous(), 1, ctx.layout), None


class _Gather(torch.autograd.Function):
    """Shards -> the full tensor on every rank; backward keeps this rank's part of the (identical) grad."""

    @staticmethod
    def forward(ctx, x, layout):  # type: ignore[no-untyped-def, override]
        ctx.layout = layout
        return unshard_sequence(x, 1, layout)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        return shard_sequence(g, 1, ctx.layout), None


def gradcheck_ring(rank: int, world: int, layouts: list[str]) -> bool:
    """torch.autograd.gradcheck of full sequence -> shard -> ring -> gather, fp64, every rank in lockstep."""
    ok = True
    for layout in layouts:
        q, k, v, _ = make_inputs(7, 1, 2 * world, 2, 1, 3, torch.float64)

        def f(a, b, c, layout=layout):  # type: ignore[no-untyped-def]
            shards = [_Shard.apply(t, layout) for t in (a, b, c)]
            return _Gather.apply(ring_attention(*shards, causal=True, layout=layout), layout)

        ok &= torch.autograd.gradcheck(
            f, [t.requires_grad_() for t in (q, k, v)], eps=1e-6, atol=1e-8
        )
    return ok


def subgroup_ring(rank: int, world: int) -> list[float]:
    """Two independent rings (ranks {0,1} and {2,3}) in one world: each must see only its own sequence."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    q, k, v, dout = make_inputs(100 + rank // 2, 2, 16, 4, 2, 8, torch.float64)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, True)
    ref.backward(dout)
    shards = [shard_sequence(t, 1, "zigzag", mine).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*shards, layout="zigzag", group=mine)
    out.backward(shard_sequence(dout, 1, "zigzag", mine))
    full = [
        unshard_sequence(x, 1, "zigzag", mine) for x in (out.detach(), *(t.grad for t in shards))
    ]
    return [rel_err(a, b) for a, b in zip(full, (ref, qr.grad, kr.grad, vr.grad), strict=True)]


def _err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error; absolute where the reference is exactly zero (one-token documents: dq = dk = 0)."""
    diff = (a.double() - ref.double()).norm().item()
    norm = ref.double().norm().item()
    return diff / norm if norm > 0 else diff


def doc_ids(cu_seqlens: torch.Tensor, batch: int, s: int) -> torch.Tensor:
    """[B, S] document id of every token, from global `cu_seqlens` (shared `[0..S]` or per-row `[0..B·S]`)."""
    bounds = cu_seqlens.long()
    flat = (
        torch.arange(batch * s) if int(bounds[-1]) == batch * s else torch.arange(s).repeat(batch)
    )
    return (torch.searchsorted(bounds, flat, right=True) - 1).reshape(batch, s)


def reference_doc_attention(q, k, v, causal, cu_seqlens, scale=None):  # type: ignore[no-untyped-def]
    """Float64 softmax attention where a token sees only its own document (causally if `causal`)."""
    b, s, h, d = q.shape
    hk = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    ids = doc_ids(cu_seqlens, b, s)
    visible = ids[:, :, None] == ids[:, None, :]  # [B, Sq, Sk]
    if causal:
        visible &= torch.ones(s, s, dtype=torch.bool).tril()
    qg = q.double().reshape(b, s, hk, h // hk, d)
    scores = torch.einsum("bqkgd,bskd->bkgqs", qg, k.double()) * scale
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("bkgqs,bskd->bqkgd", p, v.double()).reshape(b, s, h, d)


def doc_ring_vs_reference(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Packed documents: ring forward+backward on the shards vs the float64 document-masked reference."""
    results = []
    for case in cases:
        dtype = case["dtype"]
        q, k, v, dout = make_inputs(
            case["seed"], case["b"], case["s"], case["h"], case["hk"], case["d"], dtype
        )
        layout, causal = case["layout"], case["causal"]
        cu = torch.tensor(case["cu_seqlens"], dtype=torch.int32)
        qr, kr, vr = (t.detach().double().clone().requires_grad_() for t in (q, k, v))
        ref = reference_doc_attention(qr, kr, vr, causal, cu)
        ref.backward(dout.double())
        shards = [shard_sequence(t, 1, layout).requires_grad_() for t in (q, k, v)]
        out = ring_attention(*shards, causal=causal, layout=layout, cu_seqlens=cu)
        out.backward(shard_sequence(dout, 1, layout))
        full = [unshard_sequence(x, 1, layout) for x in (out.detach(), *(t.grad for t in shards))]
        results.append(
            {
                "case": {k: (str(v) if k == "dtype" else v) for k, v in case.items()},
                "errors": [
                    _err(a, b) for a, b in zip(full, (ref, qr.grad, kr.grad, vr.grad), strict=True)
                ],
                "finite": all(bool(torch.isfinite(x).all()) for x in full),
                "dtypes": [str(x.dtype) for x in full],
            }
        )
    return results


def usp_vs_reference(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Ulysses × ring: forward+backward on USP shards vs the float64 (document-masked) reference.

    Each data-parallel replica (world / (U · R) of them) gets its own inputs (seed + replica index).
    """
    from workers.attention.ulysses import (
        usp_attention,
        usp_group_ranks,
        usp_shard_sequence,
        usp_unshard_sequence,
    )

    results = []
    for case in cases:
        u, r = case["ulysses"], case["ring"]
        uly_ranks, ring_ranks = usp_group_ranks(world, u, r)
        uly = [dist.new_group(g) for g in uly_ranks]  # every rank creates every group, in one order
        rings = [dist.new_group(g) for g in ring_ranks]
        my_uly = next(g for g, ranks in zip(uly, uly_ranks, strict=True) if rank in ranks)
        my_ring = next(g for g, ranks in zip(rings, ring_ranks, strict=True) if rank in ranks)
        replica = rank // (u * r)
        dtype, layout, causal = case["dtype"], case["layout"], case["causal"]
        q, k, v, dout = make_inputs(
            case["seed"] + replica, case["b"], case["s"], case["h"], case["hk"], case["d"], dtype
        )
        cu = (
            None
            if case.get("cu_seqlens") is None
            else torch.tensor(case["cu_seqlens"], dtype=torch.int32)
        )
        qr, kr, vr = (t.detach().double().clone().requires_grad_() for t in (q, k, v))
        ref = (
            reference_attention(qr, kr, vr, causal)
            if cu is None
            else reference_doc_attention(qr, kr, vr, causal, cu)
        )
        ref.backward(dout.double())
        shards = [
            usp_shard_sequence(t, 1, layout, my_uly, my_ring).requires_grad_() for t in (q, k, v)
        ]
        out = usp_attention(
            *shards,
            causal=causal,
            layout=layout,
            ulysses_group=my_uly,
            ring_group=my_ring,
            cu_seqlens=cu,
        )
        out.backward(usp_shard_sequence(dout, 1, layout, my_uly, my_ring))
        full = [
            usp_unshard_sequence(x, 1, layout, my_uly, my_ring)
            for x in (out.detach(), *(t.grad for t in shards))
        ]
        results.append(
            {
                "case": {k: (str(v) if k == "dtype" else v) for k, v in case.items()},
                "errors": [
                    _err(a, b) for a, b in zip(full, (ref, qr.grad, kr.grad, vr.grad), strict=True)
                ],
                "dtypes": [str(x.dtype) for x in full],
            }
        )
    return results


def install_flash_attn(monkeypatch, mod) -> None:  # type: ignore[no-untyped-def]
    """Make `mod` the importable `flash_attn.flash_attn_interface` for one test (a stand-in with a
    release's private fwd/bwd signatures: flash-attn itself needs CUDA) and forget the cached probe."""
    import sys
    import types

    from workers.attention import kernels

    pkg = types.ModuleType("flash_attn")
    pkg.flash_attn_interface = mod
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", mod)
    kernels._flash_attn_api.cache_clear()
