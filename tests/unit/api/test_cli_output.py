"""What `ringtrain` prints for a newcomer's everyday commands: families in numeric order, ASCII only,
and a quiet exit when the reader of a pipe leaves early."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.cli import main
from tests.support.api_harness import ALICE, Driver, Server, running

ROOT = Path(__file__).resolve().parents[3]
PASSKEY = str(ROOT / "examples" / "passkey.yaml")
BUCKETS = ("0-64", "64-128", "128-256", "256-512", "512-1024", "1024-2048")


@pytest.fixture
def srv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    with running(tmp_path) as s:
        monkeypatch.setenv("RINGTRAIN_URL", s.url)
        monkeypatch.setenv("RINGTRAIN_TOKEN", ALICE)
        yield s


def _submit(capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["submit", PASSKEY]) == 0
    return capsys.readouterr().out.split()[1]


def test_status_lists_position_buckets_by_position(
    srv: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    job_id = _submit(capsys)
    d = Driver(srv, job_id)
    d.state("RUNNING", reason="placed")
    # reported in text order, the order a plain sort would also give
    names = sorted(f"val_loss/pos={b}" for b in BUCKETS)
    d.post([d.item("metric", step=5, name=n, value=2.0 + i) for i, n in enumerate(names)])
    assert main(["status", job_id]) == 0
    out = capsys.readouterr().out
    shown = [b for line in out.splitlines() for b in BUCKETS if f"val_loss/pos={b} " in line]
    assert shown == list(BUCKETS), out


def test_plan_prints_ascii_only(srv: Server, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", PASSKEY]) == 0
    out = capsys.readouterr().out
    assert "memory per rank" in out
    assert out.isascii(), [ch for ch in out if not ch.isascii()]


def test_list_into_a_closed_pipe_exits_quietly(srv: Server) -> None:
    """`ringtrain list | head -1`: the reader leaves after one line; no traceback on stderr."""
    env = {**os.environ, "RINGTRAIN_URL": srv.url, "RINGTRAIN_TOKEN": ALICE}
    cli = subprocess.Popen(
        [sys.executable, "-m", "api.cli", "list"],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert cli.stdout is not None and cli.stderr is not None
    cli.stdout.close()  # the reader leaves before anything is written
    err = cli.stderr.read().decode()
    code = cli.wait(timeout=60)
    assert "BrokenPipe" not in err and "Traceback" not in err and "Exception" not in err, err
    assert code == 141, (code, err)
