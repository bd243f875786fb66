"""The layer around authentication, on a real server (uvicorn on loopback, SQLite file): browser hardening headers,
rate limits (per API token, per job on the report route, per address without a valid token), ingest tokens that
stop at the job's end and rotate per driver attempt, hashed API tokens in the configuration, and the audit trail.
The browser side of the headers (zero CSP violations in Chromium) is tests/unit/api/browser/test_security_browser.py.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from sqlalchemy import select

from api.app import limiter
from api.deps import owner_of
from api.ratelimit import Limit, RateLimiter
from api.security import CSP
from service.launcher import DriverInfo, DriverStatus
from service.models import Job
from service.settings import Settings
from tests.support.api_harness import (
    ALICE,
    BOB,
    TINY_SPEC,
    Driver,
    RecordingLauncher,
    Server,
    running,
    wait_for,
)
from workers.orchestration.reporter import Reporter


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def submit(srv: Server, token: str = ALICE, **kw: Any) -> dict[str, Any]:
    with srv.client(token) as c:
        r = c.post("/v1/jobs", json={**TINY_SPEC, **kw})
        assert r.status_code == 201, r.text
        return r.json()


def throttled(srv: Server) -> dict[str, float]:
    text = srv.client(None).get("/metrics").text
    return {
        m[1]: float(m[2])
        for m in re.finditer(
            r'^ringtrain_rate_limited_requests_total\{kind="(\w+)"\} (\S+)', text, re.M
        )
    }


# --- browser hardening headers ------------------------------------------------------------------------------------


def test_security_headers_everywhere(tmp_path: Path) -> None:
    with running(tmp_path) as srv:
        anon = srv.client(None)
        for path, status in (
            ("/", 200),
            ("/static/js/main.js", 200),
            ("/v1/jobs", 401),
            ("/nope", 404),
        ):
            r = anon.get(path)
            assert r.status_code == status, (path, r.status_code)
            assert r.headers["content-security-policy"] == CSP, path
            assert r.headers["x-content-type-options"] == "nosniff", path
            assert r.headers["referrer-policy"] == "no-referrer", path
            assert r.headers["x-frame-options"] == "DENY", path
        assert srv.client().get("/v1/jobs").headers["content-security-policy"] == CSP
        policy = dict(d.strip().split(" ", 1) for d in CSP.split(";"))
        assert policy["default-src"] == "'self'" and policy["frame-ancestors"] == "'none'"
        assert policy["script-src"] == "'self'" and policy["style-src"] == "'self'"
        assert "unsafe" not in CSP
        # FastAPI's docs page loads Swagger UI from a CDN with an inline bootstrap: no source lists, no framing
        docs = anon.get("/docs")
        assert docs.headers["content-security-policy"] == "frame-ancestors 'none'"
        assert docs.headers["x-content-type-options"] == "nosniff"
    page = (Path(__file__).resolve().parents[3] / "api" / "static" / "index.html").read_text()
    assert not re.search(r"<script(?![^>]*\bsrc=)", page), "inline <script> in index.html"
    assert "<style" not in page and " style=" not in page and "data:" not in page


# --- rate limits ---------------------------------------------------------------------------------------------------


def test_burst_beyond_the_limit_is_429_and_other_tokens_are_unaffected(tmp_path: Path) -> None:
    # refill 0.01/s: nothing refills during the test, so the counts are exact
    with running(tmp_path, rate_limits=True, rate_api_per_s=0.01, rate_api_burst=5) as srv:
        alice, bob = srv.client(ALICE), srv.client(BOB)
        codes = [alice.get("/v1/jobs").status_code for _ in range(5)]
        r = alice.get("/v1/jobs")
        assert codes == [200] * 5 and r.status_code == 429
        body = r.json()["error"]
        assert body["code"] == "too_many_requests" and "API token" in body["message"]
        assert 1 <= int(r.headers["Retry-After"]) <= 100
        assert (
            alice.post("/v1/jobs", json=TINY_SPEC).status_code == 429
        )  # every user route shares the bucket
        assert [bob.get("/v1/jobs").status_code for _ in range(5)] == [
            200
        ] * 5  # another token: its own bucket
        assert throttled(srv)["api"] == 2
        # the open routes are never limited (probes, scrapes, the dashboard's files)
        assert {
            srv.client(None).get(p).status_code
            for p in ("/healthz", "/metrics", "/")
            for _ in range(10)
        } == {200}


def test_requests_without_a_valid_token_are_limited_per_address(tmp_path: Path) -> None:
    with running(tmp_path, rate_limits=True, rate_unauth_per_s=0.01, rate_unauth_burst=3) as srv:
        bad = srv.client("not-a-real-token-0123456789")
        assert [bad.get("/v1/jobs").status_code for _ in range(2)] == [401, 401]
        assert (
            srv.client(None).get("/v1/jobs").status_code == 401
        )  # no token: the same address's bucket
        r = bad.get("/v1/jobs")
        assert (
            r.status_code == 429
            and r.headers["Retry-After"]
            and r.json()["error"]["code"] == "too_many_requests"
        )
        # guessing with other random tokens does not help: the bucket is the address's
        assert srv.client("another-guess-0123456789").get("/v1/jobs").status_code == 429
        assert (
            srv.client(ALICE).get("/v1/jobs").status_code == 200
        )  # a valid token has its own bucket
        assert throttled(srv)["unauth"] == 2


def test_report_route_is_limited_per_job(tmp_path: Path) -> None:
    with running(tmp_path, rate_limits=True, rate_report_per_s=0.01, rate_report_burst=4) as srv:
        a, b = Driver(srv, submit(srv)["id"]), Driver(srv, submit(srv)["id"])
        assert [a.metrics(range(s, s + 1)).status_code for s in range(4)] == [200] * 4
        r = a.metrics(range(4, 5))
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert "report batches" in r.json()["error"]["message"]
        assert b.metrics(range(1)).status_code == 200  # another job's driver is unaffected
        with srv.client() as c:
            assert [p["step"] for p in c.get(f"/v1/jobs/{a.job_id}/metrics").json()["points"]] == [
                0,
                1,
                2,
                3,
            ]
        assert throttled(srv)["report"] == 1


def test_default_limits_never_throttle_a_healthy_driver() -> None:
    """The report route's defaults against a driver's real pattern, on a simulated clock: the reporter posts every
    0.2 s (5/s) for an hour, then a back-to-back catch-up of 300 batches (1000 items each) after an outage."""
    now = [0.0]
    lim = limiter(Settings(api_tokens={ALICE: "alice"}))
    lim.clock = lambda: now[0]
    refused = 0
    for i in range(5 * 3600):
        now[0] = i * 0.2
        refused += lim.take("report", "j1") > 0
    assert refused == 0
    now[0] += 1.0
    assert [lim.take("report", "j1") for _ in range(300)] == [0.0] * 300
    wait = lim.take("report", "j1")  # the 301st at the same instant: one batch too many
    assert wait == pytest.approx(1 / 50)
    s = Settings(api_tokens={ALICE: "alice"})
    assert (s.rate_report_per_s, s.rate_report_burst) == (50.0, 300)


def test_bucket_refills_and_forgets_idle_keys() -> None:
    now = [0.0]
    rl = RateLimiter({"k": Limit(2.0, 3), "off": Limit(0, 1)}, max_keys=10, clock=lambda: now[0])
    assert [rl.take("k", "a") for _ in range(3)] == [0.0] * 3
    assert rl.take("k", "a") == pytest.approx(0.5)  # one token takes 1/rate
    now[0] = 0.5
    assert rl.take("k", "a") == 0.0 and rl.take("k", "a") == pytest.approx(0.5)
    assert all(rl.take("off", "x") == 0.0 for _ in range(100))
    for i in range(20):  # many keys: the table stays bounded
        rl.take("k", f"addr{i}")
    assert len(rl._buckets) <= 10


# --- ingest tokens -------------------------------------------------------------------------------------------------


def test_report_after_the_end_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    with running(tmp_path) as srv:
        job = submit(srv)
        d = Driver(srv, job["id"])
        assert d.state("RUNNING", reason="placed").status_code == 200
        assert d.metrics(range(3)).status_code == 200
        # the final batch: items after the terminal state are acknowledged, not applied
        end = d.post(
            [
                d.item("state", state="SUCCEEDED", reason="done"),
                d.item("metric", step=9, name="loss", value=9),
            ]
        )
        assert end.status_code == 200 and end.json() == {"acked_seq": d.seq}
        c = srv.client()

        def snapshot() -> tuple[Any, ...]:
            j = c.get(f"/v1/jobs/{job['id']}").json()
            pts = c.get(f"/v1/jobs/{job['id']}/metrics").json()["points"]
            logs = c.get(f"/v1/jobs/{job['id']}/logs", params={"driver": False}).json()["lines"]
            return (
                j["state"],
                j["step"],
                len(j["transitions"]),
                [(p["step"], p["value"]) for p in pts],
                logs,
            )

        before = snapshot()
        assert before[0] == "SUCCEEDED" and [s for s, _ in before[3]] == [0, 1, 2]
        late = [
            d.state("RUNNING", reason="late"),
            d.metrics(range(3, 6)),
            d.post([d.item("log", source="driver", line="late line")]),
            d.post([]),  # even the handshake of a resubmitted driver
        ]
        for r in late:
            assert r.status_code == 409, r.text
            err = r.json()
            assert (
                err["error"]["code"] == "job_ended"
                and err["state"] == "SUCCEEDED"
                and "acked_seq" not in err
            )
        assert snapshot() == before
        # a token that never was the job's is still a 401 (the refusal above says nothing to others)
        assert (
            srv.client("not-the-token-0123456789")
            .post(f"/v1/jobs/{job['id']}/report", json={"items": []})
            .status_code
            == 401
        )


def test_reporter_stops_at_job_ended(tmp_path: Path) -> None:
    """The driver's reporter drops what it still holds on 409 job_ended instead of retrying until its exit."""
    with running(tmp_path) as srv:
        job = submit(srv)
        d = Driver(srv, job["id"])
        assert d.state("CANCELLED", reason="stopped").status_code == 200
        rep = Reporter(srv.url, job["id"], d.token, interval_s=0.05)
        rep.log("a line after the end")
        wait_for(lambda: rep.ended)
        assert rep.ended == "CANCELLED" and rep.pending() == 0
        assert rep.log("another") is False
        assert rep.close(timeout_s=30)
        logs = (
            srv.client().get(f"/v1/jobs/{job['id']}/logs", params={"driver": False}).json()["lines"]
        )
        assert "a line after the end" not in json.dumps(logs)


def test_ingest_tokens_are_stored_hashed_and_rotate_per_driver_attempt(tmp_path: Path) -> None:
    launcher = RecordingLauncher()
    with running(tmp_path, launcher) as srv:
        job = submit(srv, max_restarts=1)
        first = Driver(srv, job["id"])
        assert first.state("RUNNING", reason="placed").status_code == 200
        store = srv.app.state.ctx.store

        def stored() -> dict[str, Any]:
            with store.db.engine.connect() as conn:
                return dict(
                    conn.execute(select(Job.__table__).where(Job.id == job["id"])).mappings().one()
                )

        row = stored()
        assert row["ingest_token_hash"] == sha(first.token)
        assert first.token not in json.dumps(row, default=str)
        # the driver dies; the reconciler resubmits it as attempt 1 with a new token
        sid = srv.client().get(f"/v1/jobs/{job['id']}").json()["submission_id"]
        launcher.statuses[sid] = DriverInfo(DriverStatus.FAILED, "exit code 137")
        second = wait_for(
            lambda: next(
                (r for r in launcher.submits if r.job_id == job["id"] and r.attempt == 1), None
            )
        )
        assert second.ingest_token != first.token
        assert stored()["ingest_token_hash"] == sha(second.ingest_token)
        assert first.post([]).status_code == 401  # the dead driver's token stopped working
        assert (
            srv.client(second.ingest_token)
            .post(f"/v1/jobs/{job['id']}/report", json={"items": []})
            .status_code
            == 200
        )


# --- API tokens at rest --------------------------------------------------------------------------------------------


def test_hashed_api_tokens_authenticate_and_their_text_does_not(tmp_path: Path) -> None:
    tokens = {f"sha256:{sha(ALICE).upper()}": "alice", BOB: "bob"}  # hex in either case
    with running(tmp_path, api_tokens=tokens) as srv:
        r = srv.client(ALICE).post("/v1/jobs", json=TINY_SPEC)
        assert r.status_code == 201 and r.json()["owner"] == "alice"
        assert (
            srv.client(BOB).get("/v1/jobs").status_code == 200
        )  # plaintext entries still work beside hashed ones
        for presented in (f"sha256:{sha(ALICE)}", f"sha256:{sha(ALICE).upper()}", sha(ALICE)):
            r = srv.client(presented).get("/v1/jobs")
            assert r.status_code == 401, presented
    assert owner_of({f"sha256:{sha(ALICE)}": "alice"}, ALICE) == "alice"
    assert owner_of({f"sha256:{sha(ALICE)}": "alice"}, f"sha256:{sha(ALICE)}") is None


def test_hashed_tokens_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGTRAIN_API_TOKENS", json.dumps({f"sha256:{sha(ALICE)}": "alice"}))
    s = Settings()
    assert s.api_tokens == {f"sha256:{sha(ALICE)}": "alice"}
    assert owner_of(s.api_tokens, ALICE) == "alice"
    for bad in ("sha256:abc", f"sha256:{sha(ALICE)[:-1]}z", f"sha256:{sha(ALICE)}00"):
        monkeypatch.setenv("RINGTRAIN_API_TOKENS", json.dumps({bad: "alice"}))
        with pytest.raises(ValidationError, match=r"api_tokens.*64 hex digits"):
            Settings()


# --- audit trail ---------------------------------------------------------------------------------------------------


def test_audit_rows_for_create_and_cancel(tmp_path: Path) -> None:
    with running(
        tmp_path, api_tokens={ALICE: "alice", BOB: "bob", "admin-token-0123456789": "admin"}
    ) as srv:
        alice, bob = srv.client(ALICE), srv.client(BOB)
        job = submit(srv)
        rows = alice.get("/v1/audit").json()[
            "events"
        ]  # written before the 201 was sent: there at once
        assert [
            (r["owner"], r["action"], r["job_id"], r["status"], r["outcome"]) for r in rows
        ] == [("alice", "job.create", job["id"], 201, "ok")]
        assert (
            rows[0]["method"] == "POST"
            and rows[0]["route"] == "/v1/jobs"
            and rows[0]["client"] == "127.0.0.1"
        )
        assert alice.post("/v1/jobs", json={**TINY_SPEC, "train": {"steps": -1}}).status_code == 422
        assert bob.post(f"/v1/jobs/{job['id']}/cancel").status_code == 404  # not bob's job
        assert alice.post(f"/v1/jobs/{job['id']}/cancel").status_code == 202
        assert (
            alice.post(f"/v1/jobs/{job['id']}/cancel").status_code == 202
        )  # again: idempotent, audited again
        assert (
            srv.client("not-a-real-token-0123456789")
            .post(f"/v1/jobs/{job['id']}/cancel")
            .status_code
            == 401
        )
        assert (
            alice.post("/v1/plan", json=TINY_SPEC).status_code == 200
        )  # computes only: not audited
        mine = [
            (r["action"], r["job_id"], r["status"], r["outcome"])
            for r in alice.get("/v1/audit").json()["events"]
        ]
        assert mine == [  # newest first
            ("job.cancel", job["id"], 202, "ok"),
            ("job.cancel", job["id"], 202, "ok"),
            ("job.create", None, 422, "validation_error"),
            ("job.create", job["id"], 201, "ok"),
        ]
        bobs = bob.get("/v1/audit").json()["events"]
        assert [(r["owner"], r["action"], r["job_id"], r["outcome"]) for r in bobs] == [
            ("bob", "job.cancel", job["id"], "not_found")
        ]
        per_job = alice.get("/v1/audit", params={"job_id": job["id"]}).json()["events"]
        assert [r["action"] for r in per_job] == ["job.cancel", "job.cancel", "job.create"]
        # owner-scoped; an audit reader (admin by default) sees everyone's, or one owner's
        r = bob.get("/v1/audit", params={"owner": "alice"})
        assert r.status_code == 403 and r.json()["error"]["field"] == "owner"
        admin = srv.client("admin-token-0123456789")
        assert len(admin.get("/v1/audit").json()["events"]) == 5
        assert {
            r["owner"] for r in admin.get("/v1/audit", params={"owner": "bob"}).json()["events"]
        } == {"bob"}
        page1 = alice.get("/v1/audit", params={"limit": 3}).json()
        page2 = alice.get("/v1/audit", params={"limit": 3, "before": page1["next_before"]}).json()
        assert (
            len(page1["events"]) == 3 and len(page2["events"]) == 1 and page2["next_before"] is None
        )


def test_cancel_of_an_ended_job_is_audited_as_a_no_op(tmp_path: Path) -> None:
    with running(tmp_path) as srv:
        job = submit(srv)
        Driver(srv, job["id"]).state("SUCCEEDED", reason="done")
        assert srv.client().post(f"/v1/jobs/{job['id']}/cancel").status_code == 202
        top = srv.client().get("/v1/audit").json()["events"][0]
        assert (top["action"], top["outcome"]) == ("job.cancel", "already_ended")
