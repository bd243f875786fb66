"""The `ringtrain` CLI against a real server (recording launcher; the test plays the driver)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from api.cli import main
from tests.api_harness import ALICE, Driver, running, wait_for

ROOT = Path(__file__).resolve().parent.parent
PASSKEY = str(ROOT / "examples" / "passkey.yaml")


@pytest.fixture
def srv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    with running(tmp_path) as s:
        monkeypatch.setenv("RINGTRAIN_URL", s.url)
        monkeypatch.setenv("RINGTRAIN_TOKEN", ALICE)
        yield s


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_submit_list_status_cancel_logs(srv, capsys):
    code, out, _ = run(capsys, "submit", PASSKEY)
    assert code == 0 and out.startswith("submitted j") and "passkey-demo" in out
    job_id = out.split()[1]
    code, out, _ = run(capsys, "submit", PASSKEY, "--json")
    assert code == 0 and json.loads(out)["state"] == "QUEUED"
    code, out, _ = run(capsys, "list")
    assert code == 0 and job_id in out and "passkey-demo" in out
    code, out, _ = run(capsys, "list", "--json")
    assert json.loads(out)["total"] == 2
    d = Driver(srv, job_id)
    d.state("RUNNING", reason="2 ranks placed", placement=[{"rank": 0, "node_id": "node-a", "device": "cpu"}])
    d.metrics(range(3))
    d.post([d.item("log", line="step 2 loss 0.33", source="rank-0")])
    code, out, _ = run(capsys, "status", job_id)
    assert code == 0 and "RUNNING" in out and "step 2/700" in out and "2 ranks placed" in out and "rank 0" in out
    code, out, _ = run(capsys, "logs", job_id)
    assert "[rank-0] step 2 loss 0.33" in out and "Ray driver log" in out
    code, out, _ = run(capsys, "cancel", job_id)
    assert code == 0 and "cancel requested" in out
    wait_for(lambda: srv.client().get(f"/v1/jobs/{job_id}").json()["state"] == "CANCELLED")
    code, out, _ = run(capsys, "status", job_id, "--json")
    assert json.loads(out)["state"] == "CANCELLED"


def test_submit_follow(srv, capsys, tmp_path):
    def drive(job_id: str, final: str) -> None:
        d = Driver(srv, job_id)
        wait_for(lambda: srv.app.state.ctx.hub.subscribers(job_id) >= 1)
        d.state("RUNNING", reason="placed")
        for s in range(30):
            d.post(
                [
                    d.item("metric", step=s, name="loss", value=5.0 - s * 0.1),
                    d.item("metric", step=s, name="tokens_per_s", value=1234.0),
                ]
            )
        d.state(
            final,
            reason="done" if final == "SUCCEEDED" else "rank 0 raised",
            error=None if final == "SUCCEEDED" else "RuntimeError: out of patience",
        )

    for final, want in (("SUCCEEDED", 0), ("FAILED", 1)):
        before = {r.job_id for r in srv.launcher.submits}
        t = threading.Thread(
            target=lambda f=final, b=before: drive(
                wait_for(lambda: next((r.job_id for r in srv.launcher.submits if r.job_id not in b), None)), f
            )
        )
        t.start()
        code, out, _ = run(capsys, "submit", PASSKEY, "--follow")
        t.join(timeout=20)
        assert code == want, out
        assert f"{final}" in out and "final loss 2.1000" in out
        if final == "FAILED":
            assert "out of patience" in out and "ringtrain logs" in out


def test_plan(srv, capsys):
    code, out, _ = run(capsys, "plan", PASSKEY)
    assert code == 0 and "OK" in out and "STRICT_PACK" in out and "rank 1" in out and "memory per rank" in out
    assert "formula" in out
    code, out, _ = run(capsys, "plan", str(ROOT / "examples" / "passkey-128k-gpu.yaml"))
    assert code == 1 and "CANNOT RUN" in out and "never be placed" in out
    code, out, _ = run(capsys, "plan", PASSKEY, "--json")
    assert json.loads(out)["memory"]["param_count"] > 0


def test_errors_tell_what_to_do(srv, capsys, tmp_path, monkeypatch):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\ndata: {kind: passkey, seq_len: 510}\nparallel: {ring_size: 2}\n")
    code, _, err = run(capsys, "submit", str(bad))
    assert code == 1 and "data.seq_len" in err
    code, _, err = run(capsys, "status", "jnothere")
    assert code == 1 and "not found" in err and "ringtrain list" in err
    code, _, err = run(capsys, "list", "--token", "wrong-token-123")
    assert code == 1 and "invalid API token" in err and "RINGTRAIN_TOKEN" in err
    code, _, err = run(capsys, "list", "--url", "http://127.0.0.1:9")
    assert code == 3 and "cannot reach ringtrain" in err and "RINGTRAIN_URL" in err
    with pytest.raises(SystemExit):
        main(["submit", str(tmp_path / "missing.yaml")])


def test_console_script_help():
    t = time.time()
    r = subprocess.run(
        [sys.executable, "-m", "api.cli", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert r.returncode == 0
    for cmd in ("serve", "demo", "submit", "list", "status", "cancel", "logs", "plan"):
        assert cmd in r.stdout
    assert time.time() - t < 60
