"""Shared Ray fixtures: one private Ray head per test session, and an in-test report receiver.

`ray_head` starts `service.local_ray.LocalRayHead` (explicit free ports, unique temp dir, token auth on) once per
session and yields its `RayHead`: `.jobs_url` (Jobs API, for `RayJobLauncher` / `JobSubmissionClient(headers=
head.headers)`), `.gcs_address`, `.auth_token`, `.headers` (HTTP) and `.client_env()` (env for a Ray driver
process: `RAY_AUTH_MODE=token`, `RAY_AUTH_TOKEN`). Never `ray.init()` inside the pytest process: run drivers in
subprocesses with `client_env()`, so the session's Ray state stays clean for every test.

`ReportReceiver` implements the report semantics of `POST /v1/jobs/{id}/report` (idempotent by seq, 409 on a
gap, supersede on `resume_step`, replays held once) for tests that run drivers without the real API.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from service.local_ray import LocalRayHead, RayHead


@pytest.fixture(scope="session")
def ray_head() -> Iterator[RayHead]:
    head = LocalRayHead(num_cpus=8)  # stops without Ray's drain (`LocalRayHead.start`)
    try:
        yield head.start()
    finally:
        head.stop()


def ray_state(head: RayHead, kind: str, **filters: str) -> list[dict[str, Any]]:
    """Ray's state API over HTTP (`kind`: actors, placement_groups, nodes), filtered by equality."""
    params: list[tuple[str, str | int]] = [("limit", 10000), ("detail", "true")]
    for k, v in filters.items():
        params += [("filter_keys", k), ("filter_predicates", "="), ("filter_values", v)]
    r = httpx.get(f"{head.jobs_url}/api/v0/{kind}", params=params, headers=head.headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"]["result"]["result"]


@dataclass
class JobRecord:
    token: str
    acked: int = 0
    points: list[dict[str, Any]] = field(default_factory=list)  # stored (after supersede)
    states: list[dict[str, Any]] = field(default_factory=list)
    logs: list[dict[str, Any]] = field(default_factory=list)
    arrival: list[int] = field(default_factory=list)  # seqs in the order they were applied
    requests: int = 0
    superseded: int = 0


class ReportReceiver:
    """A tiny control-plane stand-in (http.server). `down()` / `up()` make it unreachable and back, same port."""

    def __init__(self) -> None:
        self.jobs: dict[str, JobRecord] = {}
        self.lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self.port = 0
        self.up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add_job(self, job_id: str, token: str) -> JobRecord:
        with self.lock:
            self.jobs[job_id] = JobRecord(token=token)
            return self.jobs[job_id]

    def up(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                parts = self.path.strip("/").split("/")
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if len(parts) != 4 or parts[:2] != ["v1", "jobs"] or parts[3] != "report":
                    return self._send(404, {"message": "not found"})
                code, payload = receiver.handle(
                    parts[2], self.headers.get("Authorization", ""), body
                )
                self._send(code, payload)

            def _send(self, code: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
        ).start()

    def down(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def handle(self, job_id: str, auth: str, body: bytes) -> tuple[int, dict[str, Any]]:
        with self.lock:
            job = self.jobs.get(job_id)
            if job is None:
                return 404, {"message": "no such job"}
            if auth != f"Bearer {job.token}":
                return 401, {"message": "bad ingest token"}
            job.requests += 1
            items = json.loads(body)["items"]
            for it in items:
                seq = it["seq"]
                if seq <= job.acked:
                    continue
                if seq > job.acked + 1:
                    return 409, {"message": "gap", "acked_seq": job.acked}
                job.acked = seq
                job.arrival.append(seq)
                if it["type"] == "metric":
                    key = (it["step"], it["name"], it.get("rank"))
                    if it.get("replay") and any(
                        (p["step"], p["name"], p.get("rank")) == key for p in job.points
                    ):
                        continue  # the store's rule: a replayed point it already holds is skipped
                    job.points.append(it)
                elif it["type"] == "state":
                    job.states.append(it)
                    if it.get("resume_step") is not None:
                        before = len(job.points)
                        job.points = [p for p in job.points if p["step"] <= it["resume_step"]]
                        job.superseded += before - len(job.points)
                else:
                    job.logs.append(it)
            return 200, {"acked_seq": job.acked}

    def wait_state(self, job_id: str, states: set[str], timeout_s: float) -> dict[str, Any]:
        """Wait until the job's latest reported state is one of `states`; returns that state item."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                job = self.jobs[job_id]
                if job.states and job.states[-1]["state"] in states:
                    return job.states[-1]
            time.sleep(0.2)
        with self.lock:
            seen = [(s["state"], s["reason"]) for s in self.jobs[job_id].states]
        raise TimeoutError(
            f"job {job_id} did not reach {states} in {timeout_s}s; states so far: {seen}"
        )

    def close(self) -> None:
        self.down()


@pytest.fixture()
def report_receiver() -> Iterator[ReportReceiver]:
    r = ReportReceiver()
    try:
        yield r
    finally:
        r.close()
