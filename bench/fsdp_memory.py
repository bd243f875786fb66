"""Sharded training state: per-rank state and peak memory vs world size, next to the planner's estimate.

    python -m bench.fsdp_memory [--d-model 1024] [--layers 24] [--seq 512] [--budget-gib 6]

A Llama-style model (default 24 × d_model 1024, 16 query / 4 KV heads, byte vocab: 265M parameters)
trains 2 steps on passkey data on rings of 1, 2 and 4 gloo processes (one thread each), FSDP2 over every
rank. Per rank:
- state      = the `state_bytes` metric (fp32 params + grads + AdamW moments this rank holds);
- peak       = growth of the rank's peak resident memory (VmHWM) over its RSS before the trainer was
               built (heap trimmed first): meta init, sharded materialisation, every step;
- estimate   = `service.planner.memory_estimate` for the same spec, and its error vs peak.
Then the longest sequence the planner admits under --budget-gib per rank with activation checkpointing,
on 1 and on 4 ranks, and one step run at the 4-rank length to measure its peak.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import re
from pathlib import Path

from service.planner import memory_estimate
from tests.support.dist import run_distributed
from workers.config import JobSpec

GIB = 1 << 30


def _spec(
    args: argparse.Namespace, world: int, seq: int, ac: bool = False, steps: int = 2
) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "fsdp-bench",
            "model": {
                "d_model": args.d_model,
                "n_layers": args.layers,
                "n_heads": 16,
                "n_kv_heads": 4,
            },
            "data": {"kind": "passkey", "seq_len": seq},
            "parallel": {"ring_size": world, "layout": "zigzag"},
            "train": {
                "steps": steps,
                "batch_size": 1,
                "warmup_steps": 0,
                "activation_checkpointing": ac,
            },
            "checkpoint": {"every_steps": 0},
            "eval": {"enabled": False},
        }
    )


def _status(field: str) -> int:
    m = re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    return int(m.group(1)) * 1024 if m else 0


def _rank(rank: int, world: int, spec_json: str) -> dict[str, float]:
    from workers.training.trainer import run_training

    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM
    base = _status("VmRSS")
    points: list = []
    run_training(JobSpec.model_validate_json(spec_json), checkpoint_dir=None, emit=points.append)
    return {
        "state": max(p.value for p in points if p.name == "state_bytes"),
        "peak": _status("VmHWM") - base,
        "step_s": max(p.value for p in points if p.name == "step_time_s") if rank == 0 else 0.0,
    }


def _row(spec: JobSpec, per_rank: list[dict[str, float]]) -> str:
    est = memory_estimate(spec)["total_bytes"]
    state, peak = max(r["state"] for r in per_rank), max(r["peak"] for r in per_rank)
    return (
        f"| {spec.world_size} | {spec.data.seq_len} | {spec.train.activation_checkpointing} "
        f"| {state / GIB:.2f} | {peak / GIB:.2f} | {est / GIB:.2f} | {100 * (est - peak) / peak:+.0f} % "
        f"| {per_rank[0]['step_s']:.1f} |"
    )


def longest_seq(args: argparse.Namespace, world: int, budget: float) -> int:
    """Largest seq_len (a multiple of 2·world·64) whose planner estimate fits `budget` bytes per rank."""
    unit, best, seq = 2 * world * 64, 0, 2 * world * 64
    while memory_estimate(_spec(args, world, seq, ac=True))["total_bytes"] <= budget:
        best, seq = seq, seq * 2
    lo, hi = best, seq
    while hi - lo > unit:
        mid = (lo + hi) // 2 // unit * unit
        ok = memory_estimate(_spec(args, world, mid, ac=True))["total_bytes"] <= budget
        lo, hi = (mid, hi) if ok else (lo, mid)
    return lo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--budget-gib", type=float, default=6.0)
    parser.add_argument(
        "--skip-long", action="store_true", help="do not run the longest-sequence step"
    )
    args = parser.parse_args()
    params = memory_estimate(_spec(args, 1, args.seq))["param_count"]
    print(f"model: {args.layers} layers × d_model {args.d_model}: {params / 1e6:.0f}M parameters")
    print(
        "| ranks | seq | AC | state/rank GiB | peak/rank GiB | estimate GiB | est. error | step s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for world in (1, 2, 4):
        spec = _spec(args, world, args.seq)
        print(
            _row(spec, run_distributed(_rank, world, spec.model_dump_json(), timeout=3600)),
            flush=True,
        )
    budget = args.budget_gib * GIB
    longest = {w: longest_seq(args, w, budget) for w in (1, 4)}
    print(f"longest sequence under {args.budget_gib:g} GiB/rank (planner, AC on): {longest}")
    if not args.skip_long and longest[4]:
        spec = _spec(args, 4, longest[4], ac=True, steps=1)
        print(
            _row(spec, run_distributed(_rank, 4, spec.model_dump_json(), timeout=3600)), flush=True
        )


if __name__ == "__main__":
    main()
