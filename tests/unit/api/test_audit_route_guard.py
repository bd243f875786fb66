"""GET /v1/audit's scoping and paging, driven in process (the route function on a real store on a
temporary SQLite file): pages end exactly at the last row, the default page holds 100 rows, the job
filter reaches the store, times are UTC, and only audit readers see other owners' rows (an owner
naming themself is fine)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest

from api.errors import ApiError
from api.routers.audit import AuditPage, audit
from service.settings import Settings
from tests.support.stores import sqlite_store


def _row(i: int, owner: str, job_id: str) -> dict[str, Any]:
    return dict(
        time=86_400.0 + i,
        owner=owner,
        action="job.cancel",
        method="POST",
        route="/v1/jobs/{job_id}/cancel",
        job_id=job_id,
        status=202,
        outcome="ok",
        client="127.0.0.1",
    )


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """ids 1..120 (written in order on a fresh database): alice's are the odd ones below 100
    (50 rows) and 101..120 (20 rows); bob has the rest."""
    with sqlite_store(tmp_path_factory.mktemp("audit")) as store:
        for i in range(1, 121):
            store.audit.record(**_row(i, "alice" if i % 2 or i > 100 else "bob", f"j{i % 3}"))
        yield SimpleNamespace(settings=Settings(audit_readers=["admin"]), store=store)


def _get(ctx: Any, me: str, **kw: Any) -> AuditPage:
    args: dict[str, Any] = {"job_id": None, "owner": None, "before": None, "limit": 100, **kw}
    return asyncio.run(audit(ctx, me, **args))  # type: ignore[arg-type]


def test_pages_end_exactly_at_the_last_row(ctx: Any) -> None:
    """70 rows in pages of 35: two full pages and no third."""
    first = _get(ctx, "alice", limit=35)
    assert len(first.events) == 35 and first.events[0].id == 120
    assert first.next_before == first.events[-1].id
    second = _get(ctx, "alice", limit=35, before=first.next_before)
    assert len(second.events) == 35 and second.events[-1].id == 1
    assert second.next_before is None


def test_the_default_page_is_a_hundred_rows(ctx: Any) -> None:
    page = asyncio.run(audit(ctx, "admin"))  # type: ignore[arg-type]
    assert len(page.events) == 100 and page.next_before == 21


def test_the_job_filter_and_utc_times(ctx: Any) -> None:
    page = _get(ctx, "alice", job_id="j2")
    assert page.events and {e.job_id for e in page.events} == {"j2"}
    assert {e.owner for e in page.events} == {"alice"}
    top = page.events[0]  # id 119
    assert top.id == 119 and top.time == datetime(1970, 1, 2, 0, 1, 59, tzinfo=UTC)


def test_only_readers_see_other_owners(ctx: Any) -> None:
    assert {e.owner for e in _get(ctx, "alice").events} == {"alice"}
    assert len(_get(ctx, "alice", owner="alice").events) == 70
    assert {e.owner for e in _get(ctx, "admin", owner="bob").events} == {"bob"}
    with pytest.raises(ApiError) as e:
        _get(ctx, "bob", owner="alice")
    assert e.value.status == 403 and e.value.field == "owner"
