"""Training without Ray or the service, for debugging and for clusters run by other launchers.

    torchrun --nproc-per-node N -m workers.train SPEC.yaml [--steps K] [--metrics-jsonl PATH]
        [--checkpoint-dir DIR]

N must equal data_parallel × ring_size × ulysses_size × tensor_size (of the stage the run resumes
into, for a job with stages: a run trains the stages that share its N and stops before one that
needs another N, saying so; run it again with that N and the same --checkpoint-dir). Rendezvous
comes from torchrun's environment (env://); the backend is nccl when CUDA is available, else gloo.
Each metric point becomes one JSON line {"step", "name", "value", "rank"?}: every rank appends to
PATH when given (its per-rank points included), otherwise rank 0 prints to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist

from workers.config import load_spec
from workers.protocol import MetricPoint
from workers.training.checkpoint import latest_step
from workers.training.trainer import run_training


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workers.train", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("spec", type=Path, help="job spec (YAML or JSON)")
    parser.add_argument(
        "--steps", type=int, default=None, help="stop after this step (default: train.steps)"
    )
    parser.add_argument(
        "--metrics-jsonl", type=Path, default=None, help="append metric points here"
    )
    parser.add_argument(
        "--checkpoint-dir", type=Path, default=None, help="checkpoint and resume here"
    )
    args = parser.parse_args(argv)

    spec = load_spec(args.spec.read_text())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if spec.parallel.ring_auto:
        parser.error(
            "parallel.ring_size: auto is resolved by the control plane at submission; here, run "
            "`ringtrain plan SPEC --fit --memory-per-rank GIB` and put the ring_size it chooses in "
            "the spec"
        )
    if any(st.spec.parallel.pipeline_split == "auto" for st in spec.stage_plan()):
        parser.error(
            "parallel.pipeline_split: auto is resolved by the control plane at submission; here, "
            "run `ringtrain plan SPEC` and put the split it shows (memory.pipeline.split) in the "
            "spec"
        )
    done = (latest_step(args.checkpoint_dir) or 0) if args.checkpoint_dir is not None else 0
    stage = spec.stage_at(done)
    need = stage.spec.parallel.world_size
    if world != need:
        which = f" for stage {stage.index + 1} ({stage.name})" if spec.stages else ""
        parser.error(
            f"launched {world} processes but the spec needs data_parallel x ring_size x "
            f"ulysses_size x tensor_size = {need}{which}"
        )
    sizes = {s.spec.parallel.world_size for s in spec.stage_plan()}
    if len(sizes) > 1 and args.checkpoint_dir is None:
        parser.error(
            "the stages run on different numbers of ranks: give --checkpoint-dir, so the next "
            "launch continues from this one's last checkpoint"
        )
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0

    lock = threading.Lock()
    out: TextIO | None = None
    if args.metrics_jsonl is not None:
        args.metrics_jsonl.parent.mkdir(parents=True, exist_ok=True)
        out = args.metrics_jsonl.open(
            "a", buffering=1
        )  # O_APPEND + line buffering: whole lines from every rank
    elif rank == 0:
        out = sys.stdout

    def emit(p: MetricPoint) -> None:
        if out is None:
            return
        row: dict = {"step": p.step, "name": p.name, "value": p.value}
        if p.rank is not None:
            row["rank"] = p.rank
        with lock:
            out.write(json.dumps(row) + "\n")
            out.flush()

    try:
        result = run_training(
            spec, checkpoint_dir=args.checkpoint_dir, emit=emit, max_steps=args.steps
        )
        if rank == 0:
            print(
                f"finished at step {result.final_step}, loss {result.final_loss}, resumed from "
                f"{result.resumed_from}, attention backend {result.attention_backend}",
                file=sys.stderr,
            )
            if not result.stopped and result.final_step < min(
                args.steps or 1 << 62, spec.train.steps
            ):
                nxt = spec.stage_at(result.final_step)
                print(
                    f"stage {nxt.index + 1} ({nxt.name}) runs on "
                    f"{nxt.spec.parallel.world_size} ranks: launch again with --nproc-per-node "
                    f"{nxt.spec.parallel.world_size} and the same --checkpoint-dir",
                    file=sys.stderr,
                )
    finally:
        if out is not None and out is not sys.stdout:
            out.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
