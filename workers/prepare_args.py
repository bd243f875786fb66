"""The arguments of a prepare, one definition for `python -m workers.data.prepare` and
`ringtrain data prepare`.

Outside `workers.data` on purpose: importing that package loads torch, which the CLI's parser
(built for every command) must not pay for.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The prepare arguments, shared with `ringtrain data prepare`."""
    parser.add_argument("source", help="a .txt/.jsonl/.parquet file, or a directory of them")
    parser.add_argument(
        "--tokenizer", required=True, help="a model directory, or 'bytes' (native models)"
    )
    parser.add_argument("--out", required=True, help="the dataset directory to write")
    parser.add_argument("--format", choices=("text", "chat"), default="text")
    parser.add_argument(
        "--text-field", default="text", help="the field read from .jsonl/.parquet (text format)"
    )
    parser.add_argument("--ray-address", default=None, help="a Ray cluster (default: a local Ray)")
    parser.add_argument(
        "--workers",
        type=_positive,
        default=None,
        help="at most this many tokenize tasks at once (default: as many as the cluster's CPUs)",
    )


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def run(
    args: argparse.Namespace, progress: Callable[[Any], None], inline: bool = False
) -> dict[str, Any]:
    """Prepare what `args` (parsed with `add_arguments`) names; the dataset's summary: id, format,
    documents, tokens, bytes. Imports the data layer (torch) only when called."""
    from workers.data.prepare import prepare

    manifest = prepare(
        args.source,
        args.out,
        tokenizer=args.tokenizer,
        fmt=args.format,
        text_field=args.text_field,
        ray_address=args.ray_address,
        workers=args.workers,
        progress=progress,
        inline=inline,
    )
    return {k: manifest[k] for k in ("id", "format", "documents", "tokens", "bytes")}
