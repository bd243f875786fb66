"""The `ringtrain` command line: serve, demo, db upgrade, submit, list, status, cancel, logs, plan,
pull, data prepare.

Human output by default, `--json` for scripts. The server is `--url` / `RINGTRAIN_URL` (default
http://127.0.0.1:8000); the token is `--token` / `RINGTRAIN_TOKEN` / `~/.ringtrain/token`. Exit
status: 0 ok, 1 the server said no (or the followed job did not succeed), 2 usage, 3 unreachable.
"""

from __future__ import annotations

import argparse
import os
import sys

import httpx

from api.cli import data, evals, jobs, serve
from api.cli.catalog_view import format_value
from api.client import ApiError, resolve_url

__all__ = ["format_value", "main", "parser"]


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
    serve.add_commands(sub, srv)
    jobs.add_commands(sub, common)
    data.add_commands(sub, common)
    evals.add_commands(sub, common)
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
                "hint: pass --token, set RINGTRAIN_TOKEN, or use the token `ringtrain serve` "
                "saved in ~/.ringtrain/token",
                file=sys.stderr,
            )
        elif e.status == 404:
            print("hint: `ringtrain list` shows your jobs", file=sys.stderr)
        return 1
    except httpx.TransportError as e:
        url = resolve_url(getattr(args, "url", None))
        print(
            f"error: cannot reach ringtrain at {url} ({type(e).__name__}). "
            "Is `ringtrain serve` running? Point to it with --url or RINGTRAIN_URL.",
            file=sys.stderr,
        )
        return 3
