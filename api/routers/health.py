"""Open routes: liveness, readiness, Prometheus metrics and the dashboard page."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.deps import Ctx
from api.errors import error_body

router = APIRouter(tags=["health"])
STATIC = Path(__file__).resolve().parent.parent / "static"


@router.get("/healthz")
def healthz(ctx: Ctx) -> dict[str, str]:
    """The process is alive; `role` says whether this replica leads (schedules and reconciles) or
    follows (serves the API only), `replica` which one it is. Answers without the database."""
    lead = ctx.leadership
    if lead is None:
        return {"status": "ok", "role": "leader", "replica": "standalone"}
    snap = lead.snapshot()
    return {"status": "ok", "role": snap.role, "replica": snap.replica}


@router.get("/readyz", responses={503: {"description": "the job store is unreachable"}})
async def readyz(ctx: Ctx) -> JSONResponse:
    """Ready while the job store answers. Ray's state is reported in the body but does not gate
    readiness: while the head restarts, the API, the dashboard and the drivers' reports must keep
    reaching this process (a 503 would take it out of its Service), and jobs wait QUEUED for Ray
    meanwhile."""
    checks: dict[str, str] = {}
    try:
        await asyncio.wait_for(asyncio.to_thread(ctx.store.db.ping), timeout=5)
        checks["store"] = "ok"
    except Exception as e:
        checks["store"] = f"{type(e).__name__}: {str(e)[:200]}"
    try:
        await ctx.cluster(max_age_s=2.0)
        checks["ray"] = "ok"
    except Exception as e:
        checks["ray"] = f"unreachable: {type(e).__name__}: {str(e)[:200]}"
    if checks["store"] != "ok":
        return JSONResponse(
            error_body(
                "not_ready",
                f"not ready: store ({checks['store']})",
                details=[{"component": k, "message": v} for k, v in checks.items() if v != "ok"],
            ),
            status_code=503,
        )
    return JSONResponse({"status": "ready", **checks})


@router.get("/metrics", include_in_schema=False)
def metrics(ctx: Ctx) -> Response:
    return Response(generate_latest(ctx.telemetry.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/", include_in_schema=False)
def index() -> Response:
    page = STATIC / "index.html"
    if page.is_file():
        return FileResponse(page, media_type="text/html")
    return HTMLResponse(
        "<!doctype html><title>ringtrain</title><h1>ringtrain</h1>"
        "<p>The dashboard is not installed. The API is documented at <a href='/docs'>/docs</a>.</p>"
    )
