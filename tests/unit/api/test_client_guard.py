"""The Python client (api/client.py) against a scripted server (httpx.MockTransport, in process):
the content type it sends for each kind of spec, the error it raises, the query it builds, paging
through metrics, and an event stream that drops and is resumed from the last id it delivered."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from api.client import ApiError, Client, parse_sse, resolve_url, spec_body
from tests.support.api_harness import TINY_SPEC

Handler = Callable[[httpx.Request], httpx.Response]


def client(handler: Handler) -> Client:
    return Client("http://test", "tok", transport=httpx.MockTransport(handler))


def test_the_content_type_follows_the_kind_of_spec(tmp_path: Path) -> None:
    as_json = tmp_path / "spec.json"
    as_json.write_text(json.dumps(TINY_SPEC))
    as_yaml = tmp_path / "spec.yaml"
    as_yaml.write_text("name: tiny\n")
    assert spec_body(as_json)[1] == "application/json"
    assert spec_body(str(as_json))[1] == "application/json"
    assert spec_body(as_yaml) == (b"name: tiny\n", "application/yaml")
    assert spec_body('  {"name": "x"}')[1] == "application/json"  # JSON text, leading blanks
    assert spec_body("name: x\ntrain: {steps: 1}\n")[1] == "application/yaml"
    assert spec_body({"name": "x"}) == (b'{"name": "x"}', "application/json")


def test_an_error_answer_raises_with_the_servers_fields() -> None:
    body = {"error": {"code": "validation_error", "message": "bad", "field": "train.steps"}}
    c = client(lambda r: httpx.Response(400, json=body))
    with pytest.raises(ApiError) as e:
        c.get_job("j1")
    assert (e.value.status, e.value.code, e.value.message, e.value.field) == (
        400,
        "validation_error",
        "bad",
        "train.steps",
    )
    c = client(lambda r: httpx.Response(502, text="bad gateway"))
    with pytest.raises(ApiError) as e:
        c.get_job("j1")
    assert (e.value.status, e.value.code, e.value.message) == (502, "http_error", "bad gateway")


def test_queries_the_client_builds() -> None:
    seen: list[httpx.Request] = []

    def handler(r: httpx.Request) -> httpx.Response:
        seen.append(r)
        if r.url.path == "/v1/plan":
            return httpx.Response(500, json={"error": {"code": "x", "message": "stop here"}})
        return httpx.Response(
            200, json={"job_id": "j1", "lines": [], "next_after": 0, "has_more": False}
        )

    c = client(handler)
    c.logs("j1", driver=False)
    assert seen[-1].url.params["driver"] == "false"
    with pytest.raises(ApiError):
        c.plan(TINY_SPEC, memory_per_rank_gib=2.5)  # a budget alone asks for fit too
    assert dict(seen[-1].url.params) == {"fit": "true", "fit_memory_per_rank_gib": "2.5"}
    with pytest.raises(ApiError):
        c.plan(TINY_SPEC)
    assert dict(seen[-1].url.params) == {}
    assert seen[-1].headers["authorization"] == "Bearer tok"


def test_an_explicit_url_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGTRAIN_URL", "http://env:1/")
    assert resolve_url("http://given:2/") == "http://given:2"
    assert resolve_url() == "http://env:1"


def test_iter_metrics_follows_the_pages() -> None:
    afters: list[str] = []

    def handler(r: httpx.Request) -> httpx.Response:
        after = int(r.url.params["after"])
        afters.append(str(after))
        seqs = [s for s in (1, 2, 5, 7, 9) if s > after][:2]
        points = [{"seq": s, "step": s, "name": "loss", "value": 1.0, "time": 0.0} for s in seqs]
        more = bool(seqs) and seqs[-1] < 9
        return httpx.Response(
            200,
            json={"job_id": "j1", "points": points, "next_after": seqs[-1], "has_more": more},
        )

    assert [p.seq for p in client(handler).iter_metrics("j1")] == [1, 2, 5, 7, 9]
    assert afters == ["0", "2", "7"]


def test_wait_eval_ends_on_failure_too() -> None:
    c = client(lambda r: httpx.Response(200, json={"id": "e1", "state": "FAILED"}))
    assert c.wait_eval("e1", timeout=1.0, poll_s=0.0)["state"] == "FAILED"


def sse(*events: tuple[str, int | None, dict[str, object]]) -> bytes:
    out = []
    for kind, eid, data in events:
        head = f"event: {kind}\n" + (f"id: {eid}\n" if eid is not None else "")
        out.append(f"{head}data: {json.dumps(data)}\n\n")
    return "".join(out).encode()


def test_a_dropped_stream_resumes_after_the_last_id() -> None:
    """First connection (after=0): events 1 and 2, then the server closes before `end`. The client
    reconnects at once with Last-Event-ID 2 and gets 3 and `end`; nothing is lost or repeated."""
    asked: list[str | None] = []

    def handler(r: httpx.Request) -> httpx.Response:
        asked.append(r.headers.get("last-event-id"))
        if len(asked) == 1:
            body = sse(("state", 1, {"to": "RUNNING"}), ("metric", 2, {"step": 1}))
        else:
            body = sse(("log", 3, {"line": "x"}), ("end", None, {"state": "SUCCEEDED"}))
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    got = [(e.event, e.id) for e in client(handler).events("j1", after=0)]
    assert got == [("state", 1), ("metric", 2), ("log", 3), ("end", None)]
    assert asked == ["0", "2"]


def test_without_reconnect_a_lost_stream_just_ends() -> None:
    calls: list[int] = []

    def handler(r: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(200, content=b"", headers={"content-type": "text/event-stream"})

    assert list(client(handler).events("j1", reconnect=False)) == []
    assert calls == [1]  # one try, no retries


def test_parse_sse_skips_pings_and_the_end_has_no_id() -> None:
    """A comment and a data-less message (only `retry:`) are no events."""
    lines = [": ping", "", "retry: 2000", "", "event: metric", "id: 4", 'data: {"step": 2}', ""]
    lines += ["event: end", "id: 4", 'data: {"state": "FAILED"}', ""]
    got = [(e.event, e.id, e.data) for e in parse_sse(lines)]
    assert got == [("metric", 4, {"step": 2}), ("end", None, {"state": "FAILED"})]
