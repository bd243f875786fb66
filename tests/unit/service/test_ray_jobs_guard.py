"""`RayJobLauncher` and its helpers (service/ray_jobs.py), in process and without Ray.

Ray's JobSubmissionClient is replaced by a recording stand-in that answers as Ray does (a bare
RuntimeError naming the HTTP status); `cluster()` reads a tiny HTTP server on 127.0.0.1 that
answers the dashboard's two routes with hand-written figures. What is pinned: the submission id
(deterministic, sanitized, truncated), the auth token's sources and header, the driver's
environment (the driver's own keys win over the launcher's extra ones), what `submit` hands Ray,
how Ray's errors and statuses are read, and free resources as total minus used on alive nodes.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from service.launcher import DriverStatus, LaunchRequest, NodeInfo, TaskRequest
from service.ray_jobs import RayJobLauncher, find_ray_auth_token, submission_id_for
from tests.support.api_harness import TINY_SPEC
from workers.config import JobSpec

SID = "ringtrain-j-1-3"


def request(**kw: Any) -> LaunchRequest:
    base: dict[str, Any] = dict(
        job_id="j/1",
        spec=JobSpec.model_validate(TINY_SPEC),
        control_url="http://ringtrain-api:8000",
        ingest_token="ingest-j1-3",
        checkpoint_dir="ckpts",
        attempt=3,
        restarts=1,
        delivered_through=7,
    )
    return LaunchRequest(**{**base, **kw})


class Jobs:
    """JobSubmissionClient as the launcher uses it; `errors[method]` is raised as Ray would."""

    def __init__(self) -> None:
        self.submitted: list[dict[str, Any]] = []
        self.stopped: list[str] = []
        self.errors: dict[str, str] = {}
        self.info = SimpleNamespace(status=SimpleNamespace(value="RUNNING"), message="step 4")

    def _raise(self, method: str) -> None:
        if method in self.errors:
            raise RuntimeError(self.errors[method])

    def submit_job(self, **kw: Any) -> str:
        self._raise("submit_job")
        self.submitted.append(kw)
        return str(kw["submission_id"])

    def stop_job(self, sid: str) -> bool:
        self._raise("stop_job")
        self.stopped.append(sid)
        return True

    def get_job_info(self, sid: str) -> Any:
        self._raise("get_job_info")
        return self.info

    def get_job_logs(self, sid: str) -> str:
        self._raise("get_job_logs")
        return "the log"


def launcher(**kw: Any) -> tuple[RayJobLauncher, Jobs]:
    kw.setdefault("auth_token", "")
    ray = RayJobLauncher("head:8265/", **kw)
    jobs = ray._client_obj = Jobs()
    return ray, jobs


NOT_FOUND = "Request failed with status code 404: Job {} does not exist."
EXISTS = "Request failed with status code 400: Job ringtrain-j-1-3 already exists."
REFUSED = "Request failed with status code 500: internal error"


def test_submission_ids_are_sanitized_and_truncated() -> None:
    assert submission_id_for("j/1.x y", 3) == "ringtrain-j-1-x-y-3"
    assert submission_id_for("Ab_c-9", 0) == "ringtrain-Ab_c-9-0"
    assert submission_id_for("a" * 150, 12) == "ringtrain-" + "a" * 100 + "-12"


def test_the_auth_token_comes_from_ray_s_places_in_ray_s_order(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert find_ray_auth_token() is None
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("from-home\n")
    assert find_ray_auth_token() == "from-home"
    (tmp_path / "tok").write_text("  from-path \n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "tok"))
    assert find_ray_auth_token() == "from-path"
    monkeypatch.setenv("RAY_AUTH_TOKEN", " from-env\n")
    assert find_ray_auth_token() == "from-env"
    ray = RayJobLauncher("https://head:8265")  # no auth_token: found as above
    assert ray.headers == {"Authorization": "Bearer from-env"}
    assert ray.address == "https://head:8265"
    assert launcher(auth_token="")[0].headers == {}  # explicitly none: no header at all


def test_submit_hands_ray_the_driver_with_its_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    ray, jobs = launcher(
        python="/opt/my venv/bin/python",
        extra_env={"HF_HOME": "/cache", "PYTHONUNBUFFERED": "0", "RINGTRAIN_JOB_ID": "spoofed"},
        entrypoint_num_cpus=0.5,
        entrypoint_resources={"ringtrain_driver": 1.0},
    )
    assert ray.address == "http://head:8265"
    assert ray.submit(request()) == SID
    (sub,) = jobs.submitted
    env = sub.pop("runtime_env")["env_vars"]
    assert sub == {
        "entrypoint": "'/opt/my venv/bin/python' -m workers.driver",
        "submission_id": SID,
        "metadata": {"ringtrain_job_id": "j/1", "attempt": "3"},
        "entrypoint_num_cpus": 0.5,
        "entrypoint_resources": {"ringtrain_driver": 1.0},
    }
    assert {k: env[k] for k in ("HF_HOME", "PYTHONUNBUFFERED", "RAY_JOB_STOP_WAIT_TIME_S")} == {
        "HF_HOME": "/cache",
        "PYTHONUNBUFFERED": "1",
        "RAY_JOB_STOP_WAIT_TIME_S": "15",
    }
    assert env["RINGTRAIN_JOB_ID"] == "j/1" and env["RINGTRAIN_ATTEMPT"] == "3"
    assert env["RINGTRAIN_CHECKPOINT_DIR"] == str(tmp_path / "ckpts" / "j/1")
    jobs.errors["submit_job"] = EXISTS  # resubmitted after a crash: Ray has it already
    assert ray.submit(request()) == SID
    jobs.errors["submit_job"] = REFUSED
    with pytest.raises(RuntimeError, match="500"):
        ray.submit(request())


def test_a_task_asks_for_its_cpus_and_no_driver_resources() -> None:
    ray, jobs = launcher(extra_env={"A": "1"}, entrypoint_resources={"ringtrain_driver": 1.0})
    task = TaskRequest("ds-1", "workers.data.prepare", ("x y",), {"B": "2"}, 2.5, {"k": "v" * 300})
    assert ray.run_task(task) == "ringtrain-ds-1"
    (sub,) = jobs.submitted
    assert sub == {
        "entrypoint": "python -m workers.data.prepare 'x y'",
        "submission_id": "ringtrain-ds-1",
        "runtime_env": {"env_vars": {"A": "1", "B": "2"}},
        "metadata": {"k": "v" * 200},
        "entrypoint_num_cpus": 2.5,
    }


def test_ray_s_answers_read_as_driver_statuses() -> None:
    ray, jobs = launcher()
    assert (ray.status(SID).status, ray.status(SID).message) == (DriverStatus.RUNNING, "step 4")
    assert ray.find("j/1", 3) == SID
    jobs.info = SimpleNamespace(status="SOMETHING_NEW", message=None)
    assert (ray.status(SID).status, ray.status(SID).message) == (DriverStatus.UNKNOWN, "")
    jobs.errors["get_job_info"] = NOT_FOUND.format(SID)
    assert ray.status(SID).status == DriverStatus.UNKNOWN and ray.find("j/1", 3) is None
    jobs.errors["get_job_info"] = "Request failed with status code 404"
    assert ray.status(SID).status == DriverStatus.UNKNOWN
    jobs.errors["get_job_info"] = REFUSED
    with pytest.raises(RuntimeError, match="500"):
        ray.status(SID)


def test_stop_and_logs_of_a_job_ray_does_not_know_are_no_error() -> None:
    ray, jobs = launcher()
    ray.stop(SID)
    assert jobs.stopped == [SID] and ray.logs(SID) == "the log"
    jobs.errors.update(stop_job=NOT_FOUND.format(SID), get_job_logs=NOT_FOUND.format(SID))
    ray.stop(SID)
    assert ray.logs(SID) == ""
    jobs.errors.update(stop_job=REFUSED, get_job_logs=REFUSED)
    with pytest.raises(RuntimeError, match="500"):
        ray.stop(SID)
    with pytest.raises(RuntimeError, match="500"):
        ray.logs(SID)


NODES = [
    {
        "node_id": "n1",
        "node_ip": "10.0.0.1",
        "state": "ALIVE",
        "resources_total": {"CPU": 16.0, "GPU": 4.0, "memory": 6.4e10},
    },
    {
        "node_id": "n2",
        "node_ip": "10.0.0.2",
        "state": "DEAD",
        "resources_total": {"CPU": 8.0, "GPU": 2.0, "memory": 3.2e10},
    },
    {"node_id": "n3", "node_ip": "10.0.0.3", "state": "ALIVE", "resources_total": {"CPU": 4.0}},
]
# usageByNode: resource -> [used, total]
USAGE = {"n1": {"CPU": [5.0, 16.0], "GPU": [3.0, 4.0]}, "n2": {"CPU": [1.0, 8.0]}}


@pytest.fixture
def dashboard() -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """The two dashboard routes `cluster()` reads, on 127.0.0.1; records (path, Authorization)."""
    seen: list[tuple[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append((self.path, self.headers.get("Authorization", "")))
            if self.path.startswith("/api/v0/nodes"):
                body: Any = {"data": {"result": {"result": NODES}}}
            elif self.path == "/api/cluster_status":
                body = {"data": {"clusterStatus": {"loadMetricsReport": {"usageByNode": USAGE}}}}
            else:
                self.send_error(404)
                return
            raw = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", seen
    finally:
        server.shutdown()
        server.server_close()


def test_cluster_free_is_total_minus_used_on_alive_nodes(
    dashboard: tuple[str, list[tuple[str, str]]],
) -> None:
    url, seen = dashboard
    info = RayJobLauncher(url, auth_token="tok-123").cluster()
    assert info.nodes == [
        NodeInfo("n1", "10.0.0.1", True, 16.0, 11.0, 4.0, 1.0, 6.4e10),
        NodeInfo("n2", "10.0.0.2", False, 8.0, 0.0, 2.0, 0.0, 3.2e10),
        NodeInfo("n3", "10.0.0.3", True, 4.0, 4.0, 0.0, 0.0, 0.0),
    ]
    assert [a for _, a in seen] == ["Bearer tok-123"] * 2
    assert seen[0][0].startswith("/api/v0/nodes?") and "detail=true" in seen[0][0]
