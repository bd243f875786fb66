"""Pipeline parallel on CPU: the measured bubble against theory, and tokens/s against other shapes.

    python -m bench.pipeline [--quick] [--seq 1024] [--d-model 256] [--layers 4] [--steps 6]

One job (native model, default d_model 256, 4 layers, 8 query / 4 K/V heads, ffn_mult 4, byte
vocabulary; passkey data; fp32; no activation checkpointing; one thread per rank), a global batch
of M sequences, trained on 2 gloo processes (loopback) in several shapes:

- pp 2 with 1f1b at M = 2, 4, 8 (one stage of layers/2 per rank);
- pp 2 with interleaved_1f1b and zero_bubble at M = 4 (two stages of layers/4 per rank);
- ring 2 (the ring-only shape of the same world) and one process, at M = 4 sequences.

step s      = the median of rank 0's `step_time_s` over the steps after the first (the first
              builds the schedule and allocates the optimizer state);
compute s   = what the busier rank computes per step when nothing waits: M x the forward+backward
              of its layers (embedding and first half; or second half, final norm, head and
              chunked loss) on one microbatch, each rank timing its half while the other times
              its own (both cores busy, as in the schedule's steady state), median of several;
bubble      = 1 - compute / step: the share of the step the busier rank is not computing (idle at
              the schedule's ramp-up and drain, plus send/recv and the optimizer step);
theory      = (P-1) / (M+P-1) for 1f1b; (P-1) / (v M + P-1) with v = 2 virtual stages for
              interleaved_1f1b; zero_bubble's ideal is below interleaved's (its weight gradients
              fill the drain), so none is printed;
ideal step  = compute / (1 - theory): the step the schedule would take with free communication
              and no optimizer step; "step - ideal" is what the run spends beyond it;
fit         = 1f1b's step is M + P - 1 microbatch slots: a line a + b M fitted through the M
              sweep gives the slot as the run pays it (b) and the bubble in slots (a / b, theory
              P - 1), and the bubble again with that slot instead of the compute alone;
tok/s       = M x seq / step s; "vs" is over the reference named in the row, measured in this run.

    python -m bench.pipeline --memory [--quick] [--seq 2048] [--layers 8] [--steps 3]

Per-rank peak memory against the planner (`service.planner.pipeline_rank_bytes`: each pipeline
rank's layers, root, loss and the microbatch-stages its schedule holds), at worlds 2 and 4: pp 2
(1f1b, interleaved_1f1b, zero_bubble, and pp 2 with `pipeline_split: auto`), ring 2; pp 2 x ring
2, pp 4 (even and auto), pp 2 x dp 2, ring 4. Each shape is a `torchrun -m workers.train` run
(the real trainer, one thread per rank) of --steps steps, batch 4 sequences (M = 4 microbatches
of 1 sequence; pp 2 x dp 2: M = 2 per replica):

peak        = each rank's `mem_peak_bytes` (resident set, VmHWM reset per step), the largest over
              the steps after the first;
estimate    = the planner's bytes for that rank's place on the pipeline (every rank of a stage
              slice holds the same; `memory_estimate` without a pipeline); error = estimate /
              peak - 1, per rank, and the worst;
tok/s       = the median of the rank-less `tokens_per_s` over the steps after the first; "vs ring"
              = over the ring-only shape of the same world (ring 2, ring 4) in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from tests.support.dist import run_distributed
from workers.config import JobSpec
from workers.data import build_source
from workers.models import build_model, tokenizer_for
from workers.training.pipeline import StageModule
from workers.training.trainer import run_training


def _spec(
    args: argparse.Namespace,
    m: int,
    *,
    pp: int = 1,
    ring: int = 1,
    schedule: str = "1f1b",
) -> JobSpec:
    """The bubble job: a global batch of M microbatches of one sequence."""
    return JobSpec.model_validate(
        _job(args, "pp-bench", batch=m, m=m, pp=pp, ring=ring, pipeline_schedule=schedule)
    )


def _rank(rank: int, world: int, spec_json: str) -> dict[int, float]:
    """This rank's `step_time_s` per step."""
    torch.set_num_threads(1)
    times: dict[int, float] = {}

    def emit(p: Any) -> None:
        if p.name == "step_time_s" and p.rank in (None, rank):
            times[p.step] = p.value

    run_training(JobSpec.model_validate_json(spec_json), checkpoint_dir=None, emit=emit)
    return times


def _step_time(spec: JobSpec, world: int) -> float:
    """The median step time after the first step, on rank 0 (the rank-less global figure)."""
    if world == 1:
        times = _rank(0, 1, spec.model_dump_json())
    else:
        times = run_distributed(_rank, world, spec.model_dump_json(), timeout=600)[0]
    steps = sorted(times)[1:] or sorted(times)
    return statistics.median(times[s] for s in steps)


def _stage_compute(rank: int, world: int, args: argparse.Namespace, repeats: int) -> float:
    """Forward+backward of one microbatch (1 sequence) through this rank's half of the model
    (rank 0: the first, rank 1: the last; `world` 1 times both in turn), median of `repeats`
    after one warm-up. On 2 ranks both compute at once, as in the schedule's steady state."""
    torch.set_num_threads(1)
    spec = _spec(args, 2, pp=2)
    model = build_model(spec.model, spec.train.seed)
    half = args.layers // 2
    first = StageModule(model, range(half), first=True, last=False)
    last = StageModule(model, range(half, args.layers), first=False, last=True)
    batch = build_source(spec, tokenizer_for(spec)).global_batch(0, 1)
    kw = {"positions": batch.positions.expand(1, -1), "labels": batch.labels}
    kw["weights"] = batch.weights
    grad = torch.randn(1, args.seq, args.d_model)

    def run_first() -> None:
        first(batch.inputs, **kw).backward(grad)

    def run_last() -> None:
        hidden = torch.randn(1, args.seq, args.d_model, requires_grad=True)
        last(hidden, **kw).backward()

    fns = [run_first, run_last] if world == 1 else [(run_first, run_last)[rank]]
    total = 0.0
    for fn in fns:
        fn()
        samples = []
        for _ in range(repeats):
            if world > 1:
                dist.barrier()
            t = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t)
        total += statistics.median(samples)
    return total


def _memory_spec(
    args: argparse.Namespace, *, pp: int = 1, ring: int = 1, dp: int = 1, m: int = 4, **par: Any
) -> dict[str, Any]:
    """The --memory job: batch 4, M microbatches (1 without a pipeline), `par` more parallel
    fields (pipeline_schedule, pipeline_split)."""
    return _job(args, "pp-memory", batch=4, m=m, pp=pp, ring=ring, dp=dp, **par)


def _job(
    args: argparse.Namespace,
    name: str,
    *,
    batch: int,
    m: int,
    pp: int,
    ring: int,
    dp: int = 1,
    **par: Any,
) -> dict[str, Any]:
    """Both benches' job: the model and length from `args`, no checkpoints, evals or verification;
    `par` (pipeline_schedule, pipeline_split) only where there is a pipeline."""
    parallel: dict[str, Any] = {"ring_size": ring, "data_parallel": dp, "layout": "zigzag"}
    if pp > 1:
        parallel |= {"pipeline_size": pp, **par}
    return {
        "name": name,
        "model": {
            "d_model": args.d_model,
            "n_layers": args.layers,
            "n_heads": 8,
            "n_kv_heads": 4,
            "ffn_mult": 4,
            "tie_embeddings": False,
        },
        "data": {"kind": "passkey", "seq_len": args.seq, "key_digits": 3},
        "parallel": parallel,
        "train": {
            "steps": args.steps,
            "batch_size": batch,
            "microbatches": m if pp > 1 else 1,
            "warmup_steps": 0,
        },
        "checkpoint": {"every_steps": 0},
        "eval": {"enabled": False},
        "verify": {"enabled": False},
    }


def _torchrun(spec: dict[str, Any], world: int, steps: int) -> list[dict[str, Any]]:
    """`torchrun -m workers.train` of `spec` on `world` ranks (one thread each): its metric
    points."""
    with tempfile.TemporaryDirectory() as tmp:
        path, out = Path(tmp) / "spec.yaml", Path(tmp) / "m.jsonl"
        path.write_text(yaml.safe_dump(spec))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={world}", "-m", "workers.train", str(path)]
        cmd += ["--steps", str(steps), "--metrics-jsonl", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        return [json.loads(line) for line in out.read_text().splitlines()]


def memory_table(args: argparse.Namespace) -> None:
    """Per-rank peak against the planner, and tokens/s against the ring-only shape."""
    from service.planner import memory_estimate, pipeline_rank_bytes

    auto = {"pipeline_split": "auto"}
    shapes: list[tuple[str, int, dict[str, Any]]] = [
        ("ring 2", 2, {"ring": 2}),
        ("pp 2 1f1b", 2, {"pp": 2}),
        ("pp 2 1f1b, split auto", 2, {"pp": 2, **auto}),
        ("pp 2 interleaved_1f1b", 2, {"pp": 2, "pipeline_schedule": "interleaved_1f1b"}),
        ("pp 2 zero_bubble", 2, {"pp": 2, "pipeline_schedule": "zero_bubble"}),
        ("ring 4", 4, {"ring": 4}),
        ("pp 2 x ring 2", 4, {"pp": 2, "ring": 2}),
        ("pp 2 x dp 2", 4, {"pp": 2, "dp": 2, "m": 2}),
        ("pp 4 1f1b", 4, {"pp": 4}),
        ("pp 4 1f1b, split auto", 4, {"pp": 4, **auto}),
    ]
    print("$ python -m bench.pipeline " + " ".join(sys.argv[1:]))
    print(
        f"model d_model {args.d_model}, {args.layers} layers, 8 q / 4 kv heads, ffn_mult 4; "
        f"seq {args.seq}; batch 4; fp32; one thread per rank (torchrun, gloo); {args.steps} "
        f"steps, peaks and tok/s over steps 2-{args.steps}\n"
    )
    cols = ["shape", "world", "M", "split", "peak MB per rank", "estimate MB per rank"]
    cols += ["error per rank", "worst error", "tok/s", "vs ring"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    ring_rate: dict[int, float] = {}
    t0 = time.time()
    for name, world, kw in shapes:
        _log(f"{name} (world {world})")
        raw = _memory_spec(args, **kw)
        job = JobSpec.model_validate(raw)
        p = job.parallel
        if p.pipeline_size > 1:
            est = memory_estimate(job)
            split = est["pipeline"]["split"]
            raw["parallel"]["pipeline_split"] = split  # as submission stores `auto`
            per_stage = [sum(r.values()) for r in pipeline_rank_bytes(job, split)]
            estimates = [per_stage[r // (world // p.pipeline_size)] for r in range(world)]
        else:
            split = None
            estimates = [memory_estimate(job)["total_bytes"]] * world
        points = _torchrun(raw, world, args.steps)
        later = [q for q in points if q["step"] >= 2]
        peaks = [
            max(q["value"] for q in later if q["name"] == "mem_peak_bytes" and q["rank"] == r)
            for r in range(world)
        ]
        rate = statistics.median(q["value"] for q in later if q["name"] == "tokens_per_s")
        if p.pipeline_size == 1:
            ring_rate[world] = rate
        errors = [e / m - 1 for e, m in zip(estimates, peaks, strict=True)]
        worst = max(errors, key=abs)
        vs = f"{rate / ring_rate[world]:.2f}" if p.pipeline_size > 1 else "-"
        cells = [
            name,
            str(world),
            str(job.train.microbatches) if p.pipeline_size > 1 else "-",
            "/".join(map(str, split)) if split else "-",
            " / ".join(f"{v / 1e6:.0f}" for v in peaks),
            " / ".join(f"{v / 1e6:.0f}" for v in estimates),
            " / ".join(f"{e:+.1%}" for e in errors),
            f"{worst:+.1%}",
            f"{rate:.0f}",
            vs,
        ]
        print("| " + " | ".join(cells) + " |", flush=True)
    print(f"\n({time.time() - t0:.0f} s)")


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares line through (M, step s): (slope, intercept)."""
    xs, ys = [float(m) for m, _ in points], [s for _, s in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return slope, my - slope * mx


def _log(msg: str) -> None:
    print(f"[bench.pipeline] {msg}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="seq 512, 4 steps: a smoke run")
    ap.add_argument(
        "--memory",
        action="store_true",
        help="per-rank peak memory against the planner at worlds 2 and 4 (default here: seq "
        "2048, 8 layers, 3 steps; --quick: seq 1024)",
    )
    args = ap.parse_args()
    if args.memory:
        args.seq = args.seq or (1024 if args.quick else 2048)
        args.layers, args.steps = args.layers or 8, args.steps or 3
        memory_table(args)
        return
    args.seq, args.layers, args.steps = args.seq or 1024, args.layers or 4, args.steps or 6
    if args.quick:
        args.seq, args.steps = 512, 4
    torch.set_num_threads(1)
    p = 2
    print("$ python -m bench.pipeline " + " ".join(sys.argv[1:]))
    print(
        f"model d_model {args.d_model}, {args.layers} layers, 8 q / 4 kv heads, ffn_mult 4; "
        f"seq {args.seq}; microbatch 1 sequence; fp32; one thread per rank; world 2 (gloo); "
        f"{args.steps} steps, median of steps 2-{args.steps}\n"
    )
    t0 = time.time()
    _log("stage compute, one process")
    alone = _stage_compute(0, 1, args, 5)
    _log("stage compute, both ranks at once")
    first_s, last_s = run_distributed(_stage_compute, p, args, 5, timeout=600)
    busy = max(first_s, last_s)
    print(
        f"one microbatch forward+backward, both ranks computing at once: first stage "
        f"{first_s * 1e3:.0f} ms, last stage {last_s * 1e3:.0f} ms (the busier one is the "
        f"compute reference); both halves in turn on one process alone: {alone * 1e3:.0f} ms\n"
    )
    cols = [
        "shape",
        "M",
        "step s",
        "compute s",
        "bubble",
        "theory",
        "bubble / theory",
        "ideal step s",
        "step - ideal s",
        "tok/s",
        "vs",
    ]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    rates: dict[str, float] = {}

    def row(name: str, m: int, step: float, theory: float | None, ref: str | None) -> None:
        rate = m * args.seq / step
        rates[name] = rate
        compute = m * busy
        cells = [name, str(m), f"{step:.3f}"]
        if theory is None and name.startswith("pp"):
            cells += [f"{compute:.3f}", f"{1 - compute / step:.2f}", "-", "-", "-", "-"]
        elif theory is not None:
            bubble, ideal = 1 - compute / step, compute / (1 - theory)
            cells += [f"{compute:.3f}", f"{bubble:.2f}", f"{theory:.2f}", f"{bubble / theory:.2f}"]
            cells += [f"{ideal:.3f}", f"{step - ideal:.3f}"]
        else:
            cells += ["-"] * 6
        vs = f"{rate / rates[ref]:.2f} of {ref}" if ref else "-"
        print("| " + " | ".join([*cells, f"{rate:.0f}", vs]) + " |", flush=True)

    sweep: list[tuple[int, float]] = []
    for m in (2, 4, 8):
        _log(f"pp 2, 1f1b, M {m}")
        step = _step_time(_spec(args, m, pp=p), p)
        sweep.append((m, step))
        row(f"pp 2 1f1b M{m}", m, step, (p - 1) / (m + p - 1), None)
    for schedule in ("interleaved_1f1b", "zero_bubble"):
        _log(f"pp 2, {schedule}, M 4")
        step = _step_time(_spec(args, 4, pp=p, schedule=schedule), p)
        theory = (p - 1) / (2 * 4 + p - 1) if schedule == "interleaved_1f1b" else None
        row(f"pp 2 {schedule}", 4, step, theory, "pp 2 1f1b M4")
    _log("ring 2, batch 4")
    row("ring 2", 4, _step_time(_spec(args, 4, ring=2), 2), None, "pp 2 1f1b M4")
    _log("one process, batch 4")
    row("one process", 4, _step_time(_spec(args, 4), 1), None, "pp 2 1f1b M4")
    # 1f1b's step is (M + P - 1) microbatch slots: a line in M whose slope is the slot as the run
    # pays it (compute plus each microbatch's send/recv and schedule work) and whose intercept,
    # in slots, is the bubble's P - 1 (plus the optimizer step)
    slope, intercept = _fit(sweep)
    print(
        f"\n1f1b steps fitted as a + b M: b = {slope:.3f} s per microbatch slot "
        f"({slope / busy:.2f} x the compute alone), a = {intercept:.3f} s = "
        f"{intercept / slope:.2f} slots (theory: P - 1 = {p - 1}, plus the optimizer step)"
    )
    for m, step in sweep:
        print(
            f"  M {m}: bubble with the fitted slot 1 - M b / step = {1 - m * slope / step:.2f} "
            f"(theory {(p - 1) / (m + p - 1):.2f})"
        )
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
