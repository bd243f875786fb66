"""`ringtrain serve` and its private Ray head: the head stops with serve on SIGINT (Ctrl-C) and
never outlives it (SIGKILL included), and a restarted serve continues the jobs it had from their
checkpoints (ARCHITECTURE.md, "Contracts"). SIGTERM takes serve through the same shutdown as
Ctrl-C (its handler turns the signal into an exit, so the same `finally` stops the head): checked
on a serve without a head of its own, whose exit status says the handler ran
(tests/unit/api/test_serve_signals.py).

Ray's own processes are found as descendants of serve and by the head's unique temp dir on their command lines;
after each signal none may be left running.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.integration.test_faults import each_key_once, stored_points
from tests.support.dist import free_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "serve-lifecycle-token"
pytestmark = [pytest.mark.ray, pytest.mark.slow]


class Serve:
    """`ringtrain serve` with no Ray address (so it starts its own head), on a fixed port and SQLite file."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "serve.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGTRAIN_", "RAY_"))}
        self.env = {
            **env,
            "RINGTRAIN_DATABASE_URL": f"sqlite:///{tmp}/rt.db",
            "RINGTRAIN_API_TOKENS": json.dumps({TOKEN: "alice"}),
            "RINGTRAIN_PORT": str(self.port),
            "RINGTRAIN_CHECKPOINT_DIR": str(tmp / "ckpt"),
            "RINGTRAIN_SCHEDULER_INTERVAL_S": "0.2",
            "RINGTRAIN_RECONCILE_INTERVAL_S": "0.5",
            "RINGTRAIN_RECONCILE_GRACE_S": "3",
            "PYTHONPATH": str(ROOT),
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Serve:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from api.cli import main; raise SystemExit(main())", "serve"],
                env=self.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return self
            time.sleep(0.3)
        raise AssertionError(f"serve did not become ready:\n{self.log.read_text()[-3000:]}")

    def head_temp_dir(self) -> str:
        """The private head's temp dir, read off the `ray start` process serve started."""
        assert self.proc is not None
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            cmd = child.cmdline()
            if "start" in cmd and "--head" in cmd:
                return next(a.split("=", 1)[1] for a in cmd if a.startswith("--temp-dir="))
        raise AssertionError("serve started no Ray head")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(timeout=90)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGTERM)


def ray_processes(marker: str) -> list[str]:
    """Live (not zombie) processes whose command line names the head's temp dir."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        with contextlib.suppress(psutil.Error):
            if p.info["status"] != psutil.STATUS_ZOMBIE and any(
                marker in a for a in p.info["cmdline"] or []
            ):
                found.append(f"{p.info['pid']} {' '.join(p.info['cmdline'])[:160]}")
    return found


def wait_gone(marker: str, timeout_s: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := ray_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    s = Serve(tmp_path)
    try:
        yield s
    finally:
        s.stop()


def stops_with_serve(serve: Serve, sig: int) -> None:
    """Send `sig` to serve: afterwards no process of its head may be left (the head's own processes
    were there before: gcs, raylet, dashboard at least, so an empty listing proves something)."""
    marker = serve.head_temp_dir()
    before = ray_processes(marker)
    assert len(before) >= 3, before
    serve.signal(sig)
    assert wait_gone(marker) == [], f"Ray processes left after {signal.Signals(sig).name}"
    if sig != signal.SIGKILL:
        assert "stopping the local Ray head" in serve.log.read_text()


def _job(client: httpx.Client, jid: str) -> dict:
    r = client.get(f"/v1/jobs/{jid}")
    r.raise_for_status()
    return r.json()


def test_a_restarted_serve_continues_its_jobs_from_their_checkpoints(serve: Serve) -> None:
    # Far from done when the first checkpoint (step 5) is seen and everything is killed (a step
    # well under 0.1 s on 2 loaded cores, the kill ~0.5 s after the checkpoint is seen); the
    # resumed attempt runs the rest on the new head.
    steps = 30
    spec = {
        "name": "survives-serve",
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
        "data": {"kind": "passkey", "seq_len": 128, "key_digits": 2},
        # one rank: what is tested is serve and its head (multi-rank resumes: test_faults.py)
        "parallel": {"ring_size": 1},
        "train": {"steps": steps, "lr": 1e-3},
        "checkpoint": {"every_steps": 5, "keep": 2},
        "eval": {"enabled": False},
        "max_restarts": 0,  # the head's replacement must not use up a restart
    }
    serve.start()
    client = httpx.Client(
        base_url=serve.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
    )
    jid = client.post("/v1/jobs", json=spec).json()["id"]
    ckpt = serve.tmp / "ckpt" / jid
    deadline = time.monotonic() + 240
    while not any(ckpt.glob("step-*")) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert any(ckpt.glob("step-*")), _job(client, jid)
    stops_with_serve(serve, signal.SIGKILL)  # serve, its head and the job's driver and ranks all go
    newest_at_kill = max(int(p.name.split("-")[1]) for p in ckpt.glob("step-*"))

    serve.start()
    deadline = time.monotonic() + 300
    while (job := _job(client, jid))["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED"):
        assert time.monotonic() < deadline, job
        time.sleep(0.5)
    assert job["state"] == "SUCCEEDED", job
    retry = next(t for t in job["transitions"] if t["to"] == "RETRYING")
    assert "does not know" in retry["reason"] and "no restart used" in retry["reason"], retry
    resumed = next(
        t
        for t in job["transitions"]
        if t["seq"] > retry["seq"] and t.get("resume_step") is not None
    )
    assert resumed["resume_step"] == newest_at_kill, (resumed, newest_at_kill)
    # every (step, name, rank) the spec implies, exactly once, across the kill and the resume
    each_key_once(stored_points(client, jid), spec)
    stops_with_serve(serve, signal.SIGINT)  # and the second head stops with the second serve
