"""`Launcher` on Ray's Job Submission API (the head's dashboard port, `RINGTRAIN_RAY_ADDRESS`).

Why the Jobs API and not Ray Client: drivers started this way run on the cluster and outlive the
control plane, and the control plane holds no Ray actor. The driver is `python -m workers.driver`,
run with the cluster's own Python environment (the package is installed in the head's venv locally,
in the image on KubeRay), so no working_dir is uploaded.

Token authentication: Ray ≥ 2.52 checks `Authorization: Bearer <token>` on the dashboard/Jobs API
when the cluster runs with `RAY_AUTH_MODE=token`. The token is passed explicitly (`auth_token=`), or
taken from `RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH` or `~/.ray/auth_token`, and sent as a header on
every request; it is never put into a job's environment (drivers inherit the cluster's own auth
settings from the raylet).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
from enum import Enum
from pathlib import Path
from typing import Any

import httpx

from service.launcher import (
    ClusterInfo,
    DriverInfo,
    DriverStatus,
    LaunchRequest,
    NodeInfo,
    TaskRequest,
)
from workers.protocol import DriverEnv

log = logging.getLogger(__name__)

DRIVER_MODULE = "workers.driver"
# Seconds Ray waits between SIGTERM and SIGKILL on `stop_job`: the driver releases everything in a
# few seconds, this leaves room for a final report flush.
STOP_WAIT_S = 15


def submission_id_for(job_id: str, attempt: int) -> str:
    """Deterministic per (job, attempt): resubmitting after a control-plane crash finds the same Ray
    job."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "-", job_id)[:100]
    return f"ringtrain-{safe}-{attempt}"


def find_ray_auth_token() -> str | None:
    """The token a Ray CLI/client on this machine would use (same precedence as Ray)."""
    if tok := os.environ.get("RAY_AUTH_TOKEN"):
        return tok.strip()
    if path := os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return Path(path).expanduser().read_text().strip() or None
    default = Path.home() / ".ray" / "auth_token"
    if default.is_file():
        return default.read_text().strip() or None
    return None


def driver_environment(req: LaunchRequest) -> dict[str, str]:
    """The environment of a job's driver (`workers.protocol.DriverEnv`), whichever launcher starts
    it."""
    ckpt = Path(req.checkpoint_dir).expanduser()
    ckpt = (ckpt if ckpt.is_absolute() else Path.cwd() / ckpt) / req.job_id
    driver = DriverEnv(
        job_id=req.job_id,
        control_url=req.control_url,
        ingest_token=req.ingest_token,
        checkpoint_dir=str(ckpt),
        job_spec=req.spec,
        placement_timeout_s=req.placement_timeout_s,
        attempt=req.attempt,
        restarts=req.restarts,
        delivered_through=req.delivered_through,
    )
    return {
        **driver.to_env(),
        "RAY_JOB_STOP_WAIT_TIME_S": str(STOP_WAIT_S),
        "PYTHONUNBUFFERED": "1",
    }


class RayJobLauncher:
    submitted = "driver submitted to Ray (submission {sid})"

    def __init__(
        self,
        address: str,
        *,
        auth_token: str | None = None,
        python: str = "python",
        extra_env: dict[str, str] | None = None,
        entrypoint_num_cpus: float = 0.0,
        entrypoint_resources: dict[str, float] | None = None,
    ) -> None:
        """`address`: the Jobs API, e.g. `http://head-svc:8265`. `python`: the interpreter on the
        cluster. `entrypoint_resources`: custom Ray resources each driver needs, so it runs on the
        nodes that advertise them (a small drivers' group on KubeRay), not on the head, whose
        restart would otherwise end every driver."""
        self.address = address if "://" in address else f"http://{address}"
        self.address = self.address.rstrip("/")
        self.auth_token = auth_token if auth_token is not None else find_ray_auth_token()
        self.headers = {"Authorization": f"Bearer {self.auth_token}"} if self.auth_token else {}
        self.python = python
        self.extra_env = dict(extra_env or {})
        self.entrypoint_num_cpus = entrypoint_num_cpus
        self.entrypoint_resources = dict(entrypoint_resources or {})
        self._client_obj: Any = None

    @property
    def _client(self) -> Any:
        """Created lazily: the constructor already talks to the cluster (version check)."""
        if self._client_obj is None:
            from ray.job_submission import JobSubmissionClient

            self._client_obj = JobSubmissionClient(self.address, headers=dict(self.headers))
        return self._client_obj

    # -- Launcher protocol -------------------------------------------------------------------------
    def submit(self, req: LaunchRequest) -> str:
        sid = submission_id_for(req.job_id, req.attempt)
        env = {**self.extra_env, **driver_environment(req)}
        try:
            self._client.submit_job(
                entrypoint=f"{shlex.quote(self.python)} -m {DRIVER_MODULE}",
                submission_id=sid,
                runtime_env={"env_vars": env},
                metadata={"ringtrain_job_id": req.job_id[:200], "attempt": str(req.attempt)},
                entrypoint_num_cpus=self.entrypoint_num_cpus,
                entrypoint_resources=self.entrypoint_resources or None,
            )
        except RuntimeError as e:
            if _ray_error(e) is not _RayError.EXISTS:
                raise
            log.info("Ray job %s already submitted; not submitting again", sid)
        return sid

    def run_task(self, task: TaskRequest) -> str:
        """A Ray job on the shared cluster. Its entrypoint asks for `task.cpus` (default none: it
        only plans and waits, its Ray tasks ask for their own); no `entrypoint_resources`, which
        are the drivers' group's."""
        sid = task.submission_id
        try:
            self._client.submit_job(
                entrypoint=task.entrypoint(self.python),
                submission_id=sid,
                runtime_env={"env_vars": {**self.extra_env, **task.env}},
                metadata={k: v[:200] for k, v in task.metadata.items()},
                entrypoint_num_cpus=task.cpus or 0.0,
            )
        except RuntimeError as e:
            if _ray_error(e) is not _RayError.EXISTS:
                raise
            log.info("Ray job %s already submitted; not submitting again", sid)
        return sid

    def find(self, job_id: str, attempt: int) -> str | None:
        sid = submission_id_for(job_id, attempt)
        return None if self.status(sid).status == DriverStatus.UNKNOWN else sid

    def stop(self, submission_id: str) -> None:
        try:
            self._client.stop_job(submission_id)
        except RuntimeError as e:
            if _ray_error(e) is not _RayError.NOT_FOUND:
                raise

    def status(self, submission_id: str) -> DriverInfo:
        try:
            info = self._client.get_job_info(submission_id)
        except RuntimeError as e:
            if _ray_error(e) is _RayError.NOT_FOUND:
                return DriverInfo(DriverStatus.UNKNOWN, f"Ray does not know job {submission_id}")
            raise
        status = getattr(info.status, "value", str(info.status))
        try:
            mapped = DriverStatus(status)
        except ValueError:
            mapped = DriverStatus.UNKNOWN
        return DriverInfo(mapped, info.message or "")

    def logs(self, submission_id: str) -> str:
        try:
            return str(self._client.get_job_logs(submission_id))
        except RuntimeError as e:
            if _ray_error(e) is _RayError.NOT_FOUND:
                return ""
            raise

    def cluster(self) -> ClusterInfo:
        """Nodes from the state API, free resources from the cluster status (both on the dashboard
        port)."""
        with httpx.Client(base_url=self.address, headers=self.headers, timeout=10) as http:
            nodes = http.get("/api/v0/nodes", params={"limit": 10000, "detail": "true"})
            nodes.raise_for_status()
            usage_resp = http.get("/api/cluster_status")
            usage_resp.raise_for_status()
        rows = nodes.json().get("data", {}).get("result", {}).get("result", [])
        load = (usage_resp.json().get("data", {}).get("clusterStatus") or {}).get(
            "loadMetricsReport"
        ) or {}
        usage: dict[str, dict[str, list[float]]] = load.get("usageByNode") or {}
        out = []
        for row in rows:
            nid = row.get("node_id", "")
            total = row.get("resources_total") or {}
            used = usage.get(nid, {})
            alive = row.get("state") == "ALIVE"

            def free(
                key: str,
                total: dict[str, Any] = total,
                used: dict[str, list[float]] = used,
                alive: bool = alive,
            ) -> float:
                t = float(total.get(key, 0.0))
                if not alive:
                    return 0.0
                u = used.get(key)
                return max(0.0, t - float(u[0])) if u else t

            out.append(
                NodeInfo(
                    node_id=nid,
                    ip=row.get("node_ip", ""),
                    alive=alive,
                    cpus_total=float(total.get("CPU", 0.0)),
                    cpus_free=free("CPU"),
                    gpus_total=float(total.get("GPU", 0.0)),
                    gpus_free=free("GPU"),
                    memory_bytes=float(total.get("memory", 0.0)),
                )
            )
        return ClusterInfo(nodes=out)


class _RayError(Enum):
    NOT_FOUND = "not found"
    EXISTS = "already exists"
    OTHER = "other"


def _ray_error(e: RuntimeError) -> _RayError:
    """What a JobSubmissionClient error means. Ray raises a bare RuntimeError carrying the HTTP
    status and the server's message, so its text is the only signal: read here, once, and nowhere
    else."""
    text = str(e).lower()
    if "already exists" in text:
        return _RayError.EXISTS
    if "404" in text or "does not exist" in text or "not found" in text:
        return _RayError.NOT_FOUND
    return _RayError.OTHER
