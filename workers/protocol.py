"""The contract between the control plane and a job's driver: what the driver is started with
(`DriverEnv`) and what it reports back (`POST /v1/jobs/{id}/report`).

Defined here, in the lowest layer that produces it; the service and API import these models.
Every item carries the driver's own sequence number (1, 2, 3, ... per job, never reused, also
across driver-side retries): the server applies each item at most once, so re-sending a batch
after a timeout is always safe.
"""

from __future__ import annotations

from enum import StrEnum
from importlib import metadata
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from workers.config import JobSpec


class JobState(StrEnum):
    QUEUED = "QUEUED"
    PLACING = "PLACING"
    RUNNING = "RUNNING"
    RETRYING = "RETRYING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


# Bounds of the store's columns (BIGINT / INTEGER): a larger number is refused here with a 422
# instead of failing inside the database driver (OverflowError → 500). Times must be finite: an
# inf time would be stored and then break every SSE stream of the job (events are strict JSON); a
# NaN one hits a NOT NULL column.
BIG = 2**63 - 1
SMALL = 2**31 - 1
Time = Annotated[float, Field(allow_inf_nan=False, description="unix seconds")]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=True)


class RankPlacement(_Wire):
    """Where one ring rank runs. `device` is e.g. "cuda:0" or "cpu"."""

    rank: int = Field(ge=0, le=SMALL)
    node_id: str
    node_ip: str | None = None
    device: str
    ring: int = Field(
        0,
        ge=0,
        le=SMALL,
        description="the ring this rank belongs to (ranks of one data-parallel replica, Ulysses "
        "rank and tensor rank; the replica itself when ulysses_size = tensor_size = 1)",
    )


class MetricPoint(_Wire):
    """One value of one metric at one step. `rank` is set for per-rank metrics (mem_peak_bytes)."""

    step: int = Field(ge=0, le=BIG)
    name: str = Field(min_length=1, max_length=200)
    value: float
    rank: int | None = Field(None, ge=0, le=SMALL)
    time: Time = Field(description="unix seconds when measured")


class MetricItem(MetricPoint):
    type: Literal["metric"] = "metric"
    seq: int = Field(ge=1, le=BIG)
    replay: bool = Field(
        False,
        description="re-sent from a rank's metrics journal after a failure: "
        "the server skips it when it already holds a point with the same (step, name, rank)",
    )


class StateItem(_Wire):
    """A state change. On RETRYING, `resume_step` tells the server to supersede points after it."""

    type: Literal["state"] = "state"
    seq: int = Field(ge=1, le=BIG)
    state: JobState
    reason: str = Field("", max_length=4000)
    time: Time
    placement: list[RankPlacement] | None = None
    resume_step: int | None = Field(None, ge=0, le=BIG)
    error: str | None = Field(None, max_length=20000)
    metadata: dict[str, str | int | float | bool] | None = None


class LogItem(_Wire):
    type: Literal["log"] = "log"
    seq: int = Field(ge=1, le=BIG)
    time: Time
    source: str = Field("driver", max_length=100, description="driver or rank-N")
    line: str = Field(max_length=20000)


ReportItem = Annotated[MetricItem | StateItem | LogItem, Field(discriminator="type")]


class ReportBatch(_Wire):
    items: list[ReportItem] = Field(max_length=10000)


class ReportAck(BaseModel):
    """The highest driver sequence number the server has durably applied."""

    acked_seq: int


def ringtrain_version() -> str:
    """This installation's ringtrain version ("" when running from a source tree not installed)."""
    try:
        return metadata.version("ringtrain")
    except metadata.PackageNotFoundError:
        return ""


def ray_version() -> str:
    """This installation's Ray version, `ray.__version__` ("" without Ray), read without importing
    Ray (the control plane imports it only to submit)."""
    try:
        return metadata.version("ray")
    except metadata.PackageNotFoundError:
        return ""


class VersionMismatch(RuntimeError):
    """The driver's ringtrain or Ray is not the control plane's: one cluster, two releases."""


class DriverEnv(BaseSettings):
    """The driver's environment: written by the control plane's launcher (`to_env`) into the Ray
    job's runtime_env, read by `python -m workers.driver` (`DriverEnv()`). One model for both sides,
    so they cannot drift."""

    model_config = SettingsConfigDict(env_prefix="RINGTRAIN_", extra="ignore")

    job_id: str = Field(min_length=1)
    control_url: str = Field(
        min_length=1, description="where the driver reports (POST /v1/jobs/{id}/report)"
    )
    ingest_token: str = Field(
        min_length=1, description="this job's report token; never a user's or Ray's"
    )
    checkpoint_dir: str = Field(min_length=1, description="this job's own directory")
    job_spec: JobSpec
    placement_timeout_s: float = Field(600.0, gt=0)
    attempt: int = Field(
        0, ge=0, description="driver attempt: > 0 when the control plane resubmitted a lost driver"
    )
    restarts: int = Field(
        0, ge=0, description="restarts earlier drivers of this job used; this one gets the rest"
    )
    delivered_through: int = Field(
        0,
        ge=0,
        description="the control plane holds every point of steps <= this "
        "(a resubmitted driver replays later ones from the metrics journal)",
    )

    control_plane_version: str = Field(
        default_factory=ringtrain_version,
        description="the launcher's ringtrain version (set on its side); the driver refuses others",
    )
    control_plane_ray_version: str = Field(
        default_factory=ray_version,
        description="the launcher's Ray version (set on its side); the driver refuses others: "
        "ringtrain's version is the same for every build, Ray's tells two Ray releases apart",
    )

    def check_version(self) -> None:
        """Refuse to run under another ringtrain or Ray release than the control plane's: a
        half-upgraded cluster (new control plane, old Ray pods, or the reverse) speaks two versions
        of this contract. An empty version (not sent, or not installed) is not compared."""
        fix = (
            "Run one release everywhere: set the same image tag for the control plane and the "
            "RayCluster and apply both (deploy/README.md, Upgrading); submit the job again then."
        )
        mine = ringtrain_version()
        theirs = self.control_plane_version
        if mine and theirs and mine != theirs:
            raise VersionMismatch(
                f"ringtrain version mismatch: this driver (the Ray image) runs {mine}, the "
                f"control plane {theirs}. {fix}"
            )
        mine, theirs = ray_version(), self.control_plane_ray_version
        if mine and theirs and mine != theirs:
            raise VersionMismatch(
                f"Ray version mismatch: this driver (the Ray image) runs Ray {mine}, the control "
                f"plane Ray {theirs}. {fix}"
            )

    def to_env(self) -> dict[str, str]:
        env = {
            f"RINGTRAIN_{k.upper()}": str(v)
            for k, v in self.model_dump(exclude={"job_spec"}).items()
        }
        env["RINGTRAIN_JOB_SPEC"] = self.job_spec.model_dump_json()
        return env
