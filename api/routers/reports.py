"""POST /v1/jobs/{id}/report: the driver's batched metric points, state changes and log lines.

Authenticated by the job's ingest token only (a new one per driver attempt). Items with seq ≤ the
stored high-water mark are ignored (re-sending is safe); new items apply in order in one
transaction; a gap answers 409 with `{"acked_seq": N}` (resend from N + 1); success answers
`ReportAck{acked_seq}`. Once the job is terminal every report answers 409 `job_ended` (no
`acked_seq`) and changes nothing. Rate-limited per job (`RINGTRAIN_RATE_REPORT_*`, sized far above a
healthy driver's ~5 batches/s); a request whose token fails counts against its address instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials

from api.deps import AppContext, Ctx, bearer, client_address, get_ctx, throttle
from api.errors import ApiError
from api.routers.jobs import JobId
from api.schemas import ErrorResponse
from service.store import JobEnded, ReportGap
from workers.protocol import ReportAck, ReportBatch


def _check_ingest(
    ctx: AppContext,
    job_id: str,
    creds: HTTPAuthorizationCredentials | None,
    address: str = "unknown",
) -> None:
    if creds is None or not ctx.store.tokens.check(job_id, creds.credentials):
        throttle(ctx, "unauth", address)
        raise ApiError(
            401,
            "this route takes the job's ingest token (drivers only)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    throttle(ctx, "report", job_id)


class IngestAuthRoute(APIRoute):
    """Checks the ingest token before FastAPI reads and parses the body.

    FastAPI parses a declared body before it solves dependencies: with the check only in a
    dependency, an anonymous client would get 400/422 (not 401) and make the server parse up to
    `max_report_bytes` of JSON first.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def authenticated(request: Request) -> Response:
            job_id = str(request.path_params.get("job_id", ""))
            creds = await bearer(request)
            await asyncio.to_thread(
                _check_ingest, get_ctx(request), job_id, creds, client_address(request)
            )
            request.state.ingest_job = job_id
            return await handler(request)

        return authenticated


router = APIRouter(prefix="/v1/jobs", tags=["reports"], route_class=IngestAuthRoute)


def ingest_auth(
    request: Request,
    job_id: JobId,
    ctx: Ctx,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> str:
    """The job id, once its ingest token is verified (by `IngestAuthRoute`, or here when mounted
    without it)."""
    if getattr(request.state, "ingest_job", None) != job_id:
        _check_ingest(ctx, job_id, creds, client_address(request))
    return job_id


@router.post(
    "/{job_id}/report",
    response_model=ReportAck,
    responses={
        400: {"model": ErrorResponse},
        401: {"model": ErrorResponse},
        409: {
            "description": "sequence gap (body has acked_seq), "
            "or the job has ended (code job_ended)"
        },
        429: {"model": ErrorResponse},
        413: {"model": ErrorResponse},
        422: {"model": ErrorResponse},
    },
)
def report(job_id: Annotated[str, Depends(ingest_auth)], batch: ReportBatch, ctx: Ctx) -> ReportAck:
    t = ctx.telemetry
    try:
        res = ctx.store.metrics.apply_report(job_id, batch.items)
    except JobEnded as e:
        t.reports.labels("ended").inc()
        raise ApiError(
            409,
            f"the job has ended ({e.state}): its ingest token no longer reports; "
            "nothing was applied",
            code="job_ended",
            extra={"state": e.state},
        ) from e
    except ReportGap as g:
        t.reports.labels("gap").inc()
        raise ApiError(
            409,
            f"report sequence gap: the server has everything up to seq {g.acked_seq}; "
            f"resend from {g.acked_seq + 1}",
            code="sequence_gap",
            extra={"acked_seq": g.acked_seq},
        ) from g
    t.points.inc(res.points)
    if res.applied_to is not None:
        t.reports.labels("gap").inc()
        raise ApiError(
            409,
            f"report sequence gap inside the batch after seq {res.applied_to}; "
            f"resend from {res.applied_to + 1}",
            code="sequence_gap",
            extra={"acked_seq": res.applied_to},
        )
    t.reports.labels("ok").inc()
    return ReportAck(acked_seq=res.acked_seq)
