"""`ringtrain data prepare`: a prepared dataset, tokenized here (on Ray), no server needed."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from api.cli.common import console, out
from workers import prepare_args


def cmd_data_prepare(args: argparse.Namespace) -> int:
    """Tokenize a corpus once into a prepared dataset (`workers.data.prepare`), here, with a
    progress bar.

    Runs on the Ray cluster named by --ray-address (a local Ray otherwise), like
    `python -m workers.data.prepare`; no ringtrain server is needed.
    """
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from workers.data import prepare as data_prepare

    con = console()
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


def add_commands(sub: Any) -> None:
    """`ringtrain data prepare SOURCE --tokenizer ... --out DIR`: the arguments of
    `python -m workers.data.prepare`, from `workers.prepare_args` (torch-free, unlike
    `workers.data`, so every other command's parser stays light)."""
    data = sub.add_parser("data", help="prepared datasets").add_subparsers(
        dest="data_cmd", required=True
    )
    s = data.add_parser("prepare", help="tokenize a corpus once into memory-mapped shards (on Ray)")
    prepare_args.add_arguments(s)
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn=cmd_data_prepare)
