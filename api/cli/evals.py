"""`ringtrain eval`: a RULER-style long-context evaluation of a model directory or a job's
exported model, here, over a ring of `--ring-size` local processes (`python -m workers.evals`
under torchrun: ring prefill, pass-Q decoding)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
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
    e.set_defaults(fn=cmd_eval)
