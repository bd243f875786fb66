"""Prepare a corpus once: tokenized into memory-mapped shards, an index and a manifest.

The command line, `python -m workers.data.prepare` (its arguments in `workers.prepare_args`)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from workers.data.prepare.planning import PrepareError, Progress
from workers.prepare_args import add_arguments, run


def format_progress(p: Progress) -> str:
    share = p.done_bytes / p.total_bytes if p.total_bytes else 1.0
    bar = "#" * int(share * 30)
    return f"[{bar:<30}] {share:6.1%} {p.stage:<10} {p.documents:,} documents {p.tokens:,} tokens"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workers.data.prepare", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    parser.add_argument(
        "--json-progress", action="store_true", help="one JSON line per progress update"
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="tokenize in this process, without Ray (small corpora, tests)",
    )
    args = parser.parse_args(argv)

    def show(p: Progress) -> None:
        if args.json_progress:
            print(json.dumps({"progress": asdict(p)}), flush=True)
        else:
            print("\r" + format_progress(p), end="", file=sys.stderr, flush=True)

    try:
        summary = run(args, show, inline=args.in_process)
    except PrepareError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    print(
        ("" if args.json_progress else "\n")
        + json.dumps({"dataset": {**summary, "path": str(args.out)}})
    )
    return 0
