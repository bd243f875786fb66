"""The dashboard on a job run by the real driver on a real local Ray head, in headless Chromium
(Playwright) against the real server: the chart grows live, the ring shows both ranks, and the
dashboard's cancel stops the job on Ray, releasing its actors and placement group. The dashboard's
other browser tests play the driver over the report protocol instead (tests/unit/api/browser/)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.api_harness import Server, make_settings, wait_for
from tests.support.browser_fixtures import (
    ALICE,
    TOKEN_KEY,
    PageErrors,
    create_job,
    shot,
    wait_js,
)

pytestmark = [pytest.mark.browser]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_real_ray_job_live_and_cancel(
    browser: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A job run by the real driver on the session's local Ray head: the chart grows live, the ring shows both
    ranks, and the dashboard's cancel stops it on Ray: the driver's Ray job STOPPED, both rank actors dead, the
    placement group removed (released, not leaked). Cancelling again (the API) and stopping the finished Ray job
    again are no-ops."""
    import sys

    from api.client import Client
    from service.launcher import DriverStatus
    from service.ray_jobs import (
        RayJobLauncher,
    )  # a project module: failing to import it fails the test
    from tests.support.ray_fixtures import ray_state

    def mine(kind: str, jid: str) -> list[dict[str, Any]]:
        return [x for x in ray_state(head, kind) if (x.get("name") or "").startswith(f"rt-{jid}-")]

    head = request.getfixturevalue("ray_head")
    launcher = RayJobLauncher(head.jobs_url, auth_token=head.auth_token, python=sys.executable)
    srv = Server(
        make_settings(
            tmp_path,
            reconcile_interval_s=1.0,
            reconcile_grace_s=10.0,
            scheduler_interval_s=0.2,
            cancel_grace_s=60.0,
            placement_timeout_s=120.0,
        ),
        launcher,
    )
    srv.start()
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    ctx.add_init_script(f"localStorage.setItem({json.dumps(TOKEN_KEY)}, {json.dumps(ALICE)})")
    pg = ctx.new_page()
    errs = PageErrors()
    pg.on("console", lambda m: errs.messages.append(m.text) if m.type == "error" else None)
    pg.on("pageerror", lambda e: errs.messages.append(str(e)))
    try:
        job = create_job(
            srv,
            {
                "name": "ray-live",
                "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
                "data": {"kind": "passkey", "seq_len": 128},
                "parallel": {"ring_size": 2},
                "train": {"steps": 5000, "lr": 1e-3},
                "checkpoint": {"every_steps": 0},
                "eval": {"enabled": False},
                "resources": {"accelerator": "cpu", "cpus_per_worker": 1},
                "max_restarts": 0,
            },
        )
        pg.goto(f"{srv.url}/#/jobs/{job['id']}")
        wait_js(
            pg,
            "() => Number(document.querySelector('#chart-loss')?.dataset.points) >= 2",
            timeout=150000,
        )
        first = int(pg.locator("#chart-loss").get_attribute("data-points"))
        wait_js(
            pg,
            f"() => Number(document.querySelector('#chart-loss').dataset.points) > {first}",
            timeout=30000,
        )
        pg.locator("#ring svg .rank").nth(1).wait_for()
        assert pg.locator("#ring svg .rank").count() == 2
        wait_js(pg, "() => document.querySelector('#job-state')?.textContent === 'RUNNING'")
        assert [g["state"] for g in mine("placement_groups", job["id"])] == ["CREATED"]
        assert sorted(a["state"] for a in mine("actors", job["id"])) == ["ALIVE", "ALIVE"]
        shot(pg, "dashboard-ray-job")
        pg.click("#cancel-button")
        pg.click("#confirm-yes")
        wait_js(
            pg,
            "() => document.querySelector('#job-state')?.textContent === 'CANCELLED'",
            timeout=90000,
        )
        assert not errs.unexpected(), errs.unexpected()
        c = Client(srv.url, ALICE)
        got = c.get_job(job["id"])
        assert [t.to_state.value for t in got.transitions] == [
            "QUEUED",
            "PLACING",
            "RUNNING",
            "CANCELLED",
        ]
        sid = got.submission_id
        assert sid
        wait_for(lambda: launcher.status(sid).status.finished, timeout=60, interval=1)
        assert launcher.status(sid).status == DriverStatus.STOPPED
        wait_for(
            lambda: all(a["state"] == "DEAD" for a in mine("actors", job["id"])),
            timeout=30,
            interval=0.5,
        )
        wait_for(
            lambda: all(g["state"] == "REMOVED" for g in mine("placement_groups", job["id"])),
            timeout=30,
            interval=0.5,
        )
        assert len(mine("actors", job["id"])) == 2
        assert len(mine("placement_groups", job["id"])) == 1
        launcher.stop(sid)  # stopping a finished Ray job is a no-op
        assert launcher.status(sid).status == DriverStatus.STOPPED
        assert c.cancel(job["id"]).state.value == "CANCELLED"  # and so is cancelling again
    finally:
        ctx.close()
        srv.stop()
