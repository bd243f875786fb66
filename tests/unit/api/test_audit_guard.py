"""The audit middleware's rows, driven in process (the middleware around a tiny ASGI app, a real
store on a temporary SQLite file keeps the rows): a route that crashes is audited as the 500 the client gets, not as a
success, and a created job's id comes from the first segment of its `Location`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from api.audit import AuditMiddleware, _location_job
from service.models import AuditEvent
from service.store import Store
from tests.support.stores import sqlite_store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with sqlite_store(tmp_path) as store:
        yield store


def _through(
    store: Store,
    method: str,
    path: str,
    route: str,
    *,
    status: int | None,
    headers: list[tuple[bytes, bytes]] | None = None,
    path_params: dict[str, str] | None = None,
) -> list[AuditEvent]:
    """The rows one request by alice writes; `status` None = the route raises before answering."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        scope["route"] = SimpleNamespace(path=route)
        scope["state"] = {"owner": "alice"}
        scope["path_params"] = path_params or {}
        if status is None:
            raise RuntimeError("boom")
        await send({"type": "http.response.start", "status": status, "headers": headers or []})
        await send({"type": "http.response.body", "body": b""})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(_: dict[str, Any]) -> None:
        return None

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [],
        "client": ("10.1.2.3", 40000),
    }

    async def go() -> None:
        await AuditMiddleware(app, store)(scope, receive, send)  # type: ignore[arg-type]

    if status is None:
        with pytest.raises(RuntimeError):
            asyncio.run(go())
    else:
        asyncio.run(go())
    return store.audit.events(None)


def test_a_route_that_crashes_is_audited_as_a_500(store: Store) -> None:
    rows = _through(
        store,
        "POST",
        "/v1/jobs/j1/cancel",
        "/v1/jobs/{job_id}/cancel",
        status=None,
        path_params={"job_id": "j1"},
    )
    assert len(rows) == 1
    r = rows[0]
    assert (r.owner, r.action, r.job_id, r.status, r.outcome) == (
        "alice",
        "job.cancel",
        "j1",
        500,
        "internal_error",
    )
    assert r.client == "10.1.2.3"


def test_a_created_job_is_named_by_its_location(store: Store) -> None:
    rows = _through(
        store,
        "POST",
        "/v1/jobs",
        "/v1/jobs",
        status=201,
        headers=[(b"Location", b"/v1/jobs/abc123")],
    )
    assert [(r.action, r.job_id, r.status, r.outcome) for r in rows] == [
        ("job.create", "abc123", 201, "ok")
    ]


def test_location_job_takes_the_first_segment_after_jobs() -> None:
    assert _location_job([(b"location", b"/v1/jobs/abc123/artifacts/x")]) == "abc123"
    assert _location_job([(b"location", b"/v1/jobs/abc123")]) == "abc123"
    assert _location_job([(b"location", b"/v1/datasets/d1")]) is None
    assert _location_job([(b"content-type", b"/v1/jobs/abc123")]) is None
