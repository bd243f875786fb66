"""Open routes: liveness, readiness, Prometheus metrics and the dashboard page.

Readiness follows the job store only: a slow or absent Ray head must not take the replicas out of
their Service (the API, the dashboard and the drivers' reports keep working; jobs wait QUEUED).
Ray's state is checked in the background (`RayWatch`) and reported, from memory, by /healthz and
/metrics, so no probe ever waits on Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from api.deps import AppContext, Ctx
from api.errors import error_body
from service.launcher import ClusterInfo

STATIC = Path(__file__).resolve().parent.parent / "static"
READY_TIMEOUT_S = 2.0  # well inside the readiness probe's own timeout (deploy/: 5 s)


class RayWatch:
    """Ray's state as the last background check saw it: "unknown" (no check finished yet), "ok" or
    "unreachable". One check runs at a time on a thread of its own; a check that hangs counts as
    unreachable after `timeout_s` and is awaited again next round instead of starting another."""

    def __init__(
        self, cluster: Callable[[], ClusterInfo], interval_s: float, timeout_s: float
    ) -> None:
        self.cluster = cluster
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.state = "unknown"
        self.error = ""
        self.checked: float | None = None  # monotonic time of the last verdict
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ringtrain-ray-watch")
        self._pending: asyncio.Future[ClusterInfo] | None = None
        self._since = 0.0  # monotonic: when the pending call started

    async def check(self) -> None:
        if self._pending is None or self._pending.done():
            self._pending = asyncio.wrap_future(self._pool.submit(self.cluster))
            self._pending.add_done_callback(_retrieve)
            self._since = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(self._pending), self.timeout_s)
            self.state, self.error = "ok", ""
        except TimeoutError:
            waited = time.monotonic() - self._since
            self.state, self.error = "unreachable", f"no answer for {waited:.1f} s"
        except Exception as e:
            self.state, self.error = "unreachable", f"{type(e).__name__}: {str(e)[:200]}"
        self.checked = time.monotonic()

    async def run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.interval_s)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def age_s(self) -> float | None:
        return None if self.checked is None else time.monotonic() - self.checked


def _retrieve(f: asyncio.Future[Any]) -> None:
    """A failed check nobody awaits any more (shutdown) is not an 'exception never retrieved'."""
    if not f.cancelled():
        f.exception()


class _RayCollector(Collector):
    def __init__(self, watch: RayWatch) -> None:
        self.watch = watch

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "ringtrain_ray_up",
            "1 when the last background check reached the Ray cluster, 0 when it did not "
            "(absent until the first check ends)",
        )
        age = GaugeMetricFamily("ringtrain_ray_check_age_seconds", "since the last Ray check")
        if (seen := self.watch.age_s()) is not None:
            up.add_metric([], 1.0 if self.watch.state == "ok" else 0.0)
            age.add_metric([], seen)
        yield up
        yield age


@asynccontextmanager
async def watch_ray(app: FastAPI) -> AsyncIterator[None]:
    """Part of the app's lifespan (merged in by `include_router`): the background Ray check."""
    ctx: AppContext = app.state.ctx
    s = ctx.settings
    watch = RayWatch(ctx.launcher.cluster, s.ray_check_interval_s, s.ray_check_timeout_s)
    app.state.ray_watch = watch
    ctx.ray_down = lambda: watch.error if watch.state == "unreachable" else None
    collector = _RayCollector(watch)
    ctx.telemetry.registry.register(collector)
    task = asyncio.create_task(watch.run(), name="ringtrain-ray-watch")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        watch.close()
        ctx.telemetry.registry.unregister(collector)


router = APIRouter(tags=["health"], lifespan=watch_ray)


@router.get("/healthz")
def healthz(ctx: Ctx, request: Request) -> dict[str, Any]:
    """The process is alive; `role` says whether this replica leads (schedules and reconciles) or
    follows (serves the API only), `replica` which one it is, `ray` what the last background check
    of the Ray cluster found ("ok", "unreachable" with `ray_error`, or "unknown" before the first
    one ends). Answers without the database and without calling Ray."""
    lead = ctx.leadership
    if lead is None:
        out: dict[str, Any] = {"status": "ok", "role": "leader", "replica": "standalone"}
    else:
        snap = lead.snapshot()
        out = {"status": "ok", "role": snap.role, "replica": snap.replica}
    watch: RayWatch | None = getattr(request.app.state, "ray_watch", None)
    out["ray"] = watch.state if watch is not None else "unknown"
    if watch is not None and watch.error:
        out["ray_error"] = watch.error
    return out


@router.get("/readyz", responses={503: {"description": "the job store is unreachable"}})
async def readyz(ctx: Ctx) -> JSONResponse:
    """Ready while the job store answers (within a short timeout); nothing else gates it."""
    try:
        await asyncio.wait_for(asyncio.to_thread(ctx.store.db.ping), timeout=READY_TIMEOUT_S)
    except Exception as e:
        why = f"{type(e).__name__}: {str(e)[:200]}"
        if isinstance(e, TimeoutError):
            why = f"no answer within {READY_TIMEOUT_S:g} s"
        return JSONResponse(
            error_body(
                "not_ready",
                f"not ready: store ({why})",
                details=[{"component": "store", "message": why}],
            ),
            status_code=503,
        )
    return JSONResponse({"status": "ready", "store": "ok"})


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
