"""The live event stream: replay + live with no gaps or repeats, resume with Last-Event-ID, end, heartbeats."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from api.client import ApiError, Client, JobEvent, parse_sse
from tests.support.api_harness import ALICE, TINY_SPEC, Driver, running, wait_for


@pytest.fixture
def srv(tmp_path: Path):
    with running(tmp_path) as s:
        yield s


def stored_ids(srv, job_id: str) -> list[int]:
    return [e.seq for e in srv.app.state.ctx.store.metrics.events_after(job_id, 0, 100000)]


def collect(
    client: Client, job_id: str, out: list[JobEvent], after: int | None = None
) -> threading.Thread:
    def run() -> None:
        out.extend(client.events(job_id, after=after))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_live_stream_has_everything_once_and_ends(srv):
    c = Client(srv.url, ALICE)
    job = c.submit(TINY_SPEC)
    d = Driver(srv, job.id)
    subs = [[] for _ in range(5)]
    threads = [collect(c if i == 0 else Client(srv.url, ALICE), job.id, subs[i]) for i in range(5)]
    wait_for(lambda: srv.app.state.ctx.hub.subscribers(job.id) == 5)
    d.state("RUNNING", reason="placed")
    for k in range(10):
        d.metrics(range(k * 3, k * 3 + 3), ("loss", "tokens_per_s"))
    d.post([d.item("log", line="checkpoint written", source="driver")])
    d.state("RETRYING", reason="rank died", resume_step=20)
    d.state("RUNNING", reason="resumed")
    d.metrics(range(21, 30))
    d.state("SUCCEEDED", reason="done")
    for t in threads:
        t.join(timeout=20)
        assert not t.is_alive()
    for events in subs:
        assert events[-1].event == "end" and events[-1].data["state"] == "SUCCEEDED"
        ids = [e.id for e in events[:-1]]
        assert ids == sorted(set(ids)), "no repeats, in order"
        # live subscribers also saw the points later superseded; everything stored is in their stream
        assert set(stored_ids(srv, job.id)) <= set(ids)
        kinds = {e.event for e in events}
        assert kinds == {"state", "metric", "log", "end"}
        retry = next(e for e in events if e.event == "state" and e.data["to"] == "RETRYING")
        assert retry.data["resume_step"] == 20
        m = next(e for e in events if e.event == "metric")
        assert (
            set(m.data) == {"seq", "step", "name", "value", "rank", "time"}
            and m.data["seq"] == m.id
        )
    # a late subscriber replays exactly the store, then ends
    replay = list(c.events(job.id))
    assert [e.id for e in replay[:-1]] == stored_ids(srv, job.id) and replay[-1].event == "end"


def test_resume_with_last_event_id(srv):
    c = Client(srv.url, ALICE)
    job = c.submit(TINY_SPEC)
    d = Driver(srv, job.id)
    d.state("RUNNING", reason="placed")
    d.metrics(range(0, 10))
    http = srv.client(timeout=httpx.Timeout(10.0))
    seen: list[JobEvent] = []
    with http.stream("GET", f"/v1/jobs/{job.id}/events") as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for ev in parse_sse(r.iter_lines()):
            seen.append(ev)
            if len(seen) == 6:
                break  # disconnect mid-stream
    last = seen[-1].id
    d.metrics(range(10, 20))  # happens while disconnected
    d.state("SUCCEEDED", reason="done")
    with http.stream("GET", f"/v1/jobs/{job.id}/events", headers={"Last-Event-ID": str(last)}) as r:
        rest = list(parse_sse(r.iter_lines()))
    all_ids = stored_ids(srv, job.id)
    assert [e.id for e in rest[:-1]] == [i for i in all_ids if i > last]
    assert [e.id for e in seen] + [e.id for e in rest[:-1]] == all_ids
    assert rest[-1].event == "end"
    # ?after= does the same; a Last-Event-ID beyond it wins
    with http.stream("GET", f"/v1/jobs/{job.id}/events", params={"after": all_ids[-3]}) as r:
        assert [e.id for e in parse_sse(r.iter_lines())][:-1] == all_ids[-2:]
    # the client resumes by itself from `after`
    assert [e.id for e in c.events(job.id, after=last)][:-1] == [i for i in all_ids if i > last]


def test_live_resume_and_heartbeat(srv):
    """Reconnect while the job is still running, then keep receiving live events; pings arrive when idle."""
    c = Client(srv.url, ALICE)
    job = c.submit(TINY_SPEC)
    d = Driver(srv, job.id)
    d.state("RUNNING", reason="placed")
    http = srv.client(timeout=httpx.Timeout(10.0))
    with http.stream("GET", f"/v1/jobs/{job.id}/events") as r:
        lines = r.iter_lines()
        first = next(parse_sse(lines))
        assert first.event == "state"
        pings = 0
        for line in lines:  # idle: the server sends comment heartbeats (sse_ping_s=1 in tests)
            if line.startswith(":"):
                pings += 1
                break
        assert pings == 1
    got: list[JobEvent] = []
    t = collect(c, job.id, got, after=first.id)
    wait_for(lambda: srv.app.state.ctx.hub.subscribers(job.id) == 1)
    d.metrics(range(5))
    d.state("FAILED", reason="boom", error="Traceback: boom")
    t.join(timeout=20)
    assert [e.id for e in got[:-1]] == [i for i in stored_ids(srv, job.id) if i > first.id]
    assert got[-2].data["to"] == "FAILED" and got[-1].data == {
        "state": "FAILED",
        "last_seq": got[-2].id,
    }


def test_events_errors(srv):
    c = srv.client()
    assert c.get("/v1/jobs/jnope/events").status_code == 404
    assert srv.client(None).get("/v1/jobs/jnope/events").status_code == 401
    job = c.post("/v1/jobs", json=TINY_SPEC).json()
    r = c.get(f"/v1/jobs/{job['id']}/events", params={"after": -1})
    assert r.status_code == 422 and r.json()["error"]["field"] == "after"


def test_parse_sse_framing():
    """Comments skipped, multi-line data joined, `end` without an id of its own (SSE repeats the last id)."""
    lines = [
        ": ping",
        "retry: 2000",
        "event: metric",
        "id: 5",
        'data: {"a":',
        "data: 1}",
        "",
        "event: end",
        "data: {}",
        "",
    ]
    assert list(parse_sse(lines)) == [JobEvent("metric", 5, {"a": 1}), JobEvent("end", None, {})]


def test_events_give_up_after_max_retries():
    """Nothing listens: every connection fails before an event; after 1 + max_retries tries the client says so."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the client connects: connection refused
    c = Client(f"http://127.0.0.1:{port}", ALICE)
    with pytest.raises(ApiError) as e:
        list(c.events("j1", max_retries=2))
    assert e.value.code == "disconnected" and "3 times" in e.value.message
    assert list(c.events("j1", reconnect=False)) == []
