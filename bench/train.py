"""Sequence-parallel training benchmark: throughput, memory per rank, longest sequence under a budget.

    python -m bench.train [--seqs 1024,2048,4096] [--budget-mib MiB] [--curve-steps 60]

A small Llama-style model (d_model 64, 2 layers, 4 query / 2 KV heads, byte vocab) trains on passkey
data on rings of 1, 2 and 4 gloo processes, each with one thread, with and without activation
checkpointing; a ring of W measures W × each --seqs length (the same tokens per rank). Columns:
- tok/s wall   = global tokens / wall time of a step (all ranks share this machine's cores: with more
                 ranks than cores, wall time stops meaning much);
- tok/s cpu    = global tokens / CPU time of the slowest rank in that step: the rate with a core per rank;
- peak/rank    = growth of a rank's peak resident memory during training above its RSS before the run
                 (heap trimmed first) — weights, grads, optimizer state, activations, ring buffers;
- max seq      = longest sequence whose fitted peak/rank (linear fit over the measured lengths) stays
                 under the budget, then *run* at that length to confirm (measured peak shown; where it
                 overshoots, the length shrinks in proportion and runs once more);
- ratio        = max seq / (W × the single process's max seq) — the goal is ≥ 0.9.
Then a short passkey training curve on a ring of 2.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import re
import sys
import time
from pathlib import Path

import torch

from tests.support.dist import run_distributed
from workers.config import JobSpec
from workers.training.trainer import run_training

RINGS = (1, 2, 4)
MIB = 1 << 20


def _spec(world: int, seq: int, ac: bool, steps: int = 2, **train: object) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "bench",
            "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2},
            "data": {"kind": "passkey", "seq_len": seq, "key_digits": 3},
            "parallel": {"ring_size": world, "layout": "zigzag"},
            "train": {
                "steps": steps,
                "batch_size": 1,
                "lr": 1e-3,
                "activation_checkpointing": ac,
                **train,
            },
            "checkpoint": {"every_steps": 0},
            "eval": {"enabled": False},
        }
    )


def _rss() -> int:
    return (
        int(re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
    )


def _trim() -> None:
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so RSS reflects live memory


def _measure(world: int, seq: int, ac: bool) -> dict:
    """Two training steps (the first warms up); measure step 2's time and the peak over both."""
    _trim()
    base = _rss()
    cpu: dict[int, float] = {}
    peak: dict[int, float] = {}
    wall: dict[int, float] = {}

    def emit(p) -> None:  # type: ignore[no-untyped-def]
        if p.name == "mem_peak_bytes":
            cpu[p.step], peak[p.step] = time.process_time(), p.value
        elif p.name == "step_time_s":
            wall[p.step] = p.value

    start = time.process_time()
    run_training(_spec(world, seq, ac), checkpoint_dir=None, emit=emit, device=torch.device("cpu"))
    assert cpu, "no steps ran"
    return {
        "seq": seq,
        "ac": ac,
        "cpu": cpu[2] - cpu[1] if 2 in cpu else cpu[1] - start,
        "wall": wall.get(2, 0.0),
        "peak": max(peak.values()) - base,
    }


def _rank_job(rank: int, world: int, plan: list[tuple[int, bool]]) -> list[dict]:
    torch.set_num_threads(1)
    _measure(world, 128 * world, False)  # warm-up: first-use code paths and pools are not counted
    return [_measure(world, seq, ac) for seq, ac in plan]


def _curve(rank: int, world: int, steps: int, seq: int) -> list[tuple[int, str, float]]:
    torch.set_num_threads(1)
    spec = _spec(world, seq, False, steps=steps, batch_size=4, lr=3e-3, warmup_steps=5)
    spec = spec.model_copy(
        update={"eval": spec.eval.model_copy(update={"enabled": True, "samples": 8})}
    )
    points: list = []
    run_training(spec, checkpoint_dir=None, emit=points.append, device=torch.device("cpu"))
    return [(p.step, p.name, p.value) for p in points if p.name in ("loss", "passkey_acc")]


def _run(world: int, plan: list[tuple[int, bool]]) -> list[dict]:
    """Per config: the slowest rank's CPU time, rank 0's wall time, the largest rank peak."""
    per_rank = run_distributed(_rank_job, world, plan, timeout=900)
    merged = []
    for i, cfg in enumerate(per_rank[0]):
        rows = [r[i] for r in per_rank]
        merged.append(
            {**cfg, "cpu": max(r["cpu"] for r in rows), "peak": max(r["peak"] for r in rows)}
        )
    return merged


def _log(msg: str) -> None:
    print(f"[bench.train] {msg}", file=sys.stderr, flush=True)


def _fit_max_seq(rows: list[dict], budget: float, multiple: int) -> int:
    """Least-squares line peak = a + b·seq through the measurements, solved for peak = budget."""
    xs, ys = [r["seq"] for r in rows], [r["peak"] for r in rows]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    a = my - b * mx
    return max(multiple, int((budget - a) / b) // multiple * multiple) if n > 1 and b > 0 else 0


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--seqs", default="1024,2048,4096", help="sequence lengths measured on every ring"
    )
    ap.add_argument(
        "--budget-mib",
        type=float,
        default=None,
        help="per-rank memory budget for 'max seq' (default: what one process needs at the longest --seqs length)",
    )
    ap.add_argument(
        "--curve-steps", type=int, default=60, help="passkey training curve length (0: skip)"
    )
    args = ap.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    print("$ python -m bench.train " + " ".join(sys.argv[1:]))
    print(
        "model d_model 64, 2 layers, 4 q / 2 kv heads, vocab 256; batch 1; fp32; one thread per rank; zigzag\n"
    )

    t0 = time.time()
    table: dict[tuple[int, bool], list[dict]] = {}
    for world in RINGS:
        plan = [
            (s * world, ac) for ac in (False, True) for s in seqs
        ]  # the same tokens per rank on every ring
        _log(f"ring {world}: {len(plan)} configs")
        for row in _run(world, plan):
            table.setdefault((world, row["ac"]), []).append(row)
    budget = args.budget_mib * MIB if args.budget_mib else table[(1, False)][-1]["peak"]
    # Never extrapolate past twice the longest measured length (a noisy fit would run for ages).
    fits = {
        (w, ac): min(2 * w * max(seqs), _fit_max_seq(rows, budget, 2 * w * 64))
        for (w, ac), rows in table.items()
    }
    for world in RINGS:  # confirm each fitted length by running it
        plan = [(fits[(world, ac)], ac) for ac in (False, True)]
        _log(f"ring {world}: confirming max seq {plan}")
        for row in _run(world, plan):
            table[(world, row["ac"])].append({**row, "confirm": True})
    # Memory is not quite linear in length: where the confirming run overshot, shrink in proportion and rerun.
    for world in RINGS:
        over = [ac for ac in (False, True) if table[(world, ac)][-1]["peak"] > budget]
        if not over:
            continue
        for ac in over:
            last = table[(world, ac)][-1]
            step = 2 * world * 64
            fits[(world, ac)] = max(step, int(last["seq"] * budget / last["peak"]) // step * step)
        _log(f"ring {world}: re-confirming {[(fits[(world, ac)], ac) for ac in over]}")
        for row in _run(world, [(fits[(world, ac)], ac) for ac in over]):
            table[(world, row["ac"])][-1] = {**row, "confirm": True}

    cols = ["ring", "act. ckpt", "seq", "tok/s wall", "tok/s cpu", "peak/rank MiB"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for (world, ac), rows in table.items():
        for r in rows:
            if r.get("confirm"):
                continue
            wall = f"{r['seq'] / r['wall']:.0f}" if r["wall"] else "-"
            print(
                f"| {world} | {'on' if ac else 'off'} | {r['seq']} | {wall} | {r['seq'] / r['cpu']:.0f} | "
                f"{r['peak'] / MIB:.1f} |"
            )

    print(
        f"\nLongest sequence under {budget / MIB:.1f} MiB per rank (fitted, then run at that length):\n"
    )
    cols = ["ring", "act. ckpt", "max seq", "measured peak/rank MiB", "fits", "ratio vs W × single"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for (world, ac), rows in table.items():
        confirm = next(r for r in rows if r.get("confirm"))
        single = fits[(1, ac)]
        ratio = fits[(world, ac)] / (world * single) if single else float("nan")
        print(
            f"| {world} | {'on' if ac else 'off'} | {fits[(world, ac)]} | {confirm['peak'] / MIB:.1f} | "
            f"{'yes' if confirm['peak'] <= budget else 'NO'} | {ratio:.2f} |"
        )

    if args.curve_steps:
        seq = 256
        _log(f"passkey curve: {args.curve_steps} steps")
        pts = run_distributed(_curve, 2, args.curve_steps, seq, timeout=900)[0]
        loss = {s: v for s, n, v in pts if n == "loss"}
        every = max(1, args.curve_steps // 10)
        shown = [s for s in sorted(loss) if s == 1 or s % every == 0]
        print(f"\nPasskey training curve (ring 2, seq {seq}, batch 4, lr 3e-3):")
        print("| step | " + " | ".join(str(s) for s in shown) + " |\n|" + "---|" * (len(shown) + 1))
        print("| loss | " + " | ".join(f"{loss[s]:.3f}" for s in shown) + " |")
        acc = [v for _, n, v in pts if n == "passkey_acc"]
        print(f"final passkey_acc (8 keys × depths 0.1/0.5/0.9): {acc[-1]:.2f}")
    print(f"\n(total {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
