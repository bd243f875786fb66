"""Paging and resume edges on a real server: `has_more` at exactly `limit` left, the cursor of
/metrics and /logs, and which of `?after=` and `Last-Event-ID` the event stream starts from."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from api.client import parse_sse
from service.launcher import NodeInfo
from tests.support.api_harness import BOB, TINY_SPEC, Driver, RecordingLauncher, Server, running


@pytest.fixture(scope="module")
def ended(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    """One job that ran: RUNNING (seq 1), six loss points (steps 0..5), four log lines, SUCCEEDED."""
    with running(tmp_path_factory.mktemp("paging")) as srv:
        with srv.client() as c:
            job_id = c.post("/v1/jobs", json=TINY_SPEC).json()["id"]
        d = Driver(srv, job_id)
        assert d.state("RUNNING", reason="placed").status_code == 200
        assert d.metrics(range(6)).status_code == 200
        lines = [d.item("log", line=f"line {i}", source="driver") for i in range(4)]
        assert d.post(lines).status_code == 200
        assert d.state("SUCCEEDED", reason="done").status_code == 200
        yield srv, job_id


def test_metrics_pages_end_exactly_at_the_last_point(ended: tuple[Server, str]) -> None:
    """6 points in pages of 3: the first page has more, the second holds the last 3 and has no more."""
    srv, job_id = ended
    with srv.client() as c:
        first = c.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 3}).json()
        assert [p["step"] for p in first["points"]] == [0, 1, 2] and first["has_more"]
        assert first["next_after"] == first["points"][-1]["seq"]
        params = {"limit": 3, "after": first["next_after"]}
        second = c.get(f"/v1/jobs/{job_id}/metrics", params=params).json()
        assert [p["step"] for p in second["points"]] == [3, 4, 5]
        assert second["has_more"] is False


def test_logs_pages_end_exactly_at_the_last_line(ended: tuple[Server, str]) -> None:
    srv, job_id = ended
    with srv.client() as c:
        url = f"/v1/jobs/{job_id}/logs"
        first = c.get(url, params={"limit": 2, "driver": False}).json()
        assert [x["line"] for x in first["lines"]] == ["line 0", "line 1"] and first["has_more"]
        params = {"limit": 2, "after": first["next_after"], "driver": False}
        second = c.get(url, params=params).json()
        assert [x["line"] for x in second["lines"]] == ["line 2", "line 3"]
        assert second["has_more"] is False


def _ids(srv: Server, job_id: str, **kw: object) -> list[int]:
    url = f"/v1/jobs/{job_id}/events"
    with (
        srv.client(timeout=httpx.Timeout(10.0)) as http,
        http.stream("GET", url, **kw) as r,  # type: ignore[arg-type]
    ):
        assert r.status_code == 200
        return [int(e.id) for e in parse_sse(r.iter_lines()) if e.event != "end"]


def test_the_stream_starts_after_the_later_of_after_and_last_event_id(
    ended: tuple[Server, str],
) -> None:
    """Both given: whichever is further along wins, in either order."""
    srv, job_id = ended
    every = _ids(srv, job_id)
    assert len(every) >= 6 and every == sorted(every)
    a, b = every[-4], every[-2]
    assert _ids(srv, job_id, params={"after": a}, headers={"Last-Event-ID": str(b)}) == every[-1:]
    assert _ids(srv, job_id, params={"after": b}, headers={"Last-Event-ID": str(a)}) == every[-1:]
    assert _ids(srv, job_id, headers={"Last-Event-ID": str(a)}) == every[-3:]


def test_cancelling_an_ended_job_stops_nothing(ended: tuple[Server, str]) -> None:
    """Cancel is idempotent: on a SUCCEEDED job it answers 202, changes nothing and asks the launcher to
    stop nothing (the driver is gone)."""
    srv, job_id = ended
    with srv.client() as c:
        r = c.post(f"/v1/jobs/{job_id}/cancel")
        assert r.status_code == 202
        got = r.json()
        assert got["state"] == "SUCCEEDED" and got["cancel_requested"] is False
    assert srv.launcher.stops == []


def test_another_owners_stream_is_404_before_any_frame(ended: tuple[Server, str]) -> None:
    """Bob asking for Alice's event stream gets 404 JSON in the response head, not an SSE stream (read
    as headers only, so a regression fails here at once instead of streaming)."""
    srv, job_id = ended
    with (
        srv.client(BOB, timeout=httpx.Timeout(10.0)) as bob,
        bob.stream("GET", f"/v1/jobs/{job_id}/events") as r,
    ):
        assert r.status_code == 404
        assert r.headers["content-type"].startswith("application/json")


def test_the_cancel_that_ends_a_queued_job_is_audited_as_done(tmp_path: Path) -> None:
    """A job waiting in the queue (the cluster is busy: no CPU free) is cancelled at once by the cancel
    itself: its audit row says ok, not already_ended (which is for jobs that had ended before)."""
    busy = RecordingLauncher(
        nodes=[
            NodeInfo("node-a", "10.0.0.1", True, 8, 0, 0, 0),
            NodeInfo("node-b", "10.0.0.2", True, 8, 0, 0, 0),
        ]
    )
    with running(tmp_path, busy) as srv, srv.client() as c:
        job_id = c.post("/v1/jobs", json=TINY_SPEC).json()["id"]
        r = c.post(f"/v1/jobs/{job_id}/cancel")
        assert r.status_code == 202 and r.json()["state"] == "CANCELLED"
        top = c.get("/v1/audit").json()["events"][0]
        assert (top["action"], top["job_id"], top["outcome"]) == ("job.cancel", job_id, "ok")
        assert busy.submits == []
