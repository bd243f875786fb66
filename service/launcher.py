"""The seam between the control plane and the cluster: how a job's driver is started and watched.

`service.ray_jobs.RayJobLauncher` implements it with Ray's Job Submission API, and
`service.kuberay_jobs.KubeRayJobLauncher` with one KubeRay RayJob per submission (Kueue mode). The
store and the API only know this protocol, so the lifecycle code reads the same whatever runs the
drivers. Besides job drivers, a launcher runs one-off tasks (`run_task`: a dataset's prepare),
watched through the same `status`, `logs` and `stop`.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from workers.config import JobSpec


@dataclass(frozen=True)
class LaunchRequest:
    """Everything a driver needs. `ingest_token` authenticates its reports; never a user's API
    token."""

    job_id: str
    spec: JobSpec
    control_url: str
    ingest_token: str
    checkpoint_dir: str
    attempt: int = 0
    placement_timeout_s: float = 600.0
    restarts: int = (
        0  # restarts the job already used (earlier drivers): the new driver only gets the rest
    )
    delivered_through: int = (
        0  # the store holds every point of steps <= this (the new driver replays the rest)
    )


@dataclass(frozen=True)
class TaskRequest:
    """A one-off command on the cluster that is not a training job (no driver protocol, no ingest
    token): `python -m <module> <args>` with the cluster's own interpreter and `env`. Its output
    (`logs`) is how it reports. `cpus`: what it needs for its own work (`None`: the launcher's
    default, which on per-job clusters is one CPU-only worker pod of the template)."""

    task_id: str
    module: str
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    cpus: float | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def submission_id(self) -> str:
        """Deterministic per task (a retried `run_task` finds the same submission); a DNS label
        for ids made of lowercase letters, digits and dashes."""
        return "ringtrain-" + re.sub(r"[^A-Za-z0-9_-]", "-", self.task_id)[:100]

    def entrypoint(self, python: str) -> str:
        """The shell command line, quoted, for the cluster's interpreter `python`."""
        return " ".join(shlex.quote(a) for a in (python, "-m", self.module, *self.args))


class DriverStatus(StrEnum):
    """Ray's job status, verbatim (infrastructure view of a driver)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    UNKNOWN = (
        "UNKNOWN"  # the submission id is not known to the cluster (e.g. the head was replaced)
    )
    # Not Ray's: the queue system in front of the cluster (Kueue) took back the resources of a
    # driver it had let start. The driver is gone, the submission is not: when admitted again, it
    # starts the same attempt's driver.
    PREEMPTED = "PREEMPTED"

    @property
    def finished(self) -> bool:
        return self in (
            DriverStatus.STOPPED,
            DriverStatus.SUCCEEDED,
            DriverStatus.FAILED,
            DriverStatus.UNKNOWN,
        )


@dataclass(frozen=True)
class DriverInfo:
    status: DriverStatus
    message: str = ""


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    ip: str
    alive: bool
    cpus_total: float
    cpus_free: float
    gpus_total: float
    gpus_free: float
    # What `plan --fit` and `ring_size: auto` size ranks by (0: unknown). memory_bytes: the node's
    # memory for Ray's workers (Ray's `memory` resource); gpu_memory_bytes: one GPU's memory.
    memory_bytes: float = 0.0
    gpu_memory_bytes: float = 0.0


@dataclass(frozen=True)
class ClusterInfo:
    nodes: list[NodeInfo] = field(default_factory=list)
    # Each job brings its own Ray cluster (Kueue mode): running jobs use up no shared capacity, and
    # the queue system in front of the cluster (Kueue's quota) decides when a job starts.
    per_job_clusters: bool = False


class Launcher(Protocol):
    # The PLACING reason once `submit` returned the submission id `{sid}`: where the driver is, what
    # it waits for.
    submitted: str

    def submit(self, req: LaunchRequest) -> str:
        """Start the job's driver; returns its submission id. Same (job_id, attempt) → same id."""
        ...

    def find(self, job_id: str, attempt: int) -> str | None:
        """The submission id of this attempt's driver if the cluster already has it (a leader that
        died between submitting and recording it), else None."""
        ...

    def stop(self, submission_id: str) -> None:
        """Ask the driver to stop (SIGTERM, then kill). Idempotent; unknown ids are ignored."""
        ...

    def status(self, submission_id: str) -> DriverInfo: ...

    def logs(self, submission_id: str) -> str: ...

    def cluster(self) -> ClusterInfo: ...

    def run_task(self, task: TaskRequest) -> str:
        """Start a one-off task (`TaskRequest`); returns its submission id (`task.submission_id`),
        whose `status`, `logs` and `stop` are read like a driver's. The same task again finds the
        running one instead of starting a second."""
        ...
