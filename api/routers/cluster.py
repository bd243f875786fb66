"""POST /v1/plan (dry run of a spec) and GET /v1/cluster."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api.body import check_data_path, parse_spec
from api.deps import Ctx, Owner
from api.errors import ApiError
from api.routers.jobs import ERRORS, SPEC_BODY
from api.schemas import ClusterOut, ErrorResponse, PlanOut
from service import admission
from service.launcher import ClusterInfo
from service.planner import plan

router = APIRouter(prefix="/v1", tags=["cluster"])


@router.post(
    "/plan",
    response_model=PlanOut,
    openapi_extra=SPEC_BODY,
    responses={**ERRORS, 400: {"model": ErrorResponse}, 413: {"model": ErrorResponse}},
)
async def plan_job(request: Request, ctx: Ctx, owner: Owner) -> PlanOut:
    """Validate a spec against the live cluster and preview placement and memory. Reserves nothing."""
    spec = parse_spec(await request.body(), request.headers.get("content-type"))
    check_data_path(spec, ctx.settings.resolved_data_roots())
    cluster_error = None
    try:
        cluster = admission.with_autoscaler(
            await ctx.cluster(max_age_s=1.0), ctx.settings.autoscaler_nodes
        )
    except Exception as e:
        cluster, cluster_error = ClusterInfo(), f"cannot read the cluster: {type(e).__name__}: {e}"
    p = plan(spec, cluster)
    if cluster_error:
        p.warnings.insert(0, cluster_error + " — placement not previewed")
    return PlanOut.of(spec.model_dump(mode="json"), p, cluster_error)


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
            f"the Ray cluster is unreachable ({type(e).__name__}: {e}); check RINGTRAIN_RAY_ADDRESS",
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
