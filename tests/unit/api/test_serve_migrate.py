"""`ringtrain serve` upgrades the schema at start unless told not to (`--no-migrate`,
`RINGTRAIN_MIGRATE_ON_START=false`: the Deployment's init container runs `ringtrain db upgrade`);
then it only checks the schema, and an old one is refused with the command that fixes it."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest

from api import cli
from api.cli import serve as cli_serve
from service.db import SchemaOutdated, current_revision, head_revision, make_engine


class _Built(Exception):
    """Raised instead of building the app: the test stops before uvicorn."""


@pytest.fixture
def serve_args(tmp_path: Path) -> Iterator[list[str]]:
    sigterm = signal.getsignal(signal.SIGTERM)  # _run_server installs its own
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RINGTRAIN_")}
    clean["RINGTRAIN_TOKEN_FILE"] = str(tmp_path / "token")  # not the user's ~/.ringtrain
    with mock.patch.dict(os.environ, clean, clear=True):
        # a Ray address, so no local head starts
        yield ["--database-url", f"sqlite:///{tmp_path}/rt.db", "--ray-address", "http://x:1"]
    signal.signal(signal.SIGTERM, sigterm)


def settings_of(argv: list[str]) -> bool:
    return cli_serve._settings(cli.parser().parse_args(argv)).migrate_on_start


def test_the_flag_and_the_setting(serve_args: list[str]) -> None:
    assert settings_of(["serve", *serve_args]) is True  # the default: one command does it all
    assert settings_of(["serve", "--no-migrate", *serve_args]) is False
    with mock.patch.dict(os.environ, {"RINGTRAIN_MIGRATE_ON_START": "false"}):
        assert settings_of(["serve", *serve_args]) is False
    with pytest.raises(SystemExit):  # `demo` always migrates: no such flag there
        cli.parser().parse_args(["demo", "--no-migrate"])


def test_serve_migrates_only_when_asked(serve_args: list[str], tmp_path: Path) -> None:
    url = serve_args[1]
    built = mock.patch("api.app.create_app", side_effect=_Built)
    with built, pytest.raises(_Built):
        cli.main(["serve", *serve_args])
    engine = make_engine(url)
    try:
        assert current_revision(engine) == head_revision()  # serve upgraded it
    finally:
        engine.dispose()

    fresh = f"sqlite:///{tmp_path}/fresh.db"
    with mock.patch("service.db.upgrade") as upgrade, built, pytest.raises(_Built):
        cli.main(["serve", "--no-migrate", "--database-url", fresh, *serve_args[2:]])
    upgrade.assert_not_called()
    # and the real app refuses the schema nobody upgraded, naming the step that does
    with pytest.raises(SchemaOutdated, match="ringtrain db upgrade"):
        cli.main(["serve", "--no-migrate", "--database-url", fresh, *serve_args[2:]])
