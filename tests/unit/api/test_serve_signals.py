"""`ringtrain serve` ends on SIGTERM (systemd, Docker, Kubernetes) as on Ctrl-C: through uvicorn's
shutdown (the leader steps down) and out through the `finally` that stops a local Ray head. The
exit status tells the two apart from a death by the signal: 143 (its handler's SystemExit) and 130
(KeyboardInterrupt), never -15. Here serve has a Ray address of its own (nothing listens there), so
no head is started; the head's part is tests/integration/test_serve_lifecycle.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.dist import free_port

ROOT = Path(__file__).resolve().parents[3]


def _as_from_a_terminal() -> None:
    """SIGINT's default disposition, as a shell gives it: a pytest-xdist worker ignores SIGINT, and
    an ignored signal stays ignored across exec (Python then installs no KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_serve_shuts_down_on_the_signal(tmp_path: Path, sig: signal.Signals, status: int) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGTRAIN_", "RAY_"))}
    env.update(
        RINGTRAIN_DATABASE_URL=f"sqlite:///{tmp_path}/rt.db",
        RINGTRAIN_RAY_ADDRESS=f"http://127.0.0.1:{free_port()}",
        RINGTRAIN_PORT=str(port),
        RINGTRAIN_API_TOKENS=json.dumps({"serve-signal-token": "alice"}),
        RINGTRAIN_LOG_LEVEL="WARNING",
        PYTHONPATH=str(ROOT),
    )
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from api.cli import main; raise SystemExit(main())", "serve"],
            env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_as_from_a_terminal,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-2000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        proc.send_signal(sig)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert rc == status, (rc, text[-2000:])
    assert "stops leading (epoch 1): shutting down" in text, text[-2000:]
