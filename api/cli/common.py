"""What every command shares: the console, `--json` or human output, the API client."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import TypeAdapter

from api.client import Client

if TYPE_CHECKING:  # rich loads only for the commands that use it
    from rich.console import Console


def console() -> Console:
    from rich.console import Console

    return Console(highlight=False)


def out(args: argparse.Namespace, obj: object, human: Callable[[], None]) -> None:
    if args.json:
        print(
            json.dumps(
                TypeAdapter(type(obj)).dump_python(obj, mode="json", by_alias=True), indent=2
            )
        )
    else:
        human()


def client(args: argparse.Namespace) -> Client:
    return Client(args.url, args.token)
