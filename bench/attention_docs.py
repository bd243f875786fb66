"""Packed documents in ring attention: kernel strategy, packed vs unpacked cost, imbalance per layout.

    python -m bench.attention_docs [--seq 4096] [--heads 8] [--head-dim 64] [--mean-doc 256] [--worlds 2 4]

One thread per rank; per-rank time is thread CPU time of one forward+backward (fastest of `iters`).
1. split vs mask (one process, causal, whole sequence): the plan's document-aligned sub-blocks through
   the CPU flash kernel vs one call with an explicit float mask; ratio = mask time / split time.
2. per layout and ring size, with documents drawn around --mean-doc tokens:
   - imbalance  = max / mean of the per-rank times;
   - efficiency = T_single_packed / (W × T_rank_max), T_single_packed = one process, same documents;
   - packed/dense = T_rank_max with documents / T_rank_max of the same ring without (causal);
   - visible = visible pairs with documents / without: the ideal packed/dense.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from tests.support.dist import run_distributed
from workers.attention.plan import Documents, ring_plan
from workers.attention.ring import _ring_attention


def doc_bounds(seq: int, mean: int, seed: int = 0) -> list[int]:
    """Boundaries of documents with exponentially distributed lengths (mean `mean`), the last one cut at S."""
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.empty(seq).exponential_(1.0 / mean, generator=g).ceil().long()).tolist()
    bounds, pos = [0], 0
    for n in lengths:
        pos = min(seq, pos + int(n))
        bounds.append(pos)
        if pos == seq:
            break
    return bounds


def _fastest(fn, iters: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    best = float("inf")
    for _ in range(iters):
        c0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - c0)
    return best


def split_vs_mask(seq: int, h: int, d: int, mean: int, iters: int) -> tuple[float, float, int]:
    """(split s, mask s, documents) for one causal fwd+bwd over the whole sequence in one process."""
    torch.set_num_threads(1)
    bounds = doc_bounds(seq, mean)
    cu = torch.tensor(bounds, dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, seq, h, d, generator=g) for _ in range(4))

    def split() -> None:
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        _ring_attention(qq, kk, vv, causal=True, cu_seqlens=cu).backward(dout)

    ids = torch.searchsorted(cu.long(), torch.arange(seq), right=True) - 1
    visible = (ids[:, None] == ids[None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
    mask = torch.zeros(seq, seq).masked_fill(~visible, float("-inf"))
    bhsd = [t.transpose(1, 2) for t in (q, k, v, dout)]

    def masked() -> None:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *bhsd[:3], 0.0, False, attn_mask=mask
        )
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            bhsd[3], *bhsd[:3], out, lse, 0.0, False, attn_mask=mask
        )

    return _fastest(split, iters), _fastest(masked, iters), len(bounds) - 1


def _rank_job(rank: int, world: int, cfg: dict) -> float:
    torch.set_num_threads(1)
    s, h, d = cfg["seq"], cfg["heads"], cfg["head_dim"]
    cu = None if cfg["bounds"] is None else torch.tensor(cfg["bounds"], dtype=torch.int32)
    g = torch.Generator().manual_seed(rank)
    q, k, v, dout = (torch.randn(1, s // world, h, d, generator=g) for _ in range(4))
    best = float("inf")
    for i in range(cfg["iters"] + 1):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        if world > 1:
            dist.barrier()
        c0 = time.thread_time()
        _ring_attention(qq, kk, vv, causal=True, layout=cfg["layout"], cu_seqlens=cu).backward(dout)
        if i:
            best = min(best, time.thread_time() - c0)
    return best


def visible_pairs(seq: int, bounds: list[int] | None) -> float:
    docs = None if bounds is None else Documents(((0, 1, tuple(bounds)),))
    return sum(
        b.cost() for blocks in ring_plan("contiguous", True, 0, 1, seq, docs) for b in blocks
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--mean-doc", type=int, default=256)
    ap.add_argument("--split-docs", type=int, nargs="+", default=[16, 128, 1024])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--iters", type=int, default=2)
    args = ap.parse_args()
    s, h, d = args.seq, args.heads, args.head_dim
    print(
        f"packed documents, causal, fp32, S={s}, H={h}, D={d}, 1 thread per rank, fastest of {args.iters}"
    )
    print(
        "\n1. document-aligned sub-blocks vs one explicit float mask (one process, whole sequence)\n"
    )
    print("| mean doc | documents | split s | mask s | mask/split |\n|---|---|---|---|---|")
    for mean in args.split_docs:
        t_split, t_mask, n_docs = split_vs_mask(s, h, d, mean, args.iters)
        print(f"| {mean} | {n_docs} | {t_split:.3f} | {t_mask:.3f} | {t_mask / t_split:.2f} |")
    bounds = doc_bounds(s, args.mean_doc)
    ideal = visible_pairs(s, bounds) / visible_pairs(s, None)
    base = dict(seq=s, heads=h, head_dim=d, iters=args.iters)
    single = run_distributed(_rank_job, 1, {**base, "layout": "contiguous", "bounds": bounds})[0]
    print(
        f"\n2. rings, {len(bounds) - 1} documents (mean {args.mean_doc} tokens); one process packed: {single:.3f} s; "
        f"visible pairs packed/dense = {ideal:.3f}\n"
    )
    cols = [
        "W",
        "layout",
        "per-rank cpu s (packed)",
        "imbalance",
        "efficiency",
        "packed/dense",
        "dense imbalance",
    ]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for world in args.worlds:
        for layout in ("contiguous", "zigzag", "striped"):
            packed = run_distributed(_rank_job, world, {**base, "layout": layout, "bounds": bounds})
            dense = run_distributed(_rank_job, world, {**base, "layout": layout, "bounds": None})
            row = [
                str(world),
                layout,
                " / ".join(f"{t:.3f}" for t in packed),
                f"{max(packed) / statistics.mean(packed):.3f}",
                f"{single / (world * max(packed)):.3f}",
                f"{max(packed) / max(dense):.3f}",
                f"{max(dense) / statistics.mean(dense):.3f}",
            ]
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
