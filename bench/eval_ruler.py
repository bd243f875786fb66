"""Cost of a RULER-style evaluation by prompt length, on one process and a ring of two.

    python -m bench.eval_ruler [--lengths 512,1024,2048,4096] [--samples 1]

A tiny random Llama checkpoint (written here, nothing downloaded), one thread per rank. For each
length: seconds per sample (ring prefill + pass-Q greedy decoding + scoring) on 1 and 2 ranks,
the ratio of the two, the cost relative to the shortest length on one rank, and the share of
samples whose greedy prediction is the same on both (it must be 1.00: the ring changes where the
keys are, not the answer).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tests.support.dist import run_distributed
from tests.support.hf_fixtures import write_checkpoint

TASKS = ["niah_single_noise", "niah_multikey", "vt", "fwe"]


def _run(rank: int, world: int, model_dir: str, lengths: list[int], samples: int) -> Any:
    from workers.evals.run import evaluate

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    report, records = evaluate(model_dir, lengths, samples, tasks=TASKS)
    return report, records, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--samples", type=int, default=1)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = write_checkpoint(
            Path(tmp) / "m", "llama", max_position_embeddings=2 * max(lengths), std=0.3
        )
        one = run_distributed(_run, 1, str(model), lengths, args.samples, timeout=3600)[0]
        two = run_distributed(_run, 2, str(model), lengths, args.samples, timeout=3600)[0]
    print(f"tiny llama (hidden 64, 2 layers), tasks {', '.join(TASKS)}, {args.samples} sample(s)")
    print(
        f"{'length':>7} {'tokens':>7} {'1 rank s':>9} {'2 ranks s':>10} {'2/1':>6} "
        f"{'vs first':>9} {'same answer':>12} {'score':>6}"
    )
    base = None
    for n in lengths:
        r1 = [r for r in one[1] if r["length"] == n]
        r2 = [r for r in two[1] if r["length"] == n]
        s1 = sum(r["seconds"] for r in r1) / len(r1)
        s2 = sum(r["seconds"] for r in r2) / len(r2)
        base = base or s1
        same = sum(a["prediction"] == b["prediction"] for a, b in zip(r1, r2, strict=True)) / len(
            r1
        )
        tokens = sum(r["prompt_tokens"] for r in r1) // len(r1)
        print(
            f"{n:>7} {tokens:>7} {s1:>9.2f} {s2:>10.2f} {s2 / s1:>6.2f} {s1 / base:>9.2f} "
            f"{same:>12.2f} {one[0]['by_length'][str(n)]:>6.2f}"
        )
    print(f"effective length (threshold {one[0]['threshold']}): {one[0]['effective_length']}")


if __name__ == "__main__":
    main()
