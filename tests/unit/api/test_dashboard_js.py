"""The dashboard's JavaScript that runs without a page, under Node's own test runner (`node --test`):
value and tick formats, axis ranges, metric-name ordering and families, pipeline ranks, stage
boundaries, the 422 field's line (dashboard_js/logic.test.mjs), and the REST and event-stream client
against a loopback HTTP server (dashboard_js/api.test.mjs). The browser tests (tests/unit/api/browser) drive
the same modules in Chromium through the real server; these keep a one-line slip in them visible to
the fast tier, where no browser runs.

Node reads `api/static/js/*.js` as ES modules from a copy with a `package.json` that says so (the
served directory has none). Where Node is missing the tests skip, and fail under CI
(`RINGTRAIN_REQUIRE_NODE=1`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.require import missing
from tests.unit.api.test_cli_units import KNOWN

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent / "dashboard_js"


@pytest.fixture(scope="module")
def static(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of api/static that Node loads as ES modules."""
    node = shutil.which("node")
    if node is None:
        missing("node", "Node.js not found (apt-get install -y nodejs)")
    out = tmp_path_factory.mktemp("static") / "static"
    shutil.copytree(ROOT / "api" / "static", out)
    (out / "package.json").write_text('{"type": "module"}\n')
    return out


@pytest.mark.parametrize("suite", sorted(p.name for p in HERE.glob("*.test.mjs")))
def test_dashboard_module(static: Path, suite: str) -> None:
    env = {
        **os.environ,
        "RINGTRAIN_STATIC": str(static),
        "RINGTRAIN_UNITS_KNOWN": json.dumps([list(row) for row in KNOWN]),
        "NO_COLOR": "1",
    }
    try:
        done = subprocess.run(
            ["node", "--test", "--test-reporter=spec", str(HERE / suite)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired as e:  # e.g. an event-stream client that never stops
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"node --test {suite} did not end within 120 s:\n{out[-6000:]}")
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
