"""`ringtrain data prepare`: a prepared dataset, tokenized here (on Ray), no server needed."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from api.cli.common import console, out
from api.client import ApiError, Client
from workers import prepare_args


def outside_server_roots(args: argparse.Namespace) -> str | None:
    """Why --out is no place for a dataset the configured server's jobs will read, or None.

    Asked only of a server that answers (`--url` / `RINGTRAIN_URL`, its token): without one there
    is nothing to check against, and a prepare needs no server."""
    import httpx

    try:
        with Client(args.url, args.token, timeout=5) as c:
            roots = [Path(r) for r in c.data_roots()]
            url = c.url
    except (ApiError, httpx.HTTPError, OSError, ValueError, RuntimeError):
        return None  # no server here, or none that lets us ask: nothing to check
    target = Path(args.out).expanduser().resolve()
    if any(target == r or target.is_relative_to(r) for r in roots):
        return None
    return (
        f"--out {target} is outside the data roots of the server at {url} "
        f"({', '.join(map(str, roots)) or 'none'}): a job reading it there would be refused. "
        "Prepare under one of them, add the folder to the server's RINGTRAIN_DATA_ROOTS, or "
        "pass --no-server-check to prepare it anyway"
    )


def cmd_data_prepare(args: argparse.Namespace) -> int:
    """Tokenize a corpus once into a prepared dataset (`workers.data.prepare`), here, with a
    progress bar.

    Runs on the Ray cluster named by --ray-address (a local Ray otherwise), like
    `python -m workers.data.prepare`; no ringtrain server is needed.
    """
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    con = console()
    if not args.no_server_check and (why := outside_server_roots(args)):
        con.print(f"[red]error:[/red] {why}", markup=True, soft_wrap=True)
        return 2
    from workers.data import prepare as data_prepare

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
            summary = prepare_args.run(args, show)
        except data_prepare.PrepareError as e:
            con.print(f"[red]error:[/red] {e}", markup=True)
            return 1
    summary["path"] = str(Path(args.out).resolve())
    out(
        args,
        summary,
        lambda: con.print(
            f"[green]dataset {summary['id']}: {summary['documents']:,} documents, "
            f"{summary['tokens']:,} tokens in {summary['path']}[/green]\n"
            f"data: {{kind: tokens, path: {summary['path']}, seq_len: 4096, pack: documents}}"
        ),
    )
    return 0


def add_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """`ringtrain data prepare SOURCE --tokenizer ... --out DIR`: the arguments of
    `python -m workers.data.prepare`, from `workers.prepare_args` (torch-free, unlike
    `workers.data`, so every other command's parser stays light)."""
    data = sub.add_parser("data", help="prepared datasets").add_subparsers(
        dest="data_cmd", required=True
    )
    s = data.add_parser(
        "prepare",
        parents=[common],  # --url/--token: the server whose data roots --out is checked against
        help="tokenize a corpus once into memory-mapped shards (on Ray)",
    )
    prepare_args.add_arguments(s)
    s.add_argument(
        "--no-server-check",
        action="store_true",
        help="do not ask the configured server whether --out lies in its data roots",
    )
    s.set_defaults(fn=cmd_data_prepare)
