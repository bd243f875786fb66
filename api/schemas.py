"""API response schemas (separate from the storage models in `service.models`)."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from service.models import Job, LogLine, MetricPointRow, Transition
from service.planner import Plan
from workers.protocol import JobState


def _dt(t: float | None) -> datetime | None:
    return None if t is None else datetime.fromtimestamp(t, tz=UTC)


class ErrorInfo(BaseModel):
    code: str
    message: str
    field: str | None = None
    details: list[dict[str, Any]] = []


class ErrorResponse(BaseModel):
    error: ErrorInfo


class Placement(BaseModel):
    rank: int
    node_id: str
    device: str
    node_ip: str | None = None
    ring: int = 0


class TransitionOut(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    seq: int
    time: float = Field(description="unix seconds")
    from_state: JobState | None = Field(None, alias="from")
    to_state: JobState = Field(alias="to")
    reason: str
    resume_step: int | None = None

    @classmethod
    def of(cls, t: Transition) -> TransitionOut:
        return cls(
            seq=t.seq,
            time=t.time,
            from_state=t.from_state,
            to_state=t.to_state,
            reason=t.reason,
            resume_step=t.resume_step,
        )


class LatestMetric(BaseModel):
    step: int
    value: float | None
    seq: int
    time: float


class JobOut(BaseModel):
    id: str
    name: str
    owner: str
    state: JobState
    spec: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None = None
    step: int
    total_steps: int
    placement: list[Placement]
    error: str | None
    restarts: int
    cancel_requested: bool
    submission_id: str | None
    metadata: dict[str, Any] = {}
    latest_metrics: dict[str, LatestMetric] = {}
    transitions: list[TransitionOut] | None = None

    @classmethod
    def of(cls, job: Job, transitions: list[Transition] | None = None) -> JobOut:
        return cls(
            id=job.id,
            name=job.name,
            owner=job.owner,
            state=job.state,
            spec=job.spec,
            created_at=_dt(job.created_at),
            updated_at=_dt(job.updated_at),
            finished_at=_dt(job.finished_at),
            step=job.step,
            total_steps=job.total_steps,
            placement=[Placement.model_validate(p) for p in (job.placement or [])],
            error=job.error,
            restarts=job.restarts,
            cancel_requested=job.cancel_requested,
            submission_id=job.submission_id,
            metadata=job.meta or {},
            latest_metrics={k: LatestMetric.model_validate(v) for k, v in (job.latest or {}).items()},
            transitions=None if transitions is None else [TransitionOut.of(t) for t in transitions],
        )


class JobList(BaseModel):
    jobs: list[JobOut]
    total: int
    limit: int
    offset: int


class MetricOut(BaseModel):
    seq: int
    step: int
    name: str
    value: float | None = Field(description="null when the measured value was NaN or infinite")
    rank: int | None = None
    time: float

    @classmethod
    def of(cls, p: MetricPointRow) -> MetricOut:
        v = p.value if p.value is not None and math.isfinite(p.value) else None
        return cls(seq=p.seq, step=p.step, name=p.name, value=v, rank=p.rank, time=p.time)


class MetricPage(BaseModel):
    job_id: str
    points: list[MetricOut]
    next_after: int = Field(description="pass as ?after= to get the next page")
    has_more: bool


class LogOut(BaseModel):
    seq: int
    time: float
    source: str
    line: str

    @classmethod
    def of(cls, r: LogLine) -> LogOut:
        return cls(seq=r.seq, time=r.time, source=r.source, line=r.line)


class LogPage(BaseModel):
    job_id: str
    lines: list[LogOut]
    next_after: int
    has_more: bool
    driver_log: str | None = Field(None, description="tail of Ray's driver log, when the cluster has it")


class NodeOut(BaseModel):
    node_id: str
    ip: str
    alive: bool
    cpus_total: float
    cpus_free: float
    gpus_total: float
    gpus_free: float


class ClusterOut(BaseModel):
    nodes: list[NodeOut]
    cpus_total: float
    cpus_free: float
    gpus_total: float
    gpus_free: float


class RankSlotOut(BaseModel):
    rank: int
    ring: int
    node_id: str
    device: str


class PlanOut(BaseModel):
    valid: bool = Field(description="the spec is valid and the cluster can ever hold it")
    fits: bool
    spec: dict[str, Any]
    accelerator: str
    strategy: str
    world_size: int
    bundle: dict[str, float]
    placement: list[RankSlotOut]
    nodes_used: int
    node_crossings: int
    memory: dict[str, Any]
    warnings: list[str]
    cluster_error: str | None = None

    @classmethod
    def of(cls, spec: dict[str, Any], p: Plan, cluster_error: str | None = None) -> PlanOut:
        return cls(
            valid=p.fits or cluster_error is not None,
            fits=p.fits,
            spec=spec,
            accelerator=p.accelerator,
            strategy=p.strategy,
            world_size=p.world_size,
            bundle=p.bundle,
            placement=[RankSlotOut(**vars(s)) for s in p.placement],
            nodes_used=p.nodes_used,
            node_crossings=p.node_crossings,
            memory=p.memory,
            warnings=p.warnings,
            cluster_error=cluster_error,
        )
