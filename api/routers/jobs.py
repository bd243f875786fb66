"""/v1/jobs: create, list, read, cancel, metric points and logs."""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Response

from api.body import check_data_path, parse_spec
from api.deps import AppContext, Ctx, Owner
from api.errors import ApiError
from api.schemas import (
    ErrorResponse,
    FitOut,
    JobList,
    JobOut,
    LogOut,
    LogPage,
    MetricOut,
    MetricPage,
)
from service import admission, capacity
from service.elastic import elastic_refusal
from service.init_from import InitFromRefused, resolve_init_from
from service.launcher import ClusterInfo
from service.planner import GIB, device_memory, plan, resolve_pipeline_split
from service.verification import Outcome, verification_is
from workers.config import JobSpec, with_overrides
from workers.protocol import JobState

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
log = logging.getLogger("ringtrain.api")

JobId = Annotated[
    str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$", description="job id")
]
Seq = Annotated[int, Query(ge=0, le=2**62, description="only entries with seq greater than this")]
ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse},
    404: {"model": ErrorResponse},
    422: {"model": ErrorResponse},
}
SPEC_BODY = {"x-jobspec-body": True}


async def check_against_cluster(ctx: AppContext, spec: JobSpec) -> ClusterInfo | None:
    """Reject a job the whole cluster can never hold (a cluster we cannot read is not checked here);
    returns the cluster as read (None when it could not be)."""
    try:
        seen = await ctx.cluster()
    except Exception as e:  # what a launcher raises: Ray down, no cluster configured, a timeout
        why = f"{type(e).__name__}: {str(e)[:300]}"
        log.warning("a new job is not checked against the cluster: cannot read it (%s)", why)
        return None
    cluster = admission.with_autoscaler(seen, ctx.settings.autoscaler_nodes)
    if not any(n.alive for n in cluster.nodes):
        return cluster
    for stage in spec.stage_plan():  # each stage is placed on its own
        p = plan(stage.spec, cluster)
        if not p.fits:  # with alive nodes, the planner says no only when the cluster is too small
            shapes = ctx.settings.autoscaler_nodes
            limit = (
                f" (counted with what the autoscaler may add: {capacity.growth_limit(shapes)})"
                if shapes
                else ""
            )
            field = f"stages.{stage.index}.parallel.ring_size" if spec.stages else None
            raise ApiError(422, p.warnings[0] + limit, field=field or "parallel.ring_size")
    return cluster


def fit_or_422(
    spec: JobSpec, cluster: ClusterInfo, memory_per_rank_gib: float | None, field: str
) -> tuple[JobSpec, FitOut]:
    """The spec `fit` chooses (plan --fit, ring_size auto); 422 with the best candidate's shortfall
    (in `fit`) when nothing fits, or naming the missing budget when the devices' memory is
    unknown."""
    budget = None if memory_per_rank_gib is None else int(memory_per_rank_gib * GIB)
    source = "given" if budget is not None else device_memory(spec, cluster)[1]
    try:
        chosen, result = capacity.fit_spec(spec, cluster, budget)
    except capacity.FitError as e:
        if e.result is None:  # no budget: say which one to give
            give = (
                "give a number (`ringtrain plan SPEC --fit --memory-per-rank GIB` suggests one)"
                if field == "parallel.ring_size"
                else "give fit.memory_per_rank_gib (ringtrain plan --memory-per-rank GIB)"
            )
            raise ApiError(422, f"{e}: {give}", field=field) from e
        out = FitOut.of(e.result, source).model_dump(mode="json")
        raise ApiError(422, str(e), field=field, extra={"fit": out}) from e
    return chosen, FitOut.of(result, source)


async def resolve_ring_auto(ctx: AppContext, spec: JobSpec) -> JobSpec:
    """`parallel.ring_size: auto`: the spec `fit` chooses against the devices' memory; per stage
    for a job with stages (each stage's choice stored as its overrides)."""
    try:
        cluster = admission.with_autoscaler(await ctx.cluster(), ctx.settings.autoscaler_nodes)
    except Exception as e:
        why = f"{type(e).__name__}: {str(e)[:300]}"
        raise ApiError(
            422,
            "parallel.ring_size auto is resolved against the cluster, "
            f"which cannot be read ({why}); give a ring_size",
            field="parallel.ring_size",
        ) from e
    if not spec.stages:
        return fit_or_422(spec, cluster, None, "parallel.ring_size")[0]
    resolved: dict[int, dict[str, dict[str, Any]]] = {}
    for stage in spec.stage_plan():
        if stage.spec.parallel.ring_auto:
            field = f"stages.{stage.index}.parallel.ring_size"
            chosen = fit_or_422(stage.spec, cluster, None, field)[0]
            shape = chosen.parallel.model_dump(include={"ring_size", "ulysses_size", "tensor_size"})
            resolved[stage.index] = {"parallel": shape, "train": chosen.train.knobs.fields()}
    return with_overrides(spec, resolved)


def check_against_quota(
    ctx: AppContext, owner: str, spec: JobSpec, cluster: ClusterInfo | None
) -> None:
    """Reject a job that alone is over its owner's quota: it could never leave the queue."""
    quota = ctx.settings.quotas.get(owner)
    gpu = admission.uses_gpus(spec, cluster or ClusterInfo())
    why = admission.never_within_quota(owner, admission.demand_of(spec, gpu), quota)
    if why is not None:
        raise ApiError(
            422, f"the job alone is over its owner's quota: {why}", field="parallel.ring_size"
        )


@router.post(
    "",
    status_code=201,
    response_model=JobOut,
    openapi_extra=SPEC_BODY,
    responses={
        **ERRORS,
        400: {"model": ErrorResponse},
        413: {"model": ErrorResponse},
        415: {"model": ErrorResponse},
    },
)
async def create_job(request: Request, response: Response, ctx: Ctx, owner: Owner) -> JobOut:
    """Create a job from a spec (JSON, or YAML with `Content-Type: application/yaml`). It starts
    QUEUED."""
    spec = parse_spec(await request.body(), request.headers.get("content-type"))
    check_data_path(spec, ctx.settings.resolved_data_roots())
    if spec.init_from is not None:
        try:
            spec = await asyncio.to_thread(
                resolve_init_from,
                spec,
                owner,
                ctx.store,
                ctx.settings.checkpoint_dir,
                ctx.settings.resolved_data_roots(),
            )
        except InitFromRefused as e:
            raise ApiError(422, str(e), field=e.field) from e
    if any(s.spec.parallel.ring_auto for s in spec.stage_plan()):
        spec = await resolve_ring_auto(ctx, spec)  # now, against the devices' memory; stored so
    spec = resolve_pipeline_split(spec)  # `auto`: the planner's balanced split, stored
    cluster = await check_against_cluster(ctx, spec)
    if (refused := elastic_refusal(spec, cluster)) is not None:
        raise ApiError(422, refused[1], field=refused[0])
    check_against_quota(ctx, owner, spec, cluster)
    if cluster is not None and any(n.alive for n in cluster.nodes):  # else resolved at admission
        spec = capacity.with_accelerator_resolved(
            spec, cluster
        )  # stored: a resubmitted driver never re-decides `auto`
    # the ingest token the driver uses is (re)generated when the job is handed to the launcher
    job = await asyncio.to_thread(ctx.store.jobs.create, owner, spec, secrets.token_urlsafe(32))
    ctx.controller.wake()
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    transitions = await asyncio.to_thread(ctx.store.jobs.transitions, job.id)
    return JobOut.of(job, transitions)


@router.get("", response_model=JobList, responses=ERRORS)
def list_jobs(
    ctx: Ctx,
    owner: Owner,
    state: Annotated[
        list[JobState] | None, Query(description="repeat to match several states")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=2**31)] = 0,
    verification: Annotated[
        Outcome | None,
        Query(description="only jobs whose pre-training verification passed / failed"),
    ] = None,
) -> JobList:
    """Your jobs, newest first."""
    where = [verification_is(verification)] if verification is not None else []
    jobs, total = ctx.store.jobs.page(owner, [s.value for s in state or []], limit, offset, where)
    return JobList(jobs=[JobOut.of(j) for j in jobs], total=total, limit=limit, offset=offset)


@router.get("/{job_id}", response_model=JobOut, responses=ERRORS)
def get_job(job_id: JobId, ctx: Ctx, owner: Owner) -> JobOut:
    """State, spec, placement, progress, latest metrics, error and the full transition history."""
    job = ctx.store.jobs.get(job_id, owner)
    return JobOut.of(job, ctx.store.jobs.transitions(job_id))


@router.post("/{job_id}/cancel", status_code=202, response_model=JobOut, responses=ERRORS)
async def cancel_job(request: Request, job_id: JobId, ctx: Ctx, owner: Owner) -> JobOut:
    """Ask the job to stop. Idempotent: cancelling a finished job changes nothing."""
    await ctx.controller.cancel(job_id, owner)
    job = await asyncio.to_thread(ctx.store.jobs.get, job_id, owner)
    if JobState(job.state).terminal and not job.cancel_requested:
        request.state.audit_outcome = (
            "already_ended"  # the audit row says the cancel changed nothing
        )
    return JobOut.of(job, await asyncio.to_thread(ctx.store.jobs.transitions, job_id))


@router.get("/{job_id}/metrics", response_model=MetricPage, responses=ERRORS)
def job_metrics(
    job_id: JobId,
    ctx: Ctx,
    owner: Owner,
    after: Seq = 0,
    limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
    name: Annotated[
        list[str] | None, Query(max_length=50, description="only these metric names")
    ] = None,
) -> MetricPage:
    """Metric points in seq order. Page with `after=<next_after>` while `has_more`."""
    ctx.store.jobs.get(job_id, owner)
    names = [n[:200] for n in name] if name else None
    rows = ctx.store.metrics.points(job_id, after, limit + 1, names)
    more = len(rows) > limit
    rows = rows[:limit]
    return MetricPage(
        job_id=job_id,
        points=[MetricOut.model_validate(p) for p in rows],
        next_after=rows[-1].seq if rows else after,
        has_more=more,
    )


@router.get("/{job_id}/logs", response_model=LogPage, responses=ERRORS)
async def job_logs(
    job_id: JobId,
    ctx: Ctx,
    owner: Owner,
    after: Seq = 0,
    limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
    driver: Annotated[bool, Query(description="include the tail of Ray's driver log")] = True,
    tail_bytes: Annotated[int, Query(ge=0, le=1 << 22)] = 65536,
) -> LogPage:
    """Log lines the driver reported (driver and ranks), plus the tail of Ray's own driver log."""
    job = await asyncio.to_thread(ctx.store.jobs.get, job_id, owner)
    rows = await asyncio.to_thread(ctx.store.metrics.logs, job_id, after, limit + 1)
    more = len(rows) > limit
    rows = rows[:limit]
    driver_log = None
    if driver and job.submission_id:
        try:
            text = await asyncio.wait_for(
                asyncio.to_thread(ctx.launcher.logs, job.submission_id), timeout=10
            )
            driver_log = text[-tail_bytes:] if tail_bytes else ""
        except Exception:
            driver_log = None
    return LogPage(
        job_id=job_id,
        lines=[LogOut.model_validate(r) for r in rows],
        next_after=rows[-1].seq if rows else after,
        has_more=more,
        driver_log=driver_log,
    )
