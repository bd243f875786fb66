"""POST /v1/plan (dry run of a spec) and GET /v1/cluster."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.body import JSON_TYPES, check_data_path, parse_spec
from api.deps import Ctx, Owner
from api.errors import ApiError
from api.routers.jobs import ERRORS, SPEC_BODY, fit_or_422, resolve_ring_auto
from api.schemas import ClusterOut, ErrorResponse, FitOut, PlanOut
from service import admission
from service.launcher import ClusterInfo
from service.planner import plan, resolve_pipeline_split

router = APIRouter(prefix="/v1", tags=["cluster"])


class FitRequest(BaseModel):
    """`fit` in a wrapped plan body: the memory budget per rank (None: the devices' memory)."""

    model_config = ConfigDict(extra="forbid")
    memory_per_rank_gib: float | None = Field(None, gt=0, le=1e6)


def unwrap_plan_body(body: bytes, ctype: str | None) -> tuple[bytes, str | None, FitRequest | None]:
    """`{"spec": ..., "fit": {...}}` -> (the spec as JSON, its type, the fit request); any other
    body is the spec itself (JSON or YAML), as before."""
    if (ctype or "").split(";")[0].strip().lower() not in JSON_TYPES:
        return body, ctype, None
    try:
        data: Any = json.loads(body)
    except (ValueError, RecursionError):
        return body, ctype, None  # parse_spec says what is wrong with it
    if not isinstance(data, dict) or "spec" not in data:
        return body, ctype, None
    if extra := sorted(set(data) - {"spec", "fit"}):
        raise ApiError(
            422, f"a wrapped plan body has spec and fit only, not {extra}", field=extra[0]
        )
    try:
        request = FitRequest.model_validate(data.get("fit") or {})
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in ("fit", *first["loc"]))
        raise ApiError(422, f"{where}: {first['msg']}", field=where) from e
    return json.dumps(data["spec"]).encode(), "application/json", request


@router.post(
    "/plan",
    response_model=PlanOut,
    openapi_extra=SPEC_BODY,
    responses={**ERRORS, 400: {"model": ErrorResponse}, 413: {"model": ErrorResponse}},
)
async def plan_job(
    request: Request,
    ctx: Ctx,
    owner: Owner,
    fit: Annotated[
        bool, Query(description="choose ring x Ulysses and knobs to fit the memory budget")
    ] = False,
    fit_memory_per_rank_gib: Annotated[
        float | None,
        Query(gt=0, le=1e6, description="the budget per rank for fit (default: the devices')"),
    ] = None,
) -> PlanOut:
    """Validate a spec against the live cluster and preview placement and memory. Reserves nothing.

    Fit: a body `{"spec": ..., "fit": {"memory_per_rank_gib": X}}` (or the spec as the body with
    `?fit=true[&fit_memory_per_rank_gib=X]`) returns, in `spec`, the spec it would run: the smallest
    sequence group and the cheapest knobs whose estimate fits X GiB (default: the devices' memory);
    422 with the best candidate's shortfall when nothing fits. `parallel.ring_size: auto` is always
    resolved so."""
    body, ctype, wrapped = unwrap_plan_body(
        await request.body(), request.headers.get("content-type")
    )
    spec = parse_spec(body, ctype)
    check_data_path(spec, ctx.settings.resolved_data_roots())
    budget = wrapped.memory_per_rank_gib if wrapped else fit_memory_per_rank_gib
    fitting = wrapped is not None or fit or fit_memory_per_rank_gib is not None
    cluster_error = None
    try:
        cluster = admission.with_autoscaler(
            await ctx.cluster(max_age_s=1.0), ctx.settings.autoscaler_nodes
        )
    except Exception as e:
        cluster, cluster_error = ClusterInfo(), f"cannot read the cluster: {type(e).__name__}: {e}"
    chosen: FitOut | None = None
    if spec.stages:  # each stage is fitted (ring_size auto) and placed on its own
        if fitting:
            raise ApiError(
                422,
                "a job with stages is fitted stage by stage: set parallel.ring_size: auto (for "
                "the job or in a stage) instead of asking for fit",
                field="fit",
            )
        if any(st.spec.parallel.ring_auto for st in spec.stage_plan()):
            spec = await resolve_ring_auto(ctx, spec)
    elif fitting or spec.parallel.ring_auto:
        field = "fit.memory_per_rank_gib" if fitting else "parallel.ring_size"
        spec, chosen = fit_or_422(spec, cluster, budget, field)
    spec = resolve_pipeline_split(spec)  # the split `auto` chooses, as submission stores it
    p = plan(spec.largest_stage().spec if spec.stages else spec, cluster)
    if cluster_error:
        p.warnings.insert(0, cluster_error + " - placement not previewed")
    return PlanOut.of(spec.model_dump(mode="json"), p, cluster_error, chosen)


@router.get(
    "/cluster",
    response_model=ClusterOut,
    responses={401: {"model": ErrorResponse}, 503: {"model": ErrorResponse}},
)
async def get_cluster(ctx: Ctx, owner: Owner) -> ClusterOut:
    """Nodes with CPUs/GPUs free and total."""
    try:
        c = await ctx.cluster(max_age_s=1.0)
    except Exception as e:
        raise ApiError(
            503,
            f"the Ray cluster is unreachable ({type(e).__name__}: {e}); "
            "check RINGTRAIN_RAY_ADDRESS",
            code="ray_unavailable",
        ) from e
    alive = [n for n in c.nodes if n.alive]
    return ClusterOut(
        nodes=c.nodes,
        cpus_total=sum(n.cpus_total for n in alive),
        cpus_free=sum(n.cpus_free for n in alive),
        gpus_total=sum(n.gpus_total for n in alive),
        gpus_free=sum(n.gpus_free for n in alive),
    )
