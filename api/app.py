"""The FastAPI application factory: `create_app(settings, launcher=None)`.

The database must already be at the newest schema (`ringtrain db upgrade`; `serve` runs it first
unless `--no-migrate` / `RINGTRAIN_MIGRATE_ON_START=false`):
building the app checks it and refuses with that command otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.staticfiles import StaticFiles

from api import errors
from api.audit import AuditMiddleware
from api.body import YAML_TYPES, BodyLimitMiddleware
from api.deps import AppContext
from api.ratelimit import Limit, RateLimiter
from api.routers import (
    artifacts,
    audit,
    cluster,
    dashboard,
    datasets,
    evals,
    events,
    health,
    jobs,
    metrics,
    reports,
)
from api.security import SecurityHeadersMiddleware
from api.telemetry import Telemetry, TelemetryMiddleware, setup_logging
from service.controller import Controller
from service.db import listen_dsn, make_engine, require_current
from service.hub import Hub, Relay
from service.launcher import ClusterInfo, DriverInfo, Launcher, LaunchRequest, TaskRequest
from service.leader import Leadership, new_replica_id, refuse_second_sqlite_replica
from service.settings import Settings, ensure_tokens
from service.store import EventBus, Store
from service.store.database import WriteGuard
from service.tracking import exporter_for
from workers.config import JobSpec

log = logging.getLogger("ringtrain.api")


class NoClusterLauncher:
    """Used when no Ray address is configured: every call explains how to configure one."""

    MESSAGE = (
        "no Ray cluster configured: set RINGTRAIN_RAY_ADDRESS, or use `ringtrain serve` "
        "(starts a local head)"
    )
    submitted = "driver submitted (submission {sid})"

    def submit(self, req: LaunchRequest) -> str:
        raise RuntimeError(self.MESSAGE)

    def find(self, job_id: str, attempt: int) -> str | None:
        return None

    def stop(self, submission_id: str) -> None:
        return None

    def status(self, submission_id: str) -> DriverInfo:
        raise RuntimeError(self.MESSAGE)

    def logs(self, submission_id: str) -> str:
        raise RuntimeError(self.MESSAGE)

    def cluster(self) -> ClusterInfo:
        raise RuntimeError(self.MESSAGE)

    def run_task(self, task: TaskRequest) -> str:
        raise RuntimeError(self.MESSAGE)


def default_launcher(settings: Settings) -> Launcher:
    if settings.kuberay_rayjob_template:  # Kueue mode: one RayJob (own cluster) per job
        from service.kuberay_jobs import KubeRayJobLauncher

        return KubeRayJobLauncher.from_file(
            settings.kuberay_rayjob_template,
            api_url=settings.kubernetes_api,
            namespace=settings.kuberay_namespace,
        )
    if not settings.ray_address:
        return NoClusterLauncher()
    from service.ray_jobs import RayJobLauncher

    return RayJobLauncher(settings.ray_address, entrypoint_resources=settings.driver_resources)


def create_app(settings: Settings | None = None, launcher: Launcher | None = None) -> FastAPI:
    settings = settings or Settings()
    setup_logging(settings.log_level)
    tokens = ensure_tokens(settings)
    engine = make_engine(settings.database_url, settings.db)
    try:
        require_current(engine)  # upgrading is its own step: `ringtrain db upgrade`
    except Exception:
        engine.dispose()
        raise
    hub = Hub()
    bus = EventBus()
    store = Store(engine, bus)
    if store.db.is_sqlite:  # one replica per SQLite file: a second one is refused here
        try:
            refuse_second_sqlite_replica(store, socket.gethostname(), os.getpid())
        except Exception:
            engine.dispose()
            raise
    replica = new_replica_id()
    exporter = exporter_for(settings, store)
    launcher = launcher or default_launcher(settings)
    controller = Controller(settings, store, launcher)

    def elected(guard: WriteGuard, acting: Callable[[], bool]) -> None:
        """This replica leads: the control loops, and the tracking export (the leader's only)."""
        controller.start(guard, acting)
        if exporter is not None:
            exporter.start(acting)

    async def deposed() -> None:
        await controller.stop()
        if exporter is not None:
            await asyncio.to_thread(exporter.stop)

    leadership = Leadership(
        store,
        lease_s=settings.leader_lease_s,
        on_elected=elected,
        on_deposed=deposed,
        replica=replica,
    )
    loop: list[asyncio.AbstractEventLoop] = []  # the app's loop, once it runs

    def remote_events(job_id: str | None, seq: int, state: bool) -> None:
        """Another replica stored events: SSE subscribers here read them from the store, and a
        new or changed job wakes this replica's scheduler (when it leads)."""
        hub.refresh(job_id)
        if exporter is not None:  # the leader exports what any replica stored
            exporter.remote(job_id)
        if state and loop:
            loop[0].call_soon_threadsafe(controller.wake)

    relay = None
    if not store.db.is_sqlite:
        relay = Relay(listen_dsn(settings.database_url, settings.db), replica, remote_events)
    # every consumer of committed job events, in one place
    bus.listen("sse", hub.publish)
    if relay is not None:
        bus.listen("replicas", relay.published)
    if exporter is not None:  # marks jobs only while this replica leads (exporter.start)
        bus.listen("tracking", exporter.notify)
    telemetry = Telemetry(store, leadership)
    ctx = AppContext(
        settings=settings,
        store=store,
        hub=hub,
        launcher=launcher,
        controller=controller,
        tokens=tokens,
        telemetry=telemetry,
        limiter=limiter(settings),
        leadership=leadership,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop.append(asyncio.get_running_loop())
        if relay is not None:
            relay.start()
        try:
            await leadership.start()  # leads at once when it can; the scheduler runs on the leader
        except Exception:
            if relay is not None:
                await asyncio.to_thread(relay.stop)
            engine.dispose()
            raise
        log.info(
            "control plane up (replica %s, %s); drivers report to %s",
            replica,
            leadership.snapshot().role,
            settings.control_url,
        )
        try:
            yield
        finally:
            await leadership.stop()  # stops the control loops and the export, gives the lease up
            if relay is not None:
                await asyncio.to_thread(relay.stop)
            if exporter is not None:
                await asyncio.to_thread(exporter.stop)
            engine.dispose()

    app = RingtrainApp(
        title="ringtrain",
        version="0.1.0",
        lifespan=lifespan,
        description="Long-context training jobs with exact ring attention on Ray.",
    )
    app.state.ctx = ctx
    errors.install(app)
    for r in (
        jobs.router,
        events.router,
        reports.router,
        cluster.router,
        dashboard.router,
        health.router,
    ):
        app.include_router(r)
    app.include_router(audit.router)
    app.include_router(artifacts.router)
    app.include_router(metrics.router)
    app.include_router(datasets.router)
    app.include_router(evals.router)
    app.mount("/static", StaticFiles(directory=health.STATIC, check_dir=False), name="static")
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_body_bytes,
        max_report_bytes=settings.max_report_bytes,
    )
    app.add_middleware(AuditMiddleware, store=store)
    app.add_middleware(SecurityHeadersMiddleware)
    app.add_middleware(TelemetryMiddleware, telemetry=telemetry)
    return app


def limiter(settings: Settings) -> RateLimiter:
    on = settings.rate_limits
    return RateLimiter(
        {
            "api": Limit(settings.rate_api_per_s if on else 0, settings.rate_api_burst),
            "report": Limit(settings.rate_report_per_s if on else 0, settings.rate_report_burst),
            "unauth": Limit(settings.rate_unauth_per_s if on else 0, settings.rate_unauth_burst),
        }
    )


class RingtrainApp(FastAPI):
    def openapi(self) -> dict[str, Any]:
        """The generated schema, plus the JobSpec request body (JSON or YAML) of the routes that
        parse it."""
        if self.openapi_schema:
            return self.openapi_schema
        self.openapi_schema = _with_jobspec_bodies(
            get_openapi(
                title=self.title,
                version=self.version,
                description=self.description,
                routes=self.routes,
            )
        )
        return self.openapi_schema


def _with_jobspec_bodies(schema: dict[str, Any]) -> dict[str, Any]:
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    js = JobSpec.model_json_schema(ref_template="#/components/schemas/{model}")
    comps.update(js.pop("$defs", {}))
    comps["JobSpec"] = js
    ref = {"$ref": "#/components/schemas/JobSpec"}
    for ops in schema.get("paths", {}).values():
        for op in ops.values():
            if isinstance(op, dict) and op.pop("x-jobspec-body", False):
                content = {"application/json": {"schema": ref}}
                content.update(
                    {t: {"schema": ref} for t in sorted(YAML_TYPES) if t == "application/yaml"}
                )
                op["requestBody"] = {"required": True, "content": content}
    return schema
