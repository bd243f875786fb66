"""`ringtrain eval`: a RULER-style long-context evaluation of a model directory or a job's
exported model, here, over a ring of `--ring-size` local processes (`python -m workers.evals`
under torchrun: ring prefill, pass-Q decoding), or with `--on-cluster` on the server's cluster
(`POST /v1/evals`), printing the same report."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from api.cli.common import client, console, out

SUITES = ("ruler",)


def _model_dir(args: argparse.Namespace, scratch: Path) -> Path:
    """MODEL_DIR as given, or a job's exported model pulled from the server (checksums checked)."""
    given = Path(args.model)
    if given.is_dir():
        return given
    with client(args) as c:
        c.pull(args.model, scratch)
    return scratch


def cmd_eval(args: argparse.Namespace) -> int:
    if args.ring_size < 1:
        print("error: --ring-size must be >= 1", file=sys.stderr)
        return 2
    if args.on_cluster:
        return _on_cluster(args)
    with tempfile.TemporaryDirectory(prefix="ringtrain-eval-") as tmp:
        model = _model_dir(args, Path(tmp))
        launch = (
            [sys.executable, "-m", "workers.evals"]
            if args.ring_size == 1
            else [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={args.ring_size}",
                "-m",
                "workers.evals",
            ]
        )
        cmd = [*launch, str(model), "--lengths", args.lengths, "--samples", str(args.samples)]
        cmd += ["--seed", str(args.seed)]
        if args.tasks:
            cmd += ["--tasks", args.tasks]
        if args.samples_out:
            cmd += ["--samples-out", str(Path(args.samples_out).resolve())]
        # progress lines go straight to the terminal (stderr); the report is the last stdout line
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        print(f"error: the evaluation failed (exit {done.returncode}; see above)", file=sys.stderr)
        return 1
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    out(args, report, lambda: _human(report))
    return 0


def _on_cluster(args: argparse.Namespace) -> int:
    """The evaluation as a server resource: a path (or an existing directory) is sent as `model`,
    resolved here (the server must see the same path, e.g. shared storage), anything else as
    `job`; then the eval is polled until it ends, progress on stderr."""
    if args.samples_out:
        print("error: --samples-out needs a local run (drop --on-cluster)", file=sys.stderr)
        return 2
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        print(f"error: --lengths {args.lengths!r}: comma-separated integers", file=sys.stderr)
        return 2
    given = Path(args.model)
    as_path = given.is_dir() or "/" in args.model or args.model.startswith(".")
    where = {"model": str(given.resolve())} if as_path else {"job": args.model}
    tasks = [t for t in args.tasks.split(",") if t] if args.tasks else None
    with client(args) as c:
        ev = c.create_eval(
            lengths,
            samples=args.samples,
            ring_size=args.ring_size,
            seed=args.seed,
            tasks=tasks,
            suite=args.suite,
            **where,
        )
        print(f"eval {ev['id']} {ev['state']} on the cluster", file=sys.stderr, flush=True)
        seen = None
        while ev["state"] not in ("SUCCEEDED", "FAILED"):
            time.sleep(args.poll_s)
            ev = c.get_eval(ev["id"])
            p = ev.get("progress") or {}
            now = (ev["state"], p.get("samples_done"))
            if now != seen:
                seen = now
                done, total = p.get("samples_done", 0), p.get("samples_total")
                print(f"[eval {ev['id']}] {ev['state']} {done}/{total} samples", file=sys.stderr)
    if ev["state"] == "FAILED":
        print(f"error: eval {ev['id']} failed: {ev['error']}", file=sys.stderr)
        return 1
    report: dict[str, Any] = ev["result"]
    out(args, report, lambda: _human(report))
    return 0


def _human(report: dict[str, Any]) -> None:
    con = console()
    lengths = list(report["by_length"])
    width = max(len(t) for t in report["tasks"])
    con.print(f"{'task'.ljust(width)}  " + "  ".join(f"{n:>7}" for n in lengths))
    for task, by in report["tasks"].items():
        cells = "  ".join(f"{by[n]:7.2f}" if n in by else " " * 7 for n in lengths)
        con.print(f"{task.ljust(width)}  {cells}")
    mean = "  ".join(f"{report['by_length'][n]:7.2f}" for n in lengths)
    con.print(f"{'mean'.ljust(width)}  {mean}")
    con.print(
        f"effective length: {report['effective_length']} "
        f"(longest length scoring >= {report['threshold']})"
    )


def add_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    e = sub.add_parser(
        "eval",
        parents=[common],
        help="RULER-style long-context evaluation of a model directory or a job's model",
    )
    e.add_argument("model", metavar="MODEL_DIR|JOB_ID")
    e.add_argument("--suite", choices=SUITES, default="ruler")
    e.add_argument("--lengths", required=True, help="comma-separated prompt lengths in tokens")
    e.add_argument("--samples", type=int, default=4, help="samples per task and length")
    e.add_argument("--ring-size", type=int, default=1, help="local processes the prompt spans")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--tasks", help="comma-separated tasks (default: every task)")
    e.add_argument("--samples-out", help="write one JSON line per sample to this file")
    e.add_argument(
        "--on-cluster",
        action="store_true",
        help="run on the server's cluster (POST /v1/evals) instead of here; MODEL_DIR must be a "
        "path the cluster sees inside the server's data roots",
    )
    e.add_argument("--poll-s", type=float, default=1.0, help=argparse.SUPPRESS)
    e.set_defaults(fn=cmd_eval)
