"""The `ringtrain` command line: serve, demo, submit, list, status, cancel, logs, plan, pull, data prepare.

Human output by default, `--json` for scripts. The server is `--url` / `RINGTRAIN_URL`
(default http://127.0.0.1:8000); the token is `--token` / `RINGTRAIN_TOKEN` / `~/.ringtrain/token`.
Exit status: 0 ok, 1 the server said no (or the followed job did not succeed), 2 usage, 3 unreachable.
"""

from __future__ import annotations

import argparse
import json
import logging
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
from api.schemas import JobOut

if TYPE_CHECKING:  # rich and the server side load only for the commands that use them
    from rich.console import Console

    from service.settings import Settings

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _console() -> Console:
    from rich.console import Console

    return Console(highlight=False)


def _out(args: argparse.Namespace, obj: object, human: Callable[[], None]) -> None:
    if args.json:
        print(json.dumps(TypeAdapter(type(obj)).dump_python(obj, mode="json", by_alias=True), indent=2))
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
        }.items()
        if v is not None
    }
    return Settings(**over)


def _run_server(settings: Settings, on_ready: Callable[[Settings], None] | None = None) -> int:
    import uvicorn

    from api.app import create_app

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

            con.print("[dim]starting a local Ray head (no RINGTRAIN_RAY_ADDRESS given)…[/dim]")
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
            con.print("[dim]stopping the local Ray head…[/dim]")
            head.stop()


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


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


# ---- job commands ---------------------------------------------------------------------------------
def _fmt_job_line(j: JobOut) -> str:
    loss = j.latest_metrics.get("loss")
    loss_s = f"{loss.value:.4f}" if loss and loss.value is not None else "-"
    state = f"{j.state.value} #{j.queue_position}" if j.queue_position is not None else j.state.value
    line = f"{j.id:<14} {state:<12} {j.step:>6}/{j.total_steps:<6} {loss_s:>9}  {j.name}"
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
    """Show a live progress bar with loss and tokens/s until the job ends; 0 iff it SUCCEEDED."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    job = c.get_job(job_id)
    stats: dict[str, Any] = {"loss": None, "tps": None, "state": job.state.value}
    final_state = job.state.value
    con = _console()
    with Progress(
        TextColumn("[bold]{task.fields[state]:<9}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tok/s"),
        TimeElapsedColumn(),
        console=con,
        disable=json_lines,
        transient=False,
    ) as bar:
        task = bar.add_task("train", total=job.total_steps, state=job.state.value, loss="-", tps="-")
        for ev in c.events(job_id):
            if json_lines:
                print(json.dumps({"event": ev.event, "id": ev.id, "data": ev.data}), flush=True)
            if ev.event == "metric" and ev.data.get("rank") is None:
                name, v = ev.data["name"], ev.data["value"]
                if name == "loss":
                    stats["loss"] = v
                    bar.update(
                        task, completed=min(ev.data["step"], job.total_steps), loss="-" if v is None else f"{v:.4f}"
                    )
                elif name == "tokens_per_s" and v is not None:
                    bar.update(task, tps=f"{v:,.0f}")
            elif ev.event == "state":
                stats["state"] = ev.data["to"]
                bar.update(task, state=ev.data["to"])
                if ev.data["to"] == "RETRYING":
                    bar.console.print(f"[yellow]retrying: {ev.data.get('reason', '')}[/yellow]")
            elif ev.event == "log" and not json_lines:
                bar.console.print(f"[dim]{ev.data.get('source')}: {ev.data.get('line')}[/dim]")
            elif ev.event == "end":
                final_state = ev.data["state"]
    job = c.get_job(job_id)
    if not json_lines:
        loss = job.latest_metrics.get("loss")
        color = "green" if final_state == "SUCCEEDED" else "red"
        con.print(
            f"[{color}]job {job_id} {final_state}[/{color}] at step {job.step}/{job.total_steps}"
            + (f", final loss {loss.value:.4f}" if loss and loss.value is not None else "")
        )
        if job.error:
            con.print(f"[red]error:[/red] {job.error}")
            con.print(f"see the logs: ringtrain logs {job_id}")
    return 0 if final_state == "SUCCEEDED" else 1


def cmd_list(args: argparse.Namespace) -> int:
    with _client(args) as c:
        page = c.list_jobs(state=args.state, limit=args.limit, offset=args.offset)

        def human() -> None:
            if not page.jobs:
                print("no jobs (submit one: ringtrain submit examples/passkey.yaml)")
                return
            print(f"{'ID':<14} {'STATE':<12} {'STEP':>13} {'LOSS':>9}  NAME")
            for j in page.jobs:
                print(_fmt_job_line(j))
            if page.total > page.offset + len(page.jobs):
                print(f"… {page.total} jobs in all; see more with --offset {page.offset + len(page.jobs)}")

        _out(args, page, human)
    return 0


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
            print(f"  progress  step {j.step}/{j.total_steps}   restarts {j.restarts}   priority {j.priority}")
            print(f"  created   {j.created_at:%Y-%m-%d %H:%M:%S} UTC   updated {j.updated_at:%H:%M:%S}")
            for name, m in sorted(j.latest_metrics.items()):
                print(f"  {name:<16} {m.value if m.value is not None else 'nan'}  (step {m.step})")
            for p in j.placement:
                print(f"  rank {p.rank:<3} {p.node_id[:16]:<16} {p.device}")
            if j.error:
                print(f"  error     {j.error}")
            print("  history")
            for t in j.transitions or []:
                print(f"    {time.strftime('%H:%M:%S', time.gmtime(t.time))}  {t.to_state.value:<10} {t.reason}")

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
                print(f"{time.strftime('%H:%M:%S', time.gmtime(line.time))} [{line.source}] {line.line}")
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
        p = c.plan(spec)

        def human() -> None:
            mem = p.memory
            print(
                f"spec {p.spec['name']}: {'OK' if p.valid else 'CANNOT RUN'}; {p.world_size} rank(s) on "
                f"{p.accelerator}, bundle {p.bundle}, strategy {p.strategy}"
            )
            if p.placement:
                print(f"placement: {p.nodes_used} node(s), {p.node_crossings} ring edge(s) cross nodes")
                for s in p.placement:
                    print(f"  rank {s.rank:<4} ring {s.ring:<3} {s.node_id[:20]:<20} {s.device}")
            gib = 2**30
            print(
                f"memory per rank ≈ {mem['total_bytes'] / gib:.2f} GiB "
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
                paths = c.pull(args.id, args.dir, lambda name, done, _: bar.update(tasks[name], completed=done))
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
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, TextColumn("{task.fields[counts]}"), console=con, disable=args.json) as bar:
        task = bar.add_task("hashing", total=None, counts="")

        def show(p: data_prepare.Progress) -> None:
            counts = f"{p.documents:,} documents, {p.tokens:,} tokens"
            bar.update(task, description=p.stage, total=p.total_bytes, completed=p.done_bytes, counts=counts)

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
    tests/test_prepare.py checks the two agree)."""
    data = sub.add_parser("data", help="prepared datasets").add_subparsers(dest="data_cmd", required=True)
    s = data.add_parser("prepare", help="tokenize a corpus once into memory-mapped shards (on Ray)")
    s.add_argument("source", help="a .txt/.jsonl/.parquet file, or a directory of them")
    s.add_argument("--tokenizer", required=True, help="a model directory, or 'bytes' (native models)")
    s.add_argument("--out", required=True, help="the dataset directory to write")
    s.add_argument("--format", choices=("text", "chat"), default="text")
    s.add_argument("--text-field", default="text", help="the field read from .jsonl/.parquet (text format)")
    s.add_argument("--ray-address", default=None, help="a Ray cluster (default: a local Ray)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn=cmd_data_prepare)


# ---- entry point ----------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help="ringtrain server (RINGTRAIN_URL, default http://127.0.0.1:8000)")
    common.add_argument("--token", help="API token (RINGTRAIN_TOKEN, default: ~/.ringtrain/token)")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    srv = argparse.ArgumentParser(add_help=False)
    srv.add_argument("--host", help="bind address (RINGTRAIN_HOST, default 127.0.0.1)")
    srv.add_argument("--port", type=int, help="port (RINGTRAIN_PORT, default 8000)")
    srv.add_argument("--database-url", help="SQLAlchemy URL (RINGTRAIN_DATABASE_URL, default sqlite:///./ringtrain.db)")
    srv.add_argument("--ray-address", help="Ray Jobs API, e.g. http://head:8265 (empty: start a local Ray head)")

    p = argparse.ArgumentParser(prog="ringtrain", description="Long-context training with exact ring attention.")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", parents=[srv], help="run the control plane")
    s.set_defaults(fn=cmd_serve, json=False)
    s = sub.add_parser("demo", parents=[srv], help="serve locally and submit the passkey example")
    s.add_argument("--spec", help="spec to submit instead of examples/passkey.yaml")
    s.set_defaults(fn=cmd_demo, json=False)
    s = sub.add_parser("submit", parents=[common], help="submit a job spec (YAML/JSON file, or - for stdin)")
    s.add_argument("spec")
    s.add_argument("--follow", "-f", action="store_true", help="show live progress until the job ends")
    s.set_defaults(fn=cmd_submit)
    s = sub.add_parser("list", parents=[common], help="list your jobs, newest first")
    s.add_argument("--state", action="append", help="only this state (repeatable)")
    s.add_argument("--limit", type=int, default=20)
    s.add_argument("--offset", type=int, default=0)
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
    s = sub.add_parser("pull", parents=[common], help="download a job's exported model, checksums verified")
    s.add_argument("id")
    s.add_argument("dir")
    s.set_defaults(fn=cmd_pull)
    s = sub.add_parser("plan", parents=[common], help="dry-run a spec: validity, placement, memory")
    s.add_argument("spec")
    s.set_defaults(fn=cmd_plan)
    _add_data_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except KeyboardInterrupt:
        return 130
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
