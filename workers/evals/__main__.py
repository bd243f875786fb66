"""`python -m workers.evals MODEL_DIR --lengths 4096,8192 --samples N [...]`: a RULER-style
evaluation of a model directory, on one process or a ring started by torchrun
(`torchrun --nproc-per-node R -m workers.evals ...`: env rendezvous, gloo on CPU, NCCL on GPUs).
Rank 0 prints the summary as JSON on stdout, progress on stderr, and writes `--samples-out`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from workers.evals.ruler import TASKS
from workers.evals.run import evaluate
from workers.evals.scoring import THRESHOLD


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m workers.evals", description=__doc__)
    p.add_argument("model_dir", help="a Hugging Face model directory (weights, config, tokenizer)")
    p.add_argument("--lengths", required=True, help="comma-separated prompt lengths in tokens")
    p.add_argument("--samples", type=int, default=4, help="samples per task and length")
    p.add_argument("--tasks", default=",".join(TASKS), help="comma-separated tasks (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous", "striped"])
    p.add_argument("--threshold", type=float, default=THRESHOLD)
    p.add_argument("--samples-out", help="write one JSON line per sample here")
    return p


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--lengths {text!r}: comma-separated integers, e.g. 4096,8192") from None
    if not lengths or min(lengths) < 1:
        raise SystemExit(f"--lengths {text!r}: at least one positive length")
    return lengths


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    lengths = _lengths(args.lengths)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    rank = dist.get_rank() if dist.is_initialized() else 0

    def show(r: dict[str, Any]) -> None:
        if rank == 0:
            print(
                f"[eval] {r['task']} len={r['length']} #{r['index']}: score {r['score']:.2f} "
                f"({r['prompt_tokens']} tokens, {r['seconds']} s)",
                file=sys.stderr,
                flush=True,
            )

    try:
        report, records = evaluate(
            args.model_dir,
            lengths,
            args.samples,
            tasks=[t for t in args.tasks.split(",") if t],
            seed=args.seed,
            layout=args.layout,
            threshold=args.threshold,
            progress=show,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        if args.samples_out:
            with open(args.samples_out, "w") as f:
                for r in records:
                    r = {k: v for k, v in r.items() if k != "seconds"}
                    f.write(json.dumps(r) + "\n")
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
