"""The Prometheus series and access-log fields the control plane exports, driven in process (the
middleware called directly on a tiny ASGI app, the collectors on a real store on a temporary SQLite
file): dashboards and alerts
key on these exact label sets, so a swapped label, a raw path instead of the route template, a
latency in milliseconds or a missing zero series breaks them silently."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from api import telemetry as tel
from api.telemetry import JsonFormatter, Telemetry, TelemetryMiddleware
from service.db import make_engine
from service.leader import Snapshot
from service.store import Store
from tests.support.stores import sqlite_store
from workers.config import JobSpec
from workers.protocol import JobState, StateItem

SPEC = JobSpec.model_validate(
    {"name": "tiny", "model": {"d_model": 32, "n_layers": 1, "n_heads": 2}, "train": {"steps": 5}}
)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """Five jobs: three QUEUED, two whose drivers reported RUNNING."""
    with sqlite_store(tmp_path_factory.mktemp("telemetry")) as store:
        for i in range(5):
            job = store.jobs.create("alice", SPEC, f"ingest-{i}")
            if i >= 3:
                up = StateItem(seq=1, state=JobState.RUNNING, time=time.time(), reason="placed")
                store.metrics.apply_report(job.id, [up])
        yield store


@pytest.fixture
def broken(tmp_path: Path) -> Store:
    """A real store whose database cannot be opened (its file path is a directory): every read
    raises StoreError."""
    return Store(make_engine(f"sqlite:///{tmp_path}"))


class _Lead:
    """The leadership's snapshot, as given (a stand-in: the real `Leadership` runs its lease loop
    and would need to win or lose a lease first; the collector reads only `snapshot()`)."""

    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap

    def snapshot(self) -> Snapshot:
        return self.snap


def _call(t: Telemetry, method: str, path: str, route: str | None, status: int | None) -> None:
    """One request through the middleware; `route` None = no route matched, `status` None = the
    app raises before answering."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if route is not None:
            scope["route"] = SimpleNamespace(path=route)
        if status is None:
            raise RuntimeError("boom")
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(_: dict[str, Any]) -> None:
        return None

    scope = {"type": "http", "method": method, "path": path, "headers": []}
    asyncio.run(TelemetryMiddleware(app, t)(scope, receive, send))


def _requests(t: Telemetry, **labels: str) -> float | None:
    return t.registry.get_sample_value("ringtrain_http_requests_total", labels)


def test_requests_are_counted_by_method_route_template_and_status(store: Store) -> None:
    t = Telemetry(store)
    _call(t, "POST", "/v1/jobs/abc123/cancel", "/v1/jobs/{job_id}/cancel", 202)
    _call(t, "POST", "/v1/jobs/def456/cancel", "/v1/jobs/{job_id}/cancel", 202)
    _call(t, "GET", "/nope", None, 404)
    with pytest.raises(RuntimeError):
        _call(t, "GET", "/v1/jobs", "/v1/jobs", None)
    assert _requests(t, method="POST", route="/v1/jobs/{job_id}/cancel", status="202") == 2.0
    assert _requests(t, method="GET", route="unmatched", status="404") == 1.0
    assert _requests(t, method="GET", route="/v1/jobs", status="500") == 1.0
    # one series per template, never per job id
    assert _requests(t, method="POST", route="/v1/jobs/abc123/cancel", status="202") is None


def test_latency_is_observed_in_seconds(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = [100.0, 100.003]  # the start, then the end (and any later reading)
    monkeypatch.setattr(
        tel.time, "perf_counter", lambda: ticks.pop(0) if len(ticks) > 1 else ticks[0]
    )
    t = Telemetry(store)
    _call(t, "GET", "/v1/jobs", "/v1/jobs", 200)
    labels = {"method": "GET", "route": "/v1/jobs"}
    name = "ringtrain_http_request_duration_seconds"
    assert t.registry.get_sample_value(f"{name}_sum", labels) == pytest.approx(0.003)
    assert t.registry.get_sample_value(f"{name}_bucket", {**labels, "le": "0.0025"}) == 0.0
    assert t.registry.get_sample_value(f"{name}_bucket", {**labels, "le": "0.005"}) == 1.0


def test_the_access_log_names_the_route_template_and_status(store: Store) -> None:
    seen: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    logger = logging.getLogger("ringtrain.access")
    h, old = _Keep(), logger.level
    logger.addHandler(h)
    logger.setLevel(logging.INFO)
    try:
        _call(Telemetry(store), "POST", "/v1/jobs/abc123/cancel", "/v1/jobs/{job_id}/cancel", 409)
    finally:
        logger.removeHandler(h)
        logger.setLevel(old)
    assert len(seen) == 1
    line = json.loads(JsonFormatter().format(seen[0]))
    assert (line["method"], line["route"], line["status"]) == (
        "POST",
        "/v1/jobs/{job_id}/cancel",
        409,
    )
    assert line["level"] == "INFO" and line["logger"] == "ringtrain.access"


def test_jobs_by_state_exports_every_state_and_nothing_when_the_store_fails(
    store: Store, broken: Store
) -> None:
    t = Telemetry(store)
    get = t.registry.get_sample_value
    assert get("ringtrain_jobs", {"state": "QUEUED"}) == 3.0
    assert get("ringtrain_jobs", {"state": "RUNNING"}) == 2.0
    for st in ("PLACING", "RETRYING", "SUCCEEDED", "FAILED", "CANCELLED"):
        assert get("ringtrain_jobs", {"state": st}) == 0.0
    down = Telemetry(broken)
    assert down.registry.get_sample_value("ringtrain_jobs", {"state": "QUEUED"}) is None


def test_throttle_kinds_are_exported_at_zero_from_the_start(store: Store) -> None:
    t = Telemetry(store)
    for kind in ("api", "report", "unauth"):
        assert (
            t.registry.get_sample_value("ringtrain_rate_limited_requests_total", {"kind": kind})
            == 0.0
        )


@pytest.mark.parametrize(("role", "value"), [("leader", 1.0), ("follower", 0.0)])
def test_leadership_gauges(store: Store, role: str, value: float) -> None:
    snap = Snapshot(replica="r-7", role=role, epoch=4, lease_age_s=2.5, holder="r-7")
    t = Telemetry(store, _Lead(snap))  # type: ignore[arg-type]
    get = t.registry.get_sample_value
    assert get("ringtrain_replica_leader", {"replica": "r-7"}) == value
    assert get("ringtrain_leader_lease_age_seconds") == 2.5
    assert get("ringtrain_leader_epoch") == 4.0
    unseen = Snapshot(replica="r-8", role="follower", epoch=0, lease_age_s=None, holder=None)
    t2 = Telemetry(store, _Lead(unseen))  # type: ignore[arg-type]
    assert t2.registry.get_sample_value("ringtrain_leader_lease_age_seconds") is None
