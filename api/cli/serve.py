"""`ringtrain serve`, `demo` and `db upgrade`: the control plane in this process."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from api.cli.common import console
from api.cli.jobs import follow
from api.client import Client

if TYPE_CHECKING:  # the server side loads only for the commands that use it
    from service.settings import Settings

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


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
    con = console()
    # SIGTERM (systemd, Docker, Kubernetes) ends like Ctrl-C: uvicorn shuts down, then re-raises the
    # signal it caught; with this handler that is an exception, so the `finally` below still stops
    # the local Ray head.
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
            console().print(f"[red]demo: could not submit {spec}: {e}[/red]")
            return
        con = console()
        con.print(f"\n[bold green]demo job {job.id} submitted[/bold green] ({spec.name})")
        con.print(f"  dashboard: [bold]{url}/[/bold]  (job {job.id})")
        con.print(f"  token:     {token}")
        con.print(
            f"  watch:     RINGTRAIN_URL={url} ringtrain status {job.id}   "
            f"(or ringtrain logs {job.id})\n",
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


def add_commands(sub: Any, srv: argparse.ArgumentParser) -> None:
    """`serve`, `demo` (both with the server options `srv`) and `db upgrade`."""
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
