"""Readiness follows the job store only: a Ray head that accepts connections and never answers (the
worst kind of slow) leaves /readyz answering at once, while /healthz and /metrics report Ray
unreachable from the background check, and a job submitted meanwhile waits QUEUED saying why."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.ray_jobs import RayJobLauncher
from tests.support.api_harness import TINY_SPEC, running, wait_for


class SilentHead:
    """A listening socket on loopback that accepts every connection and never sends a byte."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self.held.append(self.sock.accept()[0])

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


@pytest.fixture
def silent_head() -> Iterator[SilentHead]:
    head = SilentHead()
    yield head
    head.close()


def test_readyz_answers_at_once_while_ray_never_answers(
    tmp_path: Path, silent_head: SilentHead
) -> None:
    launcher = RayJobLauncher(silent_head.url)
    with running(tmp_path, launcher, ray_check_interval_s=0.2, ray_check_timeout_s=0.5) as srv:
        c = srv.client(None)
        health = wait_for(
            lambda: (h := c.get("/healthz").json())["ray"] == "unreachable" and h, timeout=10
        )
        assert health["status"] == "ok" and health["role"] == "leader"
        assert re.fullmatch(r"no answer for \d+\.\d s", health["ray_error"]), health
        assert silent_head.held, "the check never reached the fake head"
        for _ in range(5):  # every probe while the check hangs: 200 within a second, store only
            t0 = time.monotonic()
            r = c.get("/readyz", timeout=5)
            took = time.monotonic() - t0
            assert r.status_code == 200 and took < 1.0, (r.status_code, took)
            assert r.json() == {"status": "ready", "store": "ok"}
        text = c.get("/metrics").text
        assert re.search(r"^ringtrain_ray_up 0\.0$", text, re.M), text
        assert re.search(r"^ringtrain_ray_check_age_seconds \d", text, re.M)


@pytest.mark.slow
def test_a_job_submitted_while_ray_never_answers_waits_queued(
    tmp_path: Path, silent_head: SilentHead
) -> None:
    launcher = RayJobLauncher(silent_head.url)
    with running(tmp_path, launcher, ray_check_interval_s=0.2, ray_check_timeout_s=0.5) as srv:
        c = srv.client(timeout=60)
        wait_for(lambda: c.get("/healthz").json()["ray"] == "unreachable", timeout=20)
        # the request does not wait on Ray (it would for 10 s): the background check said it is away
        r = srv.client(timeout=5).post("/v1/jobs", json=TINY_SPEC)
        assert r.status_code == 201, r.text
        jid = r.json()["id"]

        def queued_saying_why() -> dict[str, str] | None:
            j = c.get(f"/v1/jobs/{jid}").json()
            return (
                j if j["queue_reason"] and "cannot read the cluster" in j["queue_reason"] else None
            )

        job = wait_for(queued_saying_why, timeout=40, interval=0.2)
        assert job["state"] == "QUEUED", job
        assert [t["to"] for t in job["transitions"]] == ["QUEUED"]
        assert srv.client(None).get("/readyz", timeout=1).status_code == 200
