"""All-reduce bandwidth between the ranks torchrun starts: the first thing to run on a new GPU cluster.

Prints NCCL-tests style figures (algbw = bytes / time; busbw = algbw · 2(n-1)/n, what each link carries in a ring
all-reduce) per message size, and exits 1 when the largest message's busbw is below --min-busbw-gbps, so a
cluster whose rings would crawl over TCP fails loudly before a training job finds out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist


def measure(size_bytes: int, iters: int, device: torch.device) -> float:
    """Seconds per all-reduce of `size_bytes` (fp32), after warm-up, timed on rank 0's clock after a barrier."""
    x = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
    for _ in range(3):
        dist.all_reduce(x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / iters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    ap.add_argument(
        "--sizes-mb", default="1,16,256,1024", help="comma-separated message sizes in MiB"
    )
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument(
        "--min-busbw-gbps",
        type=float,
        default=0.0,
        help="fail below this (GB/s) at the largest size",
    )
    args = ap.parse_args()

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.backend == "nccl":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend)
    n, rank = dist.get_world_size(), dist.get_rank()
    busbw = 0.0
    for mb in (int(s) for s in args.sizes_mb.split(",")):
        size = mb << 20
        t = measure(size, args.iters, device)
        algbw = size / t / 1e9
        busbw = algbw * 2 * (n - 1) / n
        if rank == 0:
            print(
                f"size {mb:6d} MiB  time {t * 1e3:9.3f} ms  algbw {algbw:8.2f} GB/s  busbw {busbw:8.2f} GB/s",
                flush=True,
            )
    ok = busbw >= args.min_busbw_gbps
    if rank == 0:
        verdict = "ok" if ok else f"FAIL: below {args.min_busbw_gbps:g} GB/s"
        print(
            f"world {n}  backend {args.backend}  largest-size busbw {busbw:.2f} GB/s  {verdict}",
            flush=True,
        )
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
