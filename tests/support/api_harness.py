"""Shared helpers for the control-plane tests: a real uvicorn server on a loopback port, a temporary
SQLite file (or a PostgreSQL URL), and a launcher that records calls so tests can play the driver by
POSTing real reports to the real server."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from api.app import create_app
from service.db import upgrade
from service.launcher import (
    ClusterInfo,
    DriverInfo,
    DriverStatus,
    LaunchRequest,
    NodeInfo,
    TaskRequest,
)
from service.settings import Settings
from tests.support.dist import free_port
from workers.protocol import JobState

ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789"
TOKENS = {ALICE: "alice", BOB: "bob"}

TINY_SPEC: dict[str, Any] = {
    "name": "tiny",
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
    "data": {"kind": "passkey", "seq_len": 128},
    "parallel": {"ring_size": 2},
    "train": {"steps": 5},
}


@dataclass
class RecordingLauncher:
    """Records submits, tasks and stops; `status` answers from `statuses` (default RUNNING)."""

    nodes: list[NodeInfo] = field(
        default_factory=lambda: [
            NodeInfo("node-a", "10.0.0.1", True, 8, 8, 0, 0),
            NodeInfo("node-b", "10.0.0.2", True, 8, 8, 0, 0),
        ]
    )
    submits: list[LaunchRequest] = field(default_factory=list)
    tasks: list[TaskRequest] = field(default_factory=list)
    stops: list[str] = field(default_factory=list)
    statuses: dict[str, DriverInfo] = field(default_factory=dict)
    fail_submits: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    submitted: str = "driver submitted to Ray (submission {sid})"

    def submit(self, req: LaunchRequest) -> str:
        with self.lock:
            if self.fail_submits > 0:
                self.fail_submits -= 1
                raise ConnectionError("Ray dashboard unreachable")
            self.submits.append(req)
            return f"ringtrain-{req.job_id}-{req.attempt}"

    def run_task(self, task: TaskRequest) -> str:
        with self.lock:
            self.tasks.append(task)
        return task.submission_id

    def find(self, job_id: str, attempt: int) -> str | None:
        with self.lock:
            done = any(r.job_id == job_id and r.attempt == attempt for r in self.submits)
        return f"ringtrain-{job_id}-{attempt}" if done else None

    def stop(self, submission_id: str) -> None:
        with self.lock:
            self.stops.append(submission_id)
            self.statuses[submission_id] = DriverInfo(DriverStatus.STOPPED, "stopped by request")

    def status(self, submission_id: str) -> DriverInfo:
        return self.statuses.get(submission_id, DriverInfo(DriverStatus.RUNNING))

    def logs(self, submission_id: str) -> str:
        return f"ray driver log of {submission_id}\n"

    def cluster(self) -> ClusterInfo:
        return ClusterInfo(nodes=list(self.nodes))

    def request_for(self, job_id: str) -> LaunchRequest:
        with self.lock:
            return next(r for r in reversed(self.submits) if r.job_id == job_id)


def roomy_launcher() -> RecordingLauncher:
    """A recording launcher whose cluster holds thousands of tiny jobs. Its drivers never finish, so a test that
    creates many jobs on the default two 8-CPU nodes sees all but the first few held QUEUED by admission."""
    return RecordingLauncher(nodes=[NodeInfo("node-big", "10.0.0.9", True, 100_000, 100_000, 0, 0)])


def upgraded(settings: Settings) -> Settings:
    """The settings' database brought to the newest schema: the step `ringtrain serve` runs before
    the app (building the app only checks it). Every test that builds an app calls this first
    (`Server` does)."""
    upgrade(settings.database_url)
    return settings


class Server:
    """A real uvicorn server in a thread, started as `ringtrain serve` starts one: the database
    upgraded first, then `create_app(settings, launcher)`."""

    def __init__(self, settings: Settings, launcher: Any) -> None:
        self.settings = upgraded(settings)
        self.launcher = launcher
        self.app = create_app(settings, launcher)
        cfg = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=settings.port,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=2,
        )
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{settings.port}"

    def start(self) -> Server:
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        if (
            self.thread.is_alive()
        ):  # a connection or task outlived the graceful window: do not leave it running
            self.server.force_exit = True
            self.thread.join(timeout=10)

    def client(self, token: str | None = ALICE, **kw: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=kw.pop("timeout", 10), **kw)


def make_settings(tmp: Path, database_url: str | None = None, **over: Any) -> Settings:
    port = free_port()
    base: dict[str, Any] = dict(
        database_url=database_url or f"sqlite:///{tmp}/ringtrain.db",
        api_tokens=TOKENS,
        port=port,
        checkpoint_dir=str(tmp / "ckpt"),
        data_roots=[str(tmp)],
        scheduler_interval_s=0.05,
        reconcile_interval_s=0.1,
        reconcile_grace_s=0.3,
        cancel_grace_s=5.0,
        sse_ping_s=1.0,
        token_file=tmp / "token",
        log_level="WARNING",
        rate_limits=False,  # tests send far faster than any user; the limits are tested on their own (test_security)
    )
    base.update(over)
    return Settings(**base)


@contextlib.contextmanager
def running(tmp: Path, launcher: Any = None, **over: Any) -> Iterator[Server]:
    srv = Server(
        make_settings(tmp, **over), launcher if launcher is not None else RecordingLauncher()
    ).start()
    try:
        yield srv
    finally:
        srv.stop()


def wait_for(pred: Any, timeout: float = 10.0, interval: float = 0.02) -> Any:
    deadline = time.time() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.time() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)


class Driver:
    """Plays a job's driver over the real report protocol (ingest token from the recording launcher, or given)."""

    def __init__(self, srv: Server, job_id: str, token: str | None = None) -> None:
        self.srv = srv
        self.job_id = job_id
        if token is None:
            req = wait_for(
                lambda: next((r for r in srv.launcher.submits if r.job_id == job_id), None)
            )
            token = req.ingest_token
            # the launcher has the request; the controller records the submission id (then PLACING) right after,
            # and tests act on that id (cancel stops it, the reconciler polls it): wait until it is stored
            jobs = srv.app.state.ctx.store.jobs
            wait_for(lambda: (j := jobs.get(job_id)).submission_id or JobState(j.state).terminal)
        self.token = token
        self.seq = 0
        self.http = srv.client(self.token)

    def item(self, type_: str, **kw: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": type_, "seq": self.seq, "time": time.time(), **kw}

    def post(self, items: list[dict[str, Any]]) -> httpx.Response:
        return self.http.post(f"/v1/jobs/{self.job_id}/report", json={"items": items})

    def state(self, state: str, **kw: Any) -> httpx.Response:
        return self.post([self.item("state", state=state, **kw)])

    def metrics(self, steps: range, names: tuple[str, ...] = ("loss",)) -> httpx.Response:
        return self.post(
            [self.item("metric", step=s, name=n, value=1.0 / (s + 1)) for s in steps for n in names]
        )
