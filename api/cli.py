"""The `ringtrain` command line: serve, demo, db upgrade, submit, list, status, cancel, logs, plan,
pull, data prepare.

Human output by default, `--json` for scripts. The server is `--url` / `RINGTRAIN_URL`
(default http://127.0.0.1:8000); the token is `--token` / `RINGTRAIN_TOKEN` / `~/.ringtrain/token`.
Exit status: 0 ok, 1 the server said no (or the followed job did not succeed), 2 usage, 3 unreachable.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import httpx
from pydantic import TypeAdapter

from api.client import ApiError, Client, resolve_url
from api.routers.metrics import MetricCatalog, MetricInfo
from api.schemas import JobOut, LatestMetric

if TYPE_CHECKING:  # rich and the server side load only for the commands that use them
    from rich.console import Console

    from service.settings import Settings

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _console() -> Console:
    from rich.console import Console

    return Console(highlight=False)


def _out(args: argparse.Namespace, obj: object, human: Callable[[], None]) -> None:
    if args.json:
        print(
            json.dumps(
                TypeAdapter(type(obj)).dump_python(obj, mode="json", by_alias=True), indent=2
            )
        )
    else:
        human()


def _client(args: argparse.Namespace) -> Client:
    return Client(args.url, args.token)


# ---- serve / demo ---------------------------------------------------------------------------------
def _settings(args: argparse.Namespace) -> Settings:
    from service.settings import Settings

    over = {
        k: v
        for k, v in {
            "host": args.host,
            "port": args.port,
            "database_url": args.database_url,
            "ray_address": args.ray_address,
            "migrate_on_start": False if getattr(args, "no_migrate", False) else None,
        }.items()
        if v is not None
    }
    return Settings(**over)


def _run_server(settings: Settings, on_ready: Callable[[Settings], None] | None = None) -> int:
    import uvicorn

    from api.app import create_app
    from service.db import upgrade

    if settings.migrate_on_start:  # else a step of its own (`ringtrain db upgrade`, init container)
        upgrade(settings.database_url)  # the one schema upgrade, before the app (which checks it)
    head = None
    launcher = None
    con = _console()
    # SIGTERM (systemd, Docker, Kubernetes) ends like Ctrl-C: uvicorn shuts down, then re-raises the signal it
    # caught; with this handler that is an exception, so the `finally` below still stops the local Ray head.
    signal.signal(signal.SIGTERM, _terminated)
    try:
        if not settings.ray_address and not settings.kuberay_rayjob_template:
            from service.local_ray import LocalRayHead
            from service.ray_jobs import RayJobLauncher

            con.print("[dim]starting a local Ray head (no RINGTRAIN_RAY_ADDRESS given)...[/dim]")
            head = LocalRayHead()
            info = head.start()
            settings.ray_address = info.jobs_url
            launcher = RayJobLauncher(info.jobs_url, auth_token=info.auth_token)
            con.print(f"[dim]local Ray head up: {info.jobs_url}[/dim]")
        app = create_app(settings, launcher)
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                host=settings.host,
                port=settings.port,
                access_log=False,
                log_level="warning",
                timeout_graceful_shutdown=5,
            )
        )
        if on_ready is not None:

            def watch() -> None:
                while not server.started and not server.should_exit:
                    time.sleep(0.05)
                if server.started:
                    on_ready(settings)

            threading.Thread(target=watch, daemon=True).start()
        con.print(
            f"ringtrain serving on [bold]http://{settings.host}:{settings.port}[/bold] "
            f"(API docs at /docs); Ctrl-C to stop"
        )
        server.run()
        return 0
    finally:
        if head is not None:
            con.print("[dim]stopping the local Ray head...[/dim]")
            head.stop()


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    """Bring the database to the newest schema (what `serve` and `demo` do before starting)."""
    from service.db import upgrade

    settings = _settings(args)
    revision = upgrade(settings.database_url)
    print(f"database schema at revision {revision}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    return _run_server(_settings(args))


def cmd_demo(args: argparse.Namespace) -> int:
    settings = _settings(args)
    spec = Path(args.spec) if args.spec else EXAMPLES / "passkey.yaml"

    def ready(s: Settings) -> None:
        from service.settings import ensure_tokens

        token = next(iter(ensure_tokens(s, announce=False)))
        url = f"http://{'127.0.0.1' if s.host in ('0.0.0.0', '::') else s.host}:{s.port}"
        try:
            with Client(url, token) as c:
                job = c.submit(spec)
        except Exception as e:
            _console().print(f"[red]demo: could not submit {spec}: {e}[/red]")
            return
        con = _console()
        con.print(f"\n[bold green]demo job {job.id} submitted[/bold green] ({spec.name})")
        con.print(f"  dashboard: [bold]{url}/[/bold]  (job {job.id})")
        con.print(f"  token:     {token}")
        con.print(
            f"  watch:     RINGTRAIN_URL={url} ringtrain status {job.id}   (or ringtrain logs {job.id})\n",
            soft_wrap=True,
        )
        # The request log would bury the progress bar; warnings and errors still show.
        logging.getLogger("ringtrain").setLevel(logging.WARNING)
        try:
            with Client(url, token) as c:
                follow(c, job.id)
        except Exception as e:  # the service keeps running; the dashboard still shows the job
            con.print(f"[yellow]demo: stopped following {job.id}: {e}[/yellow]")
        con.print(f"the service keeps running at [bold]{url}/[/bold]; Ctrl-C to stop")

    return _run_server(settings, on_ready=ready)


# ---- metrics, as the catalog says to show them ---------------------------------------------
SI = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
BINARY = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))
SELF_UNIT = ("si", "bytes", "seconds", "percent")  # formats whose text already carries the unit


def format_value(info: MetricInfo | None, value: float | None) -> str:
    """One value as the catalog's format says (the dashboard's `metrics.js` writes the same)."""
    if value is None or value != value:  # None or NaN (the store keeps non-finite values as null)
        return "nan"
    fmt, digits = (info.format, info.digits) if info is not None else ("num", 4)
    if fmt == "fixed":
        return f"{value:.{digits}f}"
    if fmt == "exp":
        return f"{value:.{digits}e}"
    if fmt == "percent":
        return f"{value * 100:.1f}".removesuffix(".0") + "%"
    if fmt == "seconds":
        return f"{value * 1000:.3g} ms" if abs(value) < 1 else f"{value:.3g} s"
    if fmt in ("si", "bytes"):
        steps = SI if fmt == "si" else BINARY
        for size, suffix in steps:
            if abs(value) >= size:
                text = f"{value / size:.2f}".rstrip("0").rstrip(".")
                return f"{text}{suffix}" if fmt == "si" else f"{text} {suffix}"
        return f"{value:.3g}" if fmt == "si" else f"{value:.0f} B"
    return f"{value:.{digits}g}"


class MetricCatalogView:
    """The server's metric catalog, for printing: which entry a name belongs to, and its text."""

    def __init__(self, catalog: MetricCatalog) -> None:
        self.metrics = catalog.metrics
        # a name's entry is its exact one, else the first family that matches (as on the server)
        ordered = sorted(catalog.metrics, key=lambda m: bool(m.fields))
        self._tests = [(m, re.compile(m.regex)) for m in ordered]

    @classmethod
    def fetch(cls, c: Client) -> MetricCatalogView:
        """The server's catalog; this package's own where the server predates the route (404)."""
        try:
            return cls(c.metric_catalog())
        except ApiError as e:
            if e.status != 404:
                raise
            from workers.metrics import catalog_json

            return cls(MetricCatalog.model_validate(catalog_json()))

    def lookup(self, name: str) -> tuple[MetricInfo | None, list[str]]:
        """(entry, field values) of a metric name; (None, []) for a name the catalog lacks."""
        for info, test in self._tests:
            m = test.match(name)
            if m is not None:
                return info, list(m.groups())
        return None, []

    def text(self, name: str, value: float | None) -> str:
        """`value` with its unit where the format does not already write one."""
        info, _ = self.lookup(name)
        out = format_value(info, value)
        if info is not None and info.unit not in ("", "fraction") and info.format not in SELF_UNIT:
            out += f" {info.unit}"
        return out

    def marked(self, flag: str) -> list[MetricInfo]:
        """The entries with `column` or `progress` set, in catalog order."""
        return [m for m in self.metrics if getattr(m, flag)]

    def summary(self, latest: dict[str, LatestMetric], flag: str) -> str:
        """`loss 2.1000  tokens_per_s 1.23k`: the latest value of each entry marked `flag`."""
        shown = [m.name for m in self.marked(flag) if m.name in latest]
        return "  ".join(f"{name} {self.text(name, latest[name].value)}" for name in shown)

    def status_lines(self, latest: dict[str, LatestMetric]) -> list[str]:
        """A job's latest metrics in catalog order: one line per name, a table per grid family."""
        by_entry: dict[int, list[tuple[str, list[str]]]] = {}
        unknown: list[str] = []
        for name in latest:
            info, values = self.lookup(name)
            if info is None:
                unknown.append(name)
            else:
                by_entry.setdefault(self.metrics.index(info), []).append((name, values))
        lines: list[str] = []
        for i, members in sorted(by_entry.items()):
            info = self.metrics[i]
            if info.view == "grid":
                lines += self._grid(info, members, latest)
                continue
            for name, _ in sorted(members, key=lambda nv: [_natural(v) for v in nv[1]]):
                m = latest[name]
                lines.append(f"  {name:<18} {self.text(name, m.value):<18} (step {m.step})")
        for name in sorted(unknown):
            point = latest[name]
            lines.append(f"  {name:<18} {self.text(name, point.value):<18} (step {point.step})")
        return lines

    @staticmethod
    def _grid(
        info: MetricInfo,
        members: list[tuple[str, list[str]]],
        latest: dict[str, LatestMetric],
    ) -> list[str]:
        """A grid family's latest values as a table, rows and columns as the catalog names them."""
        if info.grid is None:
            return []
        row_at, col_at = info.fields.index(info.grid.rows), info.fields.index(info.grid.columns)
        cells = {(v[row_at], v[col_at]): latest[name] for name, v in members}
        rows = sorted({r for r, _ in cells}, key=_natural)
        cols = sorted({c for _, c in cells}, key=_natural)
        width = max(7, *(len(c) for c in cols))
        step = max(m.step for m in cells.values())
        corner = f"{info.grid.rows} \\ {info.grid.columns}"
        out = [f"  {info.title} (step {step})"]
        out.append(f"    {corner:>12} " + " ".join(f"{c:>{width}}" for c in cols))
        for r in rows:
            vals = [format_value(info, cells[r, c].value) if (r, c) in cells else "-" for c in cols]
            out.append(f"    {r:>12} " + " ".join(f"{v:>{width}}" for v in vals))
        return out


_LEADING_NUMBER = re.compile(r"[-+]?\d+(\.\d*)?([eE][-+]?\d+)?")


def _natural(text: str) -> tuple[int, float, str]:
    """Values that start with a number by that number, before any other text: len=1024 after
    len=256, and the position bucket 128-256 after 64-128 (not after 1024-2048)."""
    m = _LEADING_NUMBER.match(text)
    if m is None:
        return (1, 0.0, text)
    return (0, float(m.group()), text)


# ---- job commands ---------------------------------------------------------------------------------
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
    with _client(args) as c:
        spec: Any = sys.stdin.read() if args.spec == "-" else Path(args.spec)
        if isinstance(spec, Path) and not spec.is_file():
            raise SystemExit(f"error: no such spec file: {spec}")
        job = c.submit(spec)
        if not args.follow:
            _out(args, job, lambda: print(f"submitted {job.id} ({job.name}): {job.state.value}"))
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
    con = _console()
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
    with _client(args) as c:
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
                    f"... {page.total} jobs in all; see more with --offset {page.offset + len(page.jobs)}"
                )

        _out(args, page, human)
    return 0


def shape_lines(spec: dict[str, Any]) -> list[str]:
    """The stored parallel shape and memory knobs (what `ring_size: auto` was resolved to)."""
    par, train = spec.get("parallel", {}), spec.get("train", {})
    shape = " x ".join(
        f"{name} {par.get(key, 1)}"
        for name, key in (
            ("dp", "data_parallel"),
            ("ring", "ring_size"),
            ("ulysses", "ulysses_size"),
            ("tensor", "tensor_size"),
        )
    )
    seq = spec.get("data", {}).get("seq_len", "?")
    knobs = (
        f"checkpointing {train.get('activation_checkpointing', 'none')}, "
        f"tiled MLP {train.get('tiled_mlp', 'off')}"
        + (", offloaded activations" if train.get("offload_activations") else "")
    )
    return [
        f"  parallel  {shape} ({par.get('layout', '?')}), seq_len {seq}",
        f"  memory    {knobs}",
    ]


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
    with _client(args) as c:
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
                f"  progress  step {j.step}/{j.total_steps}   restarts {j.restarts}   priority {j.priority}"
            )
            for line in shape_lines(j.spec):
                print(line)
            print(
                f"  created   {j.created_at:%Y-%m-%d %H:%M:%S} UTC   updated {j.updated_at:%H:%M:%S}"
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
                    f"    {time.strftime('%H:%M:%S', time.gmtime(t.time))}  {t.to_state.value:<10} {t.reason}"
                )

        _out(args, j, human)
        return 1 if j.state.value == "FAILED" and not args.json else 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as c:
        j = c.cancel(args.id)
        _out(args, j, lambda: print(f"cancel requested for {j.id}: now {j.state.value}"))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    with _client(args) as c:
        page = c.logs(args.id, driver=not args.no_driver)

        def human() -> None:
            for line in page.lines:
                print(
                    f"{time.strftime('%H:%M:%S', time.gmtime(line.time))} [{line.source}] {line.line}"
                )
            if page.driver_log:
                print("---- Ray driver log (tail) ----")
                print(page.driver_log, end="" if page.driver_log.endswith("\n") else "\n")
            if not page.lines and not page.driver_log:
                print("no logs yet")

        _out(args, page, human)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    with _client(args) as c:
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
                    f"{f.knobs_name} (activation_checkpointing {f.knobs['activation_checkpointing']}"
                    f", tiled_mlp {f.knobs['tiled_mlp']}, offload_activations "
                    f"{str(f.knobs['offload_activations']).lower()}): "
                    f"{f.estimate_bytes / 2**30:.2f} of {f.memory_per_rank_gib:.2f} GiB per rank "
                    f"({f.budget_source})"
                )
            print(
                f"spec {p.spec['name']}: {'OK' if p.valid else 'CANNOT RUN'}; {p.world_size} rank(s) on "
                f"{p.accelerator}, bundle {p.bundle}, strategy {p.strategy}"
            )
            if p.placement:
                print(
                    f"placement: {p.nodes_used} node(s), {p.node_crossings} ring edge(s) cross nodes"
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

        _out(args, p, human)
        return 0 if p.valid else 1


def cmd_pull(args: argparse.Namespace) -> int:
    """Download a job's exported model with a progress bar; every file is checked against its SHA-256."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from api.pull import ChecksumMismatch

    with _client(args) as c:
        listing = c.artifacts(args.id)
        con = _console()
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
        _out(
            args,
            [str(p) for p in paths],
            lambda: con.print(
                f"[green]{len(paths)} files ({listing.total_bytes:,} bytes) verified in {dest}[/green]\n"
                f'AutoModelForCausalLM.from_pretrained("{dest}")'
            ),
        )
    return 0


# ---- data prepare ---------------------------------------------------------------------------------
def cmd_data_prepare(args: argparse.Namespace) -> int:
    """Tokenize a corpus once into a prepared dataset (`workers.data.prepare`), here, with a progress bar.

    Runs on the Ray cluster named by --ray-address (a local Ray otherwise), like
    `python -m workers.data.prepare`; no ringtrain server is needed.
    """
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from workers.data import prepare as data_prepare

    con = _console()
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
    )
    with Progress(
        *columns, TextColumn("{task.fields[counts]}"), console=con, disable=args.json
    ) as bar:
        task = bar.add_task("hashing", total=None, counts="")

        def show(p: data_prepare.Progress) -> None:
            counts = f"{p.documents:,} documents, {p.tokens:,} tokens"
            bar.update(
                task,
                description=p.stage,
                total=p.total_bytes,
                completed=p.done_bytes,
                counts=counts,
            )

        try:
            manifest = data_prepare.prepare(
                args.source,
                args.out,
                tokenizer=args.tokenizer,
                fmt=args.format,
                text_field=args.text_field,
                ray_address=args.ray_address,
                progress=show,
            )
        except data_prepare.PrepareError as e:
            con.print(f"[red]error:[/red] {e}", markup=True)
            return 1
    summary = {k: manifest[k] for k in ("id", "format", "documents", "tokens", "bytes")}
    summary["path"] = str(Path(args.out).resolve())
    _out(
        args,
        summary,
        lambda: con.print(
            f"[green]dataset {summary['id']}: {summary['documents']:,} documents, {summary['tokens']:,} tokens "
            f"in {summary['path']}[/green]\n"
            f"data: {{kind: tokens, path: {summary['path']}, seq_len: 4096, pack: documents}}"
        ),
    )
    return 0


def _add_data_commands(sub: Any) -> None:
    """`ringtrain data prepare SOURCE --tokenizer ... --out DIR`: the arguments of `python -m workers.data.prepare`
    (repeated here, not imported: importing workers.data loads torch, which every other command would pay for;
    tests/unit/workers/data/test_prepare.py checks the two agree)."""
    data = sub.add_parser("data", help="prepared datasets").add_subparsers(
        dest="data_cmd", required=True
    )
    s = data.add_parser("prepare", help="tokenize a corpus once into memory-mapped shards (on Ray)")
    s.add_argument("source", help="a .txt/.jsonl/.parquet file, or a directory of them")
    s.add_argument(
        "--tokenizer", required=True, help="a model directory, or 'bytes' (native models)"
    )
    s.add_argument("--out", required=True, help="the dataset directory to write")
    s.add_argument("--format", choices=("text", "chat"), default="text")
    s.add_argument(
        "--text-field", default="text", help="the field read from .jsonl/.parquet (text format)"
    )
    s.add_argument("--ray-address", default=None, help="a Ray cluster (default: a local Ray)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn=cmd_data_prepare)


# ---- entry point ----------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url", help="ringtrain server (RINGTRAIN_URL, default http://127.0.0.1:8000)"
    )
    common.add_argument("--token", help="API token (RINGTRAIN_TOKEN, default: ~/.ringtrain/token)")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    srv = argparse.ArgumentParser(add_help=False)
    srv.add_argument("--host", help="bind address (RINGTRAIN_HOST, default 127.0.0.1)")
    srv.add_argument("--port", type=int, help="port (RINGTRAIN_PORT, default 8000)")
    srv.add_argument(
        "--database-url",
        help="SQLAlchemy URL (RINGTRAIN_DATABASE_URL, default sqlite:///./ringtrain.db)",
    )
    srv.add_argument(
        "--ray-address", help="Ray Jobs API, e.g. http://head:8265 (empty: start a local Ray head)"
    )

    p = argparse.ArgumentParser(
        prog="ringtrain", description="Long-context training with exact ring attention."
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", parents=[srv], help="run the control plane")
    s.add_argument(
        "--no-migrate",
        action="store_true",
        help="do not upgrade the schema at start (RINGTRAIN_MIGRATE_ON_START=false): run "
        "`ringtrain db upgrade` as its own step; an old schema is then refused",
    )
    s.set_defaults(fn=cmd_serve, json=False)
    s = sub.add_parser("demo", parents=[srv], help="serve locally and submit the passkey example")
    s.add_argument("--spec", help="spec to submit instead of examples/passkey.yaml")
    s.set_defaults(fn=cmd_demo, json=False)
    db_parser = sub.add_parser("db", help="database maintenance")
    db = db_parser.add_subparsers(dest="db_cmd", required=True)
    s = db.add_parser("upgrade", help="bring the database to the newest schema (serve does it too)")
    s.add_argument("--database-url", help="SQLAlchemy URL (RINGTRAIN_DATABASE_URL)")
    s.set_defaults(fn=cmd_db_upgrade, json=False, host=None, port=None, ray_address=None)
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
    _add_data_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code = int(args.fn(args) or 0)
        sys.stdout.flush()  # a closed pipe fails here, inside the handler below, not at exit
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `ringtrain list | head`: the reader left. Point stdout at /dev/null so the interpreter's
        # final flush does not raise again, and exit as a pipe writer does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except ApiError as e:
        where = f" (field {e.field})" if e.field else ""
        print(f"error: {e.message}{where}", file=sys.stderr)
        if e.status == 401:
            print(
                "hint: pass --token, set RINGTRAIN_TOKEN, or use the token `ringtrain serve` saved in "
                "~/.ringtrain/token",
                file=sys.stderr,
            )
        elif e.status == 404:
            print("hint: `ringtrain list` shows your jobs", file=sys.stderr)
        return 1
    except httpx.TransportError as e:
        url = resolve_url(getattr(args, "url", None))
        print(
            f"error: cannot reach ringtrain at {url} ({type(e).__name__}). Is `ringtrain serve` running? "
            "Point to it with --url or RINGTRAIN_URL.",
            file=sys.stderr,
        )
        return 3


if __name__ == "__main__":
    sys.exit(main())
