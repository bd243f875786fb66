"""The arguments of a prepare, one definition for `python -m workers.data.prepare` and
`ringtrain data prepare`.

Outside `workers.data` on purpose: importing that package loads torch, which the CLI's parser
(built for every command) must not pay for.
"""

from __future__ import annotations

import argparse


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
