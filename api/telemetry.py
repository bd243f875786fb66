"""Prometheus metrics (one registry per app) and structured (JSON-lines) request logs. No tokens
logged."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.leader import Leadership
from service.store import Store
from workers.protocol import JobState

log = logging.getLogger("ringtrain.access")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for k in ("method", "route", "status", "duration_ms", "owner", "job_id"):
            if hasattr(record, k):
                out[k] = getattr(record, k)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class _JsonLinesHandler(logging.StreamHandler[TextIO]):
    """Our handler on the `ringtrain` logger: its class marks it, so a second app in one process
    adds no other."""


def setup_logging(level: str = "INFO") -> None:
    root = logging.getLogger("ringtrain")
    if not any(isinstance(h, _JsonLinesHandler) for h in root.handlers):
        h = _JsonLinesHandler(sys.stderr)
        h.setFormatter(JsonFormatter())
        root.addHandler(h)
        root.propagate = False
    root.setLevel(level.upper())


class _JobsByState(Collector):
    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily("ringtrain_jobs", "jobs by state", labels=["state"])
        try:
            counts = self.store.jobs.counts_by_state()
        except Exception:
            counts = None
        if counts is not None:
            for st in JobState:
                g.add_metric([st.value], counts.get(st.value, 0))
        yield g


class _Leadership(Collector):
    """The replica's role and the lease's age, from memory (no database call)."""

    def __init__(self, leadership: Leadership) -> None:
        self.leadership = leadership

    def collect(self) -> Iterator[Metric]:
        snap = self.leadership.snapshot()
        role = GaugeMetricFamily(
            "ringtrain_replica_leader",
            "1 when this replica leads the control plane (schedules, reconciles), else 0",
            labels=["replica"],
        )
        role.add_metric([snap.replica], 1.0 if snap.role == "leader" else 0.0)
        yield role
        age = GaugeMetricFamily(
            "ringtrain_leader_lease_age_seconds",
            "seconds since the leader lease was last renewed, as this replica last saw it",
        )
        if snap.lease_age_s is not None:
            age.add_metric([], snap.lease_age_s)
        yield age
        help_ = "the lease's epoch (grows per takeover)"
        epoch = GaugeMetricFamily("ringtrain_leader_epoch", help_)
        epoch.add_metric([], float(snap.epoch))
        yield epoch


class Telemetry:
    def __init__(self, store: Store, leadership: Leadership | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "ringtrain_http_requests",
            "HTTP requests",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "ringtrain_http_request_duration_seconds",
            "HTTP request latency",
            ["method", "route"],
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.points = Counter(
            "ringtrain_metric_points_ingested",
            "metric points stored from driver reports",
            registry=self.registry,
        )
        self.reports = Counter(
            "ringtrain_report_batches",
            "report batches by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.throttled = Counter(
            "ringtrain_rate_limited_requests",
            "requests refused with 429 by kind of limit "
            "(api: per token, report: per job, unauth: per address)",
            ["kind"],
            registry=self.registry,
        )
        for kind in (
            "api",
            "report",
            "unauth",
        ):  # exported at 0 from the start, so rate() works at once
            self.throttled.labels(kind)
        self.registry.register(_JobsByState(store))
        if leadership is not None:
            self.registry.register(_Leadership(leadership))


class TelemetryMiddleware:
    def __init__(self, app: ASGIApp, telemetry: Telemetry) -> None:
        self.app = app
        self.t = telemetry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def _send(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, _send)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            dt = time.perf_counter() - start
            self.t.requests.labels(scope["method"], route, str(status)).inc()
            self.t.latency.labels(scope["method"], route).observe(dt)
            if route not in ("/healthz", "/metrics"):
                log.info(
                    "%s %s %s",
                    scope["method"],
                    route,
                    status,
                    extra={
                        "method": scope["method"],
                        "route": route,
                        "status": status,
                        "duration_ms": round(dt * 1000, 2),
                    },
                )
