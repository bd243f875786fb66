"""The job commands: submit (and follow), list, status, cancel, logs, plan, pull."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from api.cli.catalog_view import MetricCatalogView, format_value
from api.cli.common import client, console, out
from api.client import Client
from api.routers.metrics import MetricInfo
from api.schemas import JobOut
from workers.config import MemoryKnobs


def _list_header(view: MetricCatalogView) -> str:
    cols = "".join(f" {m.name.upper():>{_col_width(m)}}" for m in view.marked("column"))
    return f"{'ID':<14} {'STATE':<12} {'STEP':>13}{cols}  NAME"


def _col_width(m: MetricInfo) -> int:
    return max(9, len(m.name))


def _fmt_job_line(j: JobOut, view: MetricCatalogView) -> str:
    cols = ""
    for m in view.marked("column"):
        latest = j.latest_metrics.get(m.name)
        cols += f" {format_value(m, latest.value) if latest else '-':>{_col_width(m)}}"
    state = (
        f"{j.state.value} #{j.queue_position}" if j.queue_position is not None else j.state.value
    )
    line = f"{j.id:<14} {state:<12} {j.step:>6}/{j.total_steps:<6}{cols}  {j.name}"
    return line + (f"\n{'':<14} waits: {j.queue_reason}" if j.queue_reason else "")


def cmd_submit(args: argparse.Namespace) -> int:
    with client(args) as c:
        spec: Any = sys.stdin.read() if args.spec == "-" else Path(args.spec)
        if isinstance(spec, Path) and not spec.is_file():
            raise SystemExit(f"error: no such spec file: {spec}")
        job = c.submit(spec)
        if not args.follow:
            out(args, job, lambda: print(f"submitted {job.id} ({job.name}): {job.state.value}"))
            return 0
        if not args.json:
            print(f"submitted {job.id} ({job.name})")
        return follow(c, job.id, json_lines=args.json)


def follow(c: Client, job_id: str, json_lines: bool = False) -> int:
    """Show a live progress bar with the catalog's progress metrics (loss, tokens/s) until the job
    ends; 0 iff it SUCCEEDED."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    job = c.get_job(job_id)
    view = MetricCatalogView.fetch(c)
    shown = {m.name: m for m in view.marked("progress")}
    values: dict[str, str] = {name: "-" for name in shown}
    final_state = job.state.value
    con = console()
    with Progress(
        TextColumn("[bold]{task.fields[state]:<9}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[metrics]}"),
        TimeElapsedColumn(),
        console=con,
        disable=json_lines,
        transient=False,
    ) as bar:

        def line() -> str:
            return "  ".join(f"{name} {text}" for name, text in values.items())

        task = bar.add_task("train", total=job.total_steps, state=job.state.value, metrics=line())
        for ev in c.events(job_id):
            if json_lines:
                print(json.dumps({"event": ev.event, "id": ev.id, "data": ev.data}), flush=True)
            if ev.event == "metric" and ev.data.get("rank") is None:
                name = ev.data["name"]
                # a global point at step k: k steps are done
                bar.update(task, completed=min(ev.data["step"], job.total_steps))
                if name in shown:
                    values[name] = view.text(name, ev.data["value"])
                    bar.update(task, metrics=line())
            elif ev.event == "state":
                bar.update(task, state=ev.data["to"])
                if ev.data["to"] == "RETRYING":
                    bar.console.print(f"[yellow]retrying: {ev.data.get('reason', '')}[/yellow]")
            elif ev.event == "log" and not json_lines:
                bar.console.print(f"[dim]{ev.data.get('source')}: {ev.data.get('line')}[/dim]")
            elif ev.event == "end":
                final_state = ev.data["state"]
    job = c.get_job(job_id)
    if not json_lines:
        color = "green" if final_state == "SUCCEEDED" else "red"
        final = view.summary(job.latest_metrics, "progress").replace("  ", ", ")
        con.print(
            f"[{color}]job {job_id} {final_state}[/{color}] at step {job.step}/{job.total_steps}"
            + (f", final {final}" if final else "")
        )
        if job.error:
            con.print(f"[red]error:[/red] {job.error}")
            con.print(f"see the logs: ringtrain logs {job_id}")
    return 0 if final_state == "SUCCEEDED" else 1


def cmd_list(args: argparse.Namespace) -> int:
    with client(args) as c:
        page = c.list_jobs(
            state=args.state,
            limit=args.limit,
            offset=args.offset,
            verification=args.verification,
        )

        def human() -> None:
            if not page.jobs and (args.state or args.verification):
                print("no jobs match (drop --state / --verification to see all of them)")
                return
            if not page.jobs:
                print("no jobs (submit one: ringtrain submit examples/passkey.yaml)")
                return
            view = MetricCatalogView.fetch(c)
            print(_list_header(view))
            for j in page.jobs:
                print(_fmt_job_line(j, view))
            if page.total > page.offset + len(page.jobs):
                print(
                    f"... {page.total} jobs in all; "
                    f"see more with --offset {page.offset + len(page.jobs)}"
                )

        out(args, page, human)
    return 0


def _shape(par: dict[str, Any]) -> str:
    return " x ".join(
        f"{name} {par.get(key, 1)}"
        for name, key in (
            ("dp", "data_parallel"),
            ("ring", "ring_size"),
            ("ulysses", "ulysses_size"),
            ("tensor", "tensor_size"),
        )
    )


def shape_lines(spec: dict[str, Any]) -> list[str]:
    """The stored parallel shape and memory knobs (what `ring_size: auto` was resolved to)."""
    par, train = spec.get("parallel", {}), spec.get("train", {})
    shape = _shape(par)
    seq = spec.get("data", {}).get("seq_len", "?")
    knobs = MemoryKnobs.read(train).describe()
    return [
        f"  parallel  {shape} ({par.get('layout', '?')}), seq_len {seq}",
        f"  memory    {knobs}",
    ]


def stage_lines(j: JobOut) -> list[str]:
    """A job's stages, one line each: steps, length, shape and state (none without stages)."""
    if not j.stages:
        return []
    now = j.stages[j.stage or 0]
    lines = [f"  stages    {len(j.stages)}, now {now.index + 1}: {now.name}"]
    for st in j.stages:
        lines.append(
            f"    {st.index + 1:<2} {st.name[:16]:<16} steps {st.start_step + 1}-{st.end_step:<6} "
            f"seq_len {st.seq_len:<7} {_shape(st.parallel)} ({st.world_size} ranks)  {st.state}"
        )
    return lines


def elastic_line(c: Client, j: JobOut) -> list[str]:
    """An elastic job's shape over time, from its `world_size` series: one run of steps per shape
    ("4 -> 2 -> 4 ranks (steps 1-6, 7-20, 21-60)"); none for a job without elastic."""
    if not j.spec.get("elastic", {}).get("enabled"):
        return []
    runs: list[tuple[int, int, int]] = []  # (ranks, first step, last step)
    for p in sorted(c.iter_metrics(j.id, names=["world_size"]), key=lambda p: p.step):
        ranks = int(p.value or 0)
        if runs and runs[-1][0] == ranks:
            runs[-1] = (ranks, runs[-1][1], p.step)
        else:
            runs.append((ranks, p.step, p.step))
    if not runs:
        return ["  elastic   on, no step yet"]
    shapes = " -> ".join(str(r) for r, _, _ in runs)
    spans = ", ".join(f"{a}-{b}" if a != b else f"{a}" for _, a, b in runs)
    return [f"  elastic   {shapes} ranks (steps {spans})"]


def verification_line(j: JobOut) -> str:
    """The pre-training check of the job's math, in one line."""
    v = j.verification
    if v is None:
        return "disabled" if j.spec.get("verify", {}).get("enabled") is False else "not yet"
    err = "non-finite" if v.max_rel_err is None else f"{v.max_rel_err:.2e}"
    tol = "?" if v.tolerance is None else f"{v.tolerance:.0e}"
    fp32 = "" if v.fp32_rel_err is None else f", {v.fp32_rel_err:.2e} against fp32"
    took = "" if v.seconds is None else f", {v.seconds:.2f} s"
    verdict = f"passed: max rel err {err} <= {tol}"
    if not v.passed:
        verdict = f"FAILED: max rel err {err} > {tol}"
    return f"{verdict} ({v.tokens} tokens{fp32}{took})"


def cmd_status(args: argparse.Namespace) -> int:
    with client(args) as c:
        j = c.get_job(args.id)

        def human() -> None:
            print(f"job {j.id}  {j.name}  ({j.owner})")
            print(
                f"  state     {j.state.value}"
                + ("  (cancel requested)" if j.cancel_requested and not j.state.terminal else "")
            )
            if j.queue_position is not None:
                print(f"  queue     position {j.queue_position}: {j.queue_reason or 'waiting'}")
            print(
                f"  progress  step {j.step}/{j.total_steps}   restarts {j.restarts}   "
                f"priority {j.priority}"
            )
            for line in shape_lines(j.spec) + stage_lines(j) + elastic_line(c, j):
                print(line)
            print(
                f"  created   {j.created_at:%Y-%m-%d %H:%M:%S} UTC   "
                f"updated {j.updated_at:%H:%M:%S}"
            )
            print(f"  verified  {verification_line(j)}")
            for line in MetricCatalogView.fetch(c).status_lines(j.latest_metrics):
                print(line)
            for p in j.placement:
                print(f"  rank {p.rank:<3} {p.node_id[:16]:<16} {p.device}")
            if j.error:
                print(f"  error     {j.error}")
            print("  history")
            for t in j.transitions or []:
                print(
                    f"    {time.strftime('%H:%M:%S', time.gmtime(t.time))}  "
                    f"{t.to_state.value:<10} {t.reason}"
                )

        out(args, j, human)
        return 1 if j.state.value == "FAILED" and not args.json else 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with client(args) as c:
        j = c.cancel(args.id)
        out(args, j, lambda: print(f"cancel requested for {j.id}: now {j.state.value}"))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    with client(args) as c:
        page = c.logs(args.id, driver=not args.no_driver)

        def human() -> None:
            for line in page.lines:
                print(
                    f"{time.strftime('%H:%M:%S', time.gmtime(line.time))} "
                    f"[{line.source}] {line.line}"
                )
            if page.driver_log:
                print("---- Ray driver log (tail) ----")
                print(page.driver_log, end="" if page.driver_log.endswith("\n") else "\n")
            if not page.lines and not page.driver_log:
                print("no logs yet")

        out(args, page, human)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    with client(args) as c:
        spec: Any = sys.stdin.read() if args.spec == "-" else Path(args.spec)
        p = c.plan(spec, fit=args.fit, memory_per_rank_gib=args.memory_per_rank)

        def human() -> None:
            mem = p.memory
            if p.fit is not None:
                f = p.fit
                print(
                    f"fit: ring_size {f.ring_size} x ulysses_size {f.ulysses_size}"
                    + (f" x tensor_size {f.tensor_size}" if f.tensor_size > 1 else "")
                    + ", knobs "
                    f"{f.knobs_name} ({MemoryKnobs.read(f.knobs).describe()}): "
                    f"{f.estimate_bytes / 2**30:.2f} of {f.memory_per_rank_gib:.2f} GiB per rank "
                    f"({f.budget_source})"
                )
            print(
                f"spec {p.spec['name']}: {'OK' if p.valid else 'CANNOT RUN'}; "
                f"{p.world_size} rank(s) on {p.accelerator}, "
                f"bundle {p.bundle}, strategy {p.strategy}"
            )
            if p.placement:
                print(
                    f"placement: {p.nodes_used} node(s), "
                    f"{p.node_crossings} ring edge(s) cross nodes"
                )
                for s in p.placement:
                    print(f"  rank {s.rank:<4} ring {s.ring:<3} {s.node_id[:20]:<20} {s.device}")
            gib = 2**30
            print(
                f"memory per rank ~ {mem['total_bytes'] / gib:.2f} GiB "
                f"({mem['param_count']:,} params, {mem['local_tokens']:,} local tokens)"
            )
            for k, v in mem["bytes"].items():
                print(f"  {k:<13} {v / gib:8.3f} GiB")
            print(f"  formula: {mem['formula']}")
            for w in p.warnings:
                print(f"warning: {w}")

        out(args, p, human)
        return 0 if p.valid else 1


def cmd_pull(args: argparse.Namespace) -> int:
    """Download a job's exported model with a progress bar; every file is checked against its
    SHA-256."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from api.pull import ChecksumMismatch

    with client(args) as c:
        listing = c.artifacts(args.id)
        con = console()
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=con,
            disable=args.json,
        ) as bar:
            tasks = {f.name: bar.add_task(f.name, total=f.size) for f in listing.files}
            try:
                paths = c.pull(
                    args.id, args.dir, lambda name, done, _: bar.update(tasks[name], completed=done)
                )
            except ChecksumMismatch as e:
                con.print(f"[red]error:[/red] {e}")
                return 1
        dest = Path(args.dir).expanduser()
        out(
            args,
            [str(p) for p in paths],
            lambda: con.print(
                f"[green]{len(paths)} files ({listing.total_bytes:,} bytes) "
                f"verified in {dest}[/green]\n"
                f'AutoModelForCausalLM.from_pretrained("{dest}")'
            ),
        )
    return 0


def add_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """The job commands, each with the client options `common`."""
    s = sub.add_parser(
        "submit", parents=[common], help="submit a job spec (YAML/JSON file, or - for stdin)"
    )
    s.add_argument("spec")
    s.add_argument(
        "--follow", "-f", action="store_true", help="show live progress until the job ends"
    )
    s.set_defaults(fn=cmd_submit)
    s = sub.add_parser("list", parents=[common], help="list your jobs, newest first")
    s.add_argument("--state", action="append", help="only this state (repeatable)")
    s.add_argument("--limit", type=int, default=20)
    s.add_argument("--offset", type=int, default=0)
    s.add_argument(
        "--verification",
        choices=["passed", "failed"],
        help="only jobs whose pre-training verification passed / failed",
    )
    s.set_defaults(fn=cmd_list)
    for name, fn, helptext in (
        ("status", cmd_status, "show a job"),
        ("cancel", cmd_cancel, "cancel a job"),
        ("logs", cmd_logs, "show a job's logs"),
    ):
        s = sub.add_parser(name, parents=[common], help=helptext)
        s.add_argument("id")
        if name == "logs":
            s.add_argument("--no-driver", action="store_true", help="skip Ray's driver log")
        s.set_defaults(fn=fn)
    s = sub.add_parser(
        "pull", parents=[common], help="download a job's exported model, checksums verified"
    )
    s.add_argument("id")
    s.add_argument("dir")
    s.set_defaults(fn=cmd_pull)
    s = sub.add_parser("plan", parents=[common], help="dry-run a spec: validity, placement, memory")
    s.add_argument("spec")
    s.add_argument(
        "--fit",
        action="store_true",
        help="choose the smallest ring x Ulysses and the cheapest memory knobs that fit",
    )
    s.add_argument(
        "--memory-per-rank",
        type=float,
        metavar="GIB",
        help="the budget per rank for --fit (default: the devices' memory, when the cluster "
        "reports it)",
    )
    s.set_defaults(fn=cmd_plan)
