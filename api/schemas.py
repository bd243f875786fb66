"""API response schemas, derived from the storage rows (`service.models`) and the service's
dataclasses.

Models that describe a stored row validate straight from it (`from_attributes`), so a field is named
once in each layer and nothing copies it across by hand; the planner's and launcher's dataclasses,
and the wire schema a driver reports placements in (`RankPlacement`), are used as they are. Fields
whose API name differs from the column (`from`/`to`, `metadata`, `latest_metrics`) say so with
aliases, which also accept the API name: the Python client validates the same models from JSON.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated, Any

import pydantic
from pydantic import AfterValidator, AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field

from service.launcher import NodeInfo
from service.models import Job, Transition
from service.planner import GIB, Fit, Plan
from service.verification import verification_of
from workers.config import JobSpec, MemoryKnobs
from workers.protocol import JobState, RankPlacement


def _from_unix(t: object) -> object:
    """Stored times are unix seconds; the API shows them as UTC datetimes (ISO text from JSON passes
    through)."""
    return datetime.fromtimestamp(t, tz=UTC) if isinstance(t, int | float) else t


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def _none_as_empty_dict(v: object) -> object:
    """Nullable JSON columns read as empty collections (the API never says null for them)."""
    return {} if v is None else v


def _none_as_empty_list(v: object) -> object:
    return [] if v is None else v


UnixTime = Annotated[datetime, BeforeValidator(_from_unix)]
FiniteOrNull = Annotated[float | None, AfterValidator(_finite)]


class _FromRow(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class ErrorInfo(BaseModel):
    code: str
    message: str
    field: str | None = None
    details: list[dict[str, Any]] = []


class ErrorResponse(BaseModel):
    error: ErrorInfo


class TransitionOut(_FromRow):
    seq: int
    time: float = Field(description="unix seconds")
    from_state: JobState | None = Field(
        None, validation_alias=AliasChoices("from_state", "from"), serialization_alias="from"
    )
    to_state: JobState = Field(
        validation_alias=AliasChoices("to_state", "to"), serialization_alias="to"
    )
    reason: str
    resume_step: int | None = None


class LatestMetric(BaseModel):
    step: int
    value: float | None
    seq: int
    time: float


class VerificationOut(BaseModel):
    """The job's check of its distributed math against a one-rank reference, run before step 1."""

    passed: bool
    max_rel_err: float | None = Field(description="largest relative error: logits, every gradient")
    tolerance: float | None = Field(description="the largest error allowed for the compute dtype")
    tokens: int | None = Field(description="length of the random sequence checked")
    seconds: float | None = None
    fp32_rel_err: float | None = Field(None, description="low precision: attention against fp32")


class StageOut(BaseModel):
    """One stage of a job with stages, as it runs (its overrides applied, `auto` resolved)."""

    index: int
    name: str
    seq_len: int
    parallel: dict[str, Any]
    world_size: int
    start_step: int = Field(description="steps done before it: it runs start_step + 1 ..")
    end_step: int
    state: str = Field(description="done, pending, or the job's state for its current stage")


class JobOut(_FromRow):
    """A job row (`service.models.Job`), plus its transitions when the route reads them."""

    id: str
    name: str
    owner: str
    state: JobState
    spec: dict[str, Any]
    created_at: UnixTime
    updated_at: UnixTime
    finished_at: UnixTime | None = None
    step: int
    total_steps: int
    placement: Annotated[list[RankPlacement], BeforeValidator(_none_as_empty_list)]
    error: str | None
    restarts: int
    cancel_requested: bool
    submission_id: str | None
    metadata: Annotated[dict[str, Any], BeforeValidator(_none_as_empty_dict)] = Field(
        {}, validation_alias=AliasChoices("meta", "metadata")
    )
    latest_metrics: Annotated[dict[str, LatestMetric], BeforeValidator(_none_as_empty_dict)] = (
        Field({}, validation_alias=AliasChoices("latest", "latest_metrics"))
    )
    transitions: list[TransitionOut] | None = None
    priority: int = Field(
        0, description="higher starts first when jobs wait for capacity (the spec's priority)"
    )
    queue_position: int | None = Field(
        None,
        description="place in the admission queue (1 = next to start); "
        "null unless the job is waiting QUEUED",
    )
    queue_reason: str | None = Field(
        None, description="why the job waits (capacity, quota, …); null unless waiting"
    )
    verification: VerificationOut | None = Field(
        None, description="the pre-training check of the job's math; null before it, or disabled"
    )
    memory_knobs: str = Field(
        "", description="the spec's memory knobs in words (what the dashboard and CLI show)"
    )
    stages: list[StageOut] | None = Field(None, description="null unless the spec has stages")
    stage: int | None = Field(None, description="index of the current stage; null without stages")

    @pydantic.model_validator(mode="after")
    def _stages_of_spec(self) -> JobOut:
        if not self.spec.get("stages"):
            return self
        try:
            plan = JobSpec.model_validate(self.spec).stage_plan()
        except pydantic.ValidationError:  # stored under other rules: the job still reads back
            return self
        current = next((s.index for s in plan if self.step < s.end_step), plan[-1].index)
        self.stage = current
        self.stages = [
            StageOut(
                index=s.index,
                name=s.name,
                seq_len=s.spec.data.seq_len,
                parallel=s.spec.parallel.model_dump(mode="json"),
                world_size=s.spec.parallel.world_size,
                start_step=s.start_step,
                end_step=s.end_step,
                state="done"
                if self.step >= s.end_step
                else str(self.state.value)
                if s.index == current
                else "pending",
            )
            for s in plan
        ]
        return self

    @pydantic.model_validator(mode="after")
    def _knobs_in_words(self) -> JobOut:
        self.memory_knobs = MemoryKnobs.read(self.spec.get("train", {})).describe()
        return self

    @pydantic.model_validator(mode="after")
    def _only_while_waiting(self) -> JobOut:
        if self.state != JobState.QUEUED or self.cancel_requested:
            self.queue_position = self.queue_reason = None
        return self

    @pydantic.model_validator(mode="after")
    def _verification_from_metrics(self) -> JobOut:
        found = verification_of({k: m.model_dump() for k, m in self.latest_metrics.items()})
        self.verification = VerificationOut.model_validate(found) if found is not None else None
        return self

    @classmethod
    def of(cls, job: Job, transitions: Sequence[Transition] | None = None) -> JobOut:
        """The job row, with `transitions` (rows) when given; the row itself has no relationship to
        load them."""
        out = cls.model_validate(job)
        if transitions is not None:
            out.transitions = [TransitionOut.model_validate(t) for t in transitions]
        return out


class JobList(BaseModel):
    jobs: list[JobOut]
    total: int
    limit: int
    offset: int


class MetricOut(_FromRow):
    seq: int
    step: int
    name: str
    value: FiniteOrNull = Field(description="null when the measured value was NaN or infinite")
    rank: int | None = None
    time: float


class MetricPage(BaseModel):
    job_id: str
    points: list[MetricOut]
    next_after: int = Field(description="pass as ?after= to get the next page")
    has_more: bool


class LogOut(_FromRow):
    seq: int
    time: float
    source: str
    line: str


class LogPage(BaseModel):
    job_id: str
    lines: list[LogOut]
    next_after: int
    has_more: bool
    driver_log: str | None = Field(
        None, description="tail of Ray's driver log, when the cluster has it"
    )


class ClusterOut(BaseModel):
    nodes: list[NodeInfo]
    cpus_total: float
    cpus_free: float
    gpus_total: float
    gpus_free: float


class FitOut(BaseModel):
    """What `plan --fit` chose (or, in a 422, the best candidate and its shortfall)."""

    fits: bool
    memory_per_rank_bytes: int = Field(description="the budget per rank")
    memory_per_rank_gib: float
    budget_source: str = Field(description="given, or which device memory it was read from")
    accelerator: str
    ring_size: int
    ulysses_size: int
    tensor_size: int = Field(1, description="tensor-parallel ranks per replica")
    knobs: dict[str, Any] = Field(description="the train knobs chosen (cheapest first)")
    knobs_name: str
    estimate_bytes: int = Field(description="memory.total_bytes of the chosen spec")
    shortfall_bytes: int = Field(0, description="how much the best candidate exceeds the budget")
    message: str
    alternatives: list[dict[str, Any]] = Field(
        description="candidates tried: ring_size, ulysses_size, tensor_size, knobs, total_bytes, "
        "fits"
    )

    @classmethod
    def of(cls, f: Fit, source: str) -> FitOut:
        return cls(
            fits=f.fits,
            memory_per_rank_bytes=f.memory_per_rank_bytes,
            memory_per_rank_gib=round(f.memory_per_rank_bytes / GIB, 3),
            budget_source=source,
            accelerator=f.accelerator,
            ring_size=f.ring_size,
            ulysses_size=f.ulysses_size,
            tensor_size=f.tensor_size,
            knobs=f.knobs.fields() if f.knobs else {},
            knobs_name=f.knobs.name if f.knobs else "",
            estimate_bytes=int(f.memory.get("total_bytes", 0)),
            shortfall_bytes=f.shortfall_bytes,
            message=f.message,
            alternatives=f.alternatives,
        )


@pydantic.dataclasses.dataclass(kw_only=True)
class PlanOut(Plan):
    """The planner's `Plan`, plus whether the spec can run at all and the spec as validated."""

    valid: bool = Field(description="the spec is valid and the cluster can ever hold it")
    spec: dict[str, Any]
    cluster_error: str | None = None
    fit: FitOut | None = Field(
        None, description="with a fit request: what was chosen; `spec` is then the chosen spec"
    )

    @classmethod
    def of(
        cls,
        spec: dict[str, Any],
        p: Plan,
        cluster_error: str | None = None,
        fit: FitOut | None = None,
    ) -> PlanOut:
        return cls(
            **vars(p),
            valid=p.fits or cluster_error is not None,
            spec=spec,
            cluster_error=cluster_error,
            fit=fit,
        )
