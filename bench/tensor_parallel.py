"""Ring x tensor parallel at equal world size and sequence: throughput and memory per rank.

    python -m bench.tensor_parallel [--seq 4096] [--steps 3] [--d-model 512] [--layers 8]

The same job (native model, default d_model 512, 8 layers, 16 query / 4 K/V heads, ffn_mult 4,
byte vocabulary; passkey data; batch 1; fp32; full activation checkpointing; one thread per rank)
on W gloo processes, split three ways: the ring alone (ring W: the reference of each W), a ring
with tensor groups (ring W/2 x tensor 2), and tensor parallelism alone (tensor W). Per shape:

- tok/s wall   = global tokens / rank 0's step time (all ranks share this machine's 2 cores);
- tok/s cpu    = global tokens / the slowest rank's CPU time in that step (the rate with a core
                 per rank; gloo's copies over loopback count as CPU time);
- vs ring      = tok/s cpu over the ring-only shape of the same W, measured in the same run;
- peak/rank    = the largest `mem_peak_bytes` over ranks (resident set on CPU), and the
                 planner's `memory.total_bytes` for the spec next to it;
- state/rank   = `state_bytes` (parameters, gradients and AdamW moments this rank holds).

Steps after the first are averaged (the first allocates the optimizer state).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from typing import Any

import torch

from service.planner import memory_estimate
from tests.support.dist import run_distributed
from workers.config import JobSpec
from workers.training.trainer import run_training

MIB = 1 << 20


def _spec(args: argparse.Namespace, ring: int, tensor: int) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "tp-bench",
            "model": {
                "d_model": args.d_model,
                "n_layers": args.layers,
                "n_heads": 16,
                "n_kv_heads": 4,
                "ffn_mult": 4,
            },
            "data": {"kind": "passkey", "seq_len": args.seq, "key_digits": 3},
            "parallel": {"ring_size": ring, "tensor_size": tensor, "layout": "zigzag"},
            "train": {
                "steps": args.steps,
                "batch_size": 1,
                "warmup_steps": 0,
                "activation_checkpointing": "full",
            },
            "checkpoint": {"every_steps": 0},
            "eval": {"enabled": False},
            "verify": {"enabled": False},
        }
    )


def _rank(rank: int, world: int, spec_json: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    cpu: dict[int, float] = {}
    out: dict[str, dict[int, float]] = {"step_time_s": {}, "mem_peak_bytes": {}, "state_bytes": {}}

    def emit(p: Any) -> None:
        if p.name in out:
            out[p.name][p.step] = p.value
        if p.name == "mem_peak_bytes":
            cpu[p.step] = time.process_time()

    start = time.process_time()
    spec = JobSpec.model_validate_json(spec_json)
    run_training(spec, checkpoint_dir=None, emit=emit, device=torch.device("cpu"))
    steps = sorted(cpu)
    per_step = [cpu[s] - cpu[p] for p, s in itertools.pairwise(steps)] or [cpu[steps[0]] - start]
    walls = [out["step_time_s"][s] for s in steps[1:] if s in out["step_time_s"]]
    return {
        "cpu": sum(per_step) / len(per_step),
        "wall": sum(walls) / len(walls) if walls else 0.0,
        "peak": max(out["mem_peak_bytes"].values()),
        "state": max(out["state_bytes"].values()),
    }


def _log(msg: str) -> None:
    print(f"[bench.tensor_parallel] {msg}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--worlds", default="2,4", help="world sizes to compare at")
    args = ap.parse_args()
    print("$ python -m bench.tensor_parallel " + " ".join(sys.argv[1:]))
    print(
        f"model d_model {args.d_model}, {args.layers} layers, 16 q / 4 kv heads, ffn_mult 4; "
        f"seq {args.seq}; batch 1; fp32; full activation checkpointing; one thread per rank\n"
    )
    cols = [
        "world",
        "shape",
        "tok/s wall",
        "tok/s cpu",
        "vs ring",
        "peak/rank MiB",
        "planner MiB",
        "state/rank MiB",
    ]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    t0 = time.time()
    for world in (int(w) for w in args.worlds.split(",")):
        shapes = [(world, 1), (world // 2, 2), (1, world)] if world > 2 else [(2, 1), (1, 2)]
        reference = None
        for ring, tensor in shapes:
            spec = _spec(args, ring, tensor)
            _log(f"world {world}: ring {ring} x tensor {tensor}")
            ranks = run_distributed(_rank, world, spec.model_dump_json(), timeout=3600)
            cpu = max(r["cpu"] for r in ranks)
            rate_cpu, rate_wall = args.seq / cpu, args.seq / max(ranks[0]["wall"], 1e-9)
            reference = reference or rate_cpu
            shape = f"ring {ring}" + (f" x tensor {tensor}" if tensor > 1 else "")
            row = [
                str(world),
                shape,
                f"{rate_wall:.0f}",
                f"{rate_cpu:.0f}",
                f"{rate_cpu / reference:.2f}",
                f"{max(r['peak'] for r in ranks) / MIB:.0f}",
                f"{memory_estimate(spec)['total_bytes'] / MIB:.0f}",
                f"{max(r['state'] for r in ranks) / MIB:.1f}",
            ]
            print("| " + " | ".join(row) + " |", flush=True)
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
