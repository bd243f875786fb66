"""Ring attention benchmark: balance, efficiency, memory and overlap, all measured in one run.

    python -m bench.attention [--seq 4096] [--heads 8] [--head-dim 64] [--iters 3]

Every rank runs with one thread. Per-rank time is thread CPU time of one forward+backward, the rank's own
compute: time spent blocked on the ring does not count. Wall time is measured too (with more ranks than cores,
ranks time-share and wall time mostly measures the scheduler).
- imbalance       = max / mean of the per-rank CPU times (1.00 = perfectly balanced);
- cpu efficiency  = T_single / (W × T_rank_max) in CPU time, T_single being one process on the whole sequence;
- wall efficiency = the same in wall time (includes waiting on the ring; meaningful only while W <= cores);
- act        = bytes autograd keeps for backward (q, k, v, out, lse) on a rank / the single process's;
- peak       = peak RSS growth of a rank during forward+backward (ring buffers included) / the single process's;
- overlap    = the same ring with the exchange waited for before each block (no overlap) vs with overlap.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist

from tests.support.dist import run_distributed
from workers.attention import attention_backend
from workers.attention.ring import _ring_attention


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rank_job(rank: int, world: int, cfg: dict) -> dict:
    """One rank: time `iters` forward+backward passes after one warm-up; report the fastest and the peak RSS growth."""
    torch.set_num_threads(1)
    s, h, d, layout = cfg["seq"], cfg["heads"], cfg["head_dim"], cfg["layout"]
    # A tiny pass first, so code pages and allocator pools touched on first use are not counted as memory.
    tiny = [
        torch.randn(1, 16, n, d, requires_grad=True) for n in (h, cfg["kv_heads"], cfg["kv_heads"])
    ]
    _ring_attention(*tiny, causal=True, layout=layout, overlap=cfg["overlap"]).sum().backward()
    rss0 = _max_rss_bytes()
    g = torch.Generator().manual_seed(0)
    # Only this rank's shard is ever allocated (values need not match across runs: timing and memory only).
    q, k, v, dout = (
        torch.randn(1, s // world, n, d, generator=g)
        for n in (h, cfg["kv_heads"], cfg["kv_heads"], h)
    )
    walls, cpus = [], []
    for i in range(cfg["iters"] + 1):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        if world > 1:
            dist.barrier()
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, saved: dict[int, int] = saved) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        w0, c0 = time.perf_counter(), time.thread_time()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = _ring_attention(qq, kk, vv, causal=True, layout=layout, overlap=cfg["overlap"])
        out.backward(dout)
        w1, c1 = time.perf_counter(), time.thread_time()
        if i:  # the first pass is warm-up
            walls.append(w1 - w0)
            cpus.append(c1 - c0)
    return {
        "wall": min(walls),
        "cpu": min(cpus),
        "mem": _max_rss_bytes() - rss0,
        "act": sum(saved.values()),
    }


def measure(cfg: dict, world: int) -> list[dict]:
    return run_distributed(_rank_job, world, cfg, timeout=1800)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    base = dict(
        seq=args.seq,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        iters=args.iters,
    )
    print(
        f"ring attention, causal, fp32, S={args.seq}, H={args.heads}, KV heads={args.kv_heads}, "
        f"D={args.head_dim}, kernel={attention_backend('cpu', torch.float32)}, 1 thread per rank, "
        f"{args.iters} timed iterations (fastest)"
    )
    single = measure({**base, "layout": "contiguous", "overlap": True}, 1)[
        0
    ]  # measured again at the end
    print(
        f"single process, whole sequence: fwd+bwd {single['cpu']:.3f} s cpu ({single['wall']:.3f} s wall), "
        f"activations {single['act'] / 2**20:.1f} MiB, peak RSS growth {single['mem'] / 2**20:.1f} MiB"
    )
    rows = []
    for world in args.worlds:
        for layout in ("contiguous", "zigzag", "striped"):
            ranks = measure({**base, "layout": layout, "overlap": True}, world)
            cpu = [r["cpu"] for r in ranks]
            row = {
                "W": world,
                "layout": layout,
                "per-rank cpu s": " / ".join(f"{c:.2f}" for c in cpu),
                "imbalance": max(cpu) / statistics.mean(cpu),
                "cpu efficiency": single["cpu"] / (world * max(cpu)),
                "wall efficiency": single["wall"] / (world * max(r["wall"] for r in ranks)),
                "act/single": max(r["act"] for r in ranks) / single["act"],
                "peak/single": max(r["mem"] for r in ranks) / single["mem"],
                "goal 1.1/W": 1.1 / world,
                "max wall s": max(r["wall"] for r in ranks),
            }
            if layout == "zigzag":
                no_overlap = measure({**base, "layout": layout, "overlap": False}, world)
                row["wall no-overlap/overlap"] = (
                    max(r["wall"] for r in no_overlap) / row["max wall s"]
                )
            rows.append(row)
    again = measure({**base, "layout": "contiguous", "overlap": True}, 1)[0]
    print(
        f"single process again, after the rings: {again['cpu']:.3f} s cpu ({again['wall']:.3f} s wall); the "
        f"reference is the faster of the two, in each clock"
    )
    for clock in ("cpu", "wall"):
        if again[clock] < single[clock]:
            for row in rows:
                row[f"{clock} efficiency"] *= again[clock] / single[clock]
    cols = [
        "W",
        "layout",
        "per-rank cpu s",
        "imbalance",
        "cpu efficiency",
        "wall efficiency",
        "act/single",
        "peak/single",
        "goal 1.1/W",
        "max wall s",
        "wall no-overlap/overlap",
    ]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        cells = [
            f"{row[c]:.3f}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in cols
        ]
        print("| " + " | ".join(cells) + " |")
    print(
        f"\nact = bytes autograd keeps from forward to backward (activations); peak = peak RSS growth of the "
        f"whole pass, ring buffers included. Goal <= 1.1 / W ({', '.join(f'W={w}: {1.1 / w:.3f}' for w in args.worlds)}"
        f"); {os.cpu_count()} CPU cores here"
    )


if __name__ == "__main__":
    main()
