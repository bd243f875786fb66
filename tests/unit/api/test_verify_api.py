"""A job's `verification` in the API, the jobs list's filter and the CLI, from reported points.

The test plays the driver over the real report protocol (tests/support/api_harness.py): one job verifies
and runs, one fails verification before step 1 (the rank's reason becomes the job's error), one has
verification disabled. `verification` is derived from the stored `verify_*` points (null without
them); `?verification=` filters on them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from api.cli import main
from api.client import ApiError, Client
from tests.support.api_harness import ALICE, TINY_SPEC, Driver, running, wait_for

REASON = (
    "verification failed before step 1: largest difference from the one-rank reference in "
    "gradient of layers.0.attn.wq.weight: 0.473 relative (tolerance 0.0001 for float32, 128 tokens)"
)
# what the driver reports when a rank raises VerificationFailed(REASON) (TrainingError, driver.py)
ERROR = f"rank 0: VerificationFailed: {REASON}"


@pytest.fixture
def srv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    with running(tmp_path) as s:
        monkeypatch.setenv("RINGTRAIN_URL", s.url)
        monkeypatch.setenv("RINGTRAIN_TOKEN", ALICE)
        yield s


def _points(d: Driver, err: float, passed: bool, tokens: int = 128) -> list[dict[str, Any]]:
    values = {
        "verify_max_rel_err": err,
        "verify_tolerance": 1e-4,
        "verify_passed": 1.0 if passed else 0.0,
        "verify_tokens": float(tokens),
        "verify_seconds": 0.25,
    }
    return [d.item("metric", step=0, name=name, value=value) for name, value in values.items()]


def _start(srv: Any, c: Any, **spec: Any) -> tuple[str, Driver]:
    r = c.post("/v1/jobs", json={**TINY_SPEC, **spec})
    assert r.status_code == 201, r.text
    assert r.json()["verification"] is None  # not run yet
    jid = r.json()["id"]
    d = Driver(srv, jid)
    wait_for(lambda: c.get(f"/v1/jobs/{jid}").json()["state"] == "PLACING")
    placement = [{"rank": r, "node_id": "node-a", "device": "cpu"} for r in range(2)]
    assert d.state("RUNNING", reason="placed", placement=placement).status_code == 200
    return jid, d


def test_verification_is_derived_filtered_and_printed(
    srv: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    c = srv.client()
    ok, d_ok = _start(srv, c, name="verified")
    assert d_ok.post(_points(d_ok, 6.1e-7, True)).status_code == 200
    assert d_ok.metrics(range(1, 3)).status_code == 200
    bad, d_bad = _start(srv, c, name="diverged")
    assert d_bad.post(_points(d_bad, 0.473, False)).status_code == 200
    failed = d_bad.state("FAILED", reason=f"training failed: {ERROR}", error=ERROR)
    assert failed.status_code == 200
    off, d_off = _start(srv, c, name="unchecked", verify={"enabled": False})
    assert d_off.metrics(range(1, 3)).status_code == 200

    got = {j: c.get(f"/v1/jobs/{j}").json() for j in (ok, bad, off)}
    assert got[ok]["verification"] == {
        "passed": True,
        "max_rel_err": 6.1e-7,
        "tolerance": 1e-4,
        "tokens": 128,
        "seconds": 0.25,
        "fp32_rel_err": None,
    }
    failed_check = got[bad]["verification"]
    assert failed_check["passed"] is False and failed_check["max_rel_err"] == 0.473
    # the job's error says what diverged, and by how much
    assert got[bad]["state"] == "FAILED" and got[bad]["error"] == ERROR
    assert got[off]["verification"] is None and got[off]["spec"]["verify"] == {
        "enabled": False,
        "tokens": 256,
    }

    def listed(**params: str) -> list[str]:
        page = c.get("/v1/jobs", params=params)
        assert page.status_code == 200, page.text
        return [j["id"] for j in page.json()["jobs"]]

    assert listed(verification="passed") == [ok]
    assert listed(verification="failed") == [bad]
    assert listed(verification="failed", state="RUNNING") == []
    assert sorted(listed()) == sorted([ok, bad, off])
    assert c.get("/v1/jobs", params={"verification": "maybe"}).status_code == 422

    with Client(srv.url, ALICE) as client:  # the Python client passes the filter through

        def ids(page: Any) -> list[str]:
            return [j.id for j in page.jobs]

        assert ids(client.list_jobs(verification="passed")) == [ok]
        assert ids(client.list_jobs(verification="failed")) == [bad]
        assert client.list_jobs(verification="failed").total == 1
        assert ids(client.list_jobs(verification="passed", state="RUNNING")) == [ok]
        assert ids(client.list_jobs(verification="passed", state="FAILED")) == []
        assert sorted(ids(client.list_jobs())) == sorted([ok, bad, off])
        with pytest.raises(ApiError) as e:
            client.list_jobs(verification="maybe")  # type: ignore[arg-type]
        assert e.value.status == 422

    for jid, line in (
        (ok, "verified  passed: max rel err 6.10e-07 <= 1e-04 (128 tokens, 0.25 s)"),
        (bad, "verified  FAILED: max rel err 4.73e-01 > 1e-04 (128 tokens, 0.25 s)"),
        (off, "verified  disabled"),
    ):
        main(["status", jid])
        assert line in capsys.readouterr().out
