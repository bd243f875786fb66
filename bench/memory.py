"""Memory per token: where a rank's peak goes, what each knob saves and costs, and how well the planner predicts it.

    python -m bench.memory --breakdown [--seq 4096] [--ring 2] [--knobs full]    # one step attributed to causes
    python -m bench.memory --grid [--seqs 4096 8192] [--ring 2] [--knobs none full full+tiled ...]
    python -m bench.memory --cost [--seq 2048] [--knobs none selective full ...]   # CPU time per knob

Model (the issue's baseline): native d_model 512, 8 layers, 16/4 heads, ffn_mult 4, zigzag, batch 1, fp32,
one thread per rank. Every run is `torchrun -m workers.train SPEC --steps 2` (the real trainer) and reads
step 2's `mem_peak_bytes` (max over ranks) and `tokens_per_s`.

- token footprint = (peak at the longer seq - peak at the shorter) / (local tokens between them) /
  (n_layers x d_model x 4 bytes): the marginal bytes per local token in units of one fp32 residual per layer.
- planner error = `service.planner.memory_estimate(spec)["total_bytes"]` / measured peak - 1.
- `--breakdown` runs the same trainer under `bench.memory --breakdown-rank` on each rank: step 1 plain, step 2
  with `workers.training.memory.LiveTensors` (live tensor bytes by phase:op at the step's peak) and the RSS
  before the step, so peak RSS = RSS before (process, state) + live tensors at the peak + what the C
  allocator holds beyond them.

Knob names: none | selective | full (activation checkpointing), +tiled (tiled_mlp auto), +tiledN, +offload.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from service.planner import memory_estimate
from workers.config import JobSpec

MODEL = {"d_model": 512, "n_layers": 8, "n_heads": 16, "n_kv_heads": 4, "ffn_mult": 4}


def knob_fields(knobs: str) -> dict[str, Any]:
    """`full+tiled` -> {activation_checkpointing: full, tiled_mlp: auto}."""
    parts = knobs.split("+")
    train: dict[str, Any] = {"activation_checkpointing": parts[0]}
    for extra in parts[1:]:
        if extra == "tiled":
            train["tiled_mlp"] = "auto"
        elif extra.startswith("tiled"):
            train["tiled_mlp"] = int(extra[5:])
        elif extra == "offload":
            train["offload_activations"] = True
        else:
            raise SystemExit(f"unknown knob {extra!r}")
    return train


def spec_dict(
    seq: int, ring: int, knobs: str, model: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "name": f"mem-{knobs}-{seq}",
        "model": model or MODEL,
        "data": {"kind": "passkey", "seq_len": seq},
        "parallel": {"ring_size": ring, "layout": "zigzag"},
        "train": {"steps": 2, "batch_size": 1, "warmup_steps": 0, **knob_fields(knobs)},
        "checkpoint": {"every_steps": 0},
        "eval": {"enabled": False},
    }


def torchrun(
    spec: dict[str, Any], ring: int, extra: list[str], env: dict[str, str] | None = None
) -> list[dict]:
    """Run the spec on `ring` ranks; return the metric points."""
    with tempfile.TemporaryDirectory() as tmp:
        path, out = Path(tmp) / "spec.yaml", Path(tmp) / "m.jsonl"
        path.write_text(yaml.safe_dump(spec))
        module = extra[0] if extra else "workers.train"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ring}",
        ]
        cmd += ["-m", module, str(path), "--steps", "2", "--metrics-jsonl", str(out), *extra[1:]]
        run_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        subprocess.run(
            cmd, check=True, env=run_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        return [json.loads(line) for line in out.read_text().splitlines()]


def step2(points: list[dict], name: str) -> float:
    values = [p["value"] for p in points if p["name"] == name and p["step"] == 2]
    return max(values)


def grid(args: argparse.Namespace) -> None:
    first = args.knobs[0]
    print(
        f"| knobs | seq | ring | peak/rank GB | estimate GB | est. error | tok/s | tok/s vs {first} |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows: dict[tuple[str, int], tuple[float, float]] = {}
    for knobs in args.knobs:
        for seq in args.seqs:
            spec = spec_dict(seq, args.ring, knobs, args.model)
            points = torchrun(spec, args.ring, [])
            peak, rate = step2(points, "mem_peak_bytes"), step2(points, "tokens_per_s")
            estimate = memory_estimate(JobSpec.model_validate(spec))["total_bytes"]
            rows[(knobs, seq)] = (peak, rate)
            base = rows.get((args.knobs[0], seq), (0.0, rate))[1]
            print(
                f"| {knobs} | {seq} | {args.ring} | {peak / 1e9:.3f} | {estimate / 1e9:.3f} | "
                f"{estimate / peak - 1:+.0%} | {rate:.0f} | {rate / base:.2f} |",
                flush=True,
            )
    lo, hi = min(args.seqs), max(args.seqs)
    model = args.model or MODEL
    unit = model["n_layers"] * model["d_model"] * 4
    print("\n| knobs | token footprint |\n|---|---|")
    for knobs in args.knobs:
        per_token = (rows[(knobs, hi)][0] - rows[(knobs, lo)][0]) / ((hi - lo) / args.ring)
        print(f"| {knobs} | {per_token / unit:.2f} |")


def cost(args: argparse.Namespace) -> None:
    """Compute cost of each knob: thread CPU seconds of one forward+backward on one rank (fastest of
    --reps), the baseline model at --seq tokens. CPU time, not wall time: other work on the machine
    does not count, which wall time on a shared machine cannot promise."""
    import time

    import torch

    from workers.training.trainer import Trainer

    torch.set_num_threads(1)
    seconds: dict[str, float] = {}
    print("| knobs | seq | cpu s (fwd+bwd) | tok/s (cpu) | vs none |\n|---|---|---|---|---|")
    for knobs in args.knobs:
        spec = JobSpec.model_validate(spec_dict(args.seq, 1, knobs, args.model))
        trainer = Trainer(
            spec, checkpoint_dir=None, emit=lambda p: None, device=torch.device("cpu")
        )
        local = trainer.local_batch()
        best = float("inf")
        for _ in range(args.reps):
            t0 = time.thread_time()
            trainer.forward_backward(local)
            best = min(best, time.thread_time() - t0)
            trainer.optimizer.zero_grad(set_to_none=True)
        seconds[knobs] = best
        base = seconds.get("none", best)
        print(
            f"| {knobs} | {args.seq} | {best:.2f} | {args.seq / best:.0f} | {base / best:.2f} |",
            flush=True,
        )
        del trainer


def breakdown(args: argparse.Namespace) -> None:
    spec = spec_dict(args.seq, args.ring, args.knobs[0], args.model)
    rank_args = ["bench.memory", "--breakdown-rank"] + (["--shapes"] if args.shapes else [])
    for malloc in ("glibc", "bounded"):
        env = {"RINGTRAIN_MALLOC": "glibc"} if malloc == "glibc" else {}
        points = torchrun(spec, args.ring, rank_args, env)
        rows = [p for p in points if p["name"].startswith("breakdown/") and p.get("rank", 0) == 0]
        print(
            f"\n### allocator: {malloc} (rank 0, seq {args.seq}, ring {args.ring}, {args.knobs[0]})\n"
        )
        print("| part | MB |\n|---|---|")
        for p in rows:
            print(f"| {p['name'][len('breakdown/') :]} | {p['value'] / 1e6:.1f} |")


def breakdown_rank(spec_path: Path, metrics: Path, shapes: bool) -> None:
    """One rank under torchrun: step 1 plain, step 2 attributed (see the module docstring)."""
    import torch
    import torch.distributed as dist

    from workers.config import load_spec
    from workers.training.loss import linear_cross_entropy_sum
    from workers.training.memory import LiveTensors, release_freed_memory, rss_bytes
    from workers.training.trainer import Trainer

    dist.init_process_group("gloo")
    spec = load_spec(spec_path.read_text())
    trainer = Trainer(spec, checkpoint_dir=None, emit=lambda p: None)
    trainer.memory.reset()
    stats = trainer.train_step()
    first_peak = trainer.memory.peak()
    release_freed_memory()
    before = rss_bytes()
    trainer.memory.reset()
    local = trainer.local_batch()
    tracker = LiveTensors(shapes=shapes)
    with tracker:
        positions = local.positions if local.doc_positions is None else local.doc_positions
        hidden = trainer.model.features(local.inputs, positions, cu_seqlens=local.cu_seqlens)
        tracker.phase = "loss"
        loss = linear_cross_entropy_sum(
            hidden, trainer.model.output_weight, local.labels, local.weights
        )
        tracker.phase = "backward"
        loss.backward()
    peak = trainer.memory.peak()
    rank = dist.get_rank()
    parts: dict[str, float] = {
        "step 1 peak RSS (mem_peak_bytes)": first_peak,
        "RSS before step 2 (interpreter, torch, state)": before,
        "  of which training state (state_bytes)": stats.state_bytes,
        "peak RSS of step 2 forward+backward": peak,
        "live tensors at the step's peak": tracker.peak,
        "held by the C allocator beyond live tensors": peak - before - tracker.peak,
    }
    top = sorted(tracker.at_peak.items(), key=lambda kv: -kv[1])[:24]
    for label, nbytes in top:
        parts[f"  live at peak: {label}"] = nbytes
    with metrics.open("a") as out:
        for name, value in parts.items():
            out.write(
                json.dumps(
                    {"step": 2, "name": f"breakdown/{name}", "value": float(value), "rank": rank}
                )
                + "\n"
            )
    dist.destroy_process_group()
    del torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", nargs="?", type=Path, help="(--breakdown-rank only)")
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--breakdown-rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--grid", action="store_true")
    parser.add_argument(
        "--cost", action="store_true", help="CPU seconds of fwd+bwd per knob, one rank"
    )
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--ring", type=int, default=2)
    parser.add_argument("--knobs", nargs="+", default=["full"])
    parser.add_argument(
        "--shapes", action="store_true", help="--breakdown: label by tensor shape too"
    )
    parser.add_argument(
        "--model", type=json.loads, help="model fields as JSON (default: the issue baseline)"
    )
    parser.add_argument("--steps", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--metrics-jsonl", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.breakdown_rank:
        breakdown_rank(args.spec, args.metrics_jsonl, args.shapes)
    elif args.breakdown:
        breakdown(args)
    elif args.cost:
        cost(args)
    else:
        grid(args)


if __name__ == "__main__":
    main()
