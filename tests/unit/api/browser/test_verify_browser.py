"""The job page's verification badge in a real browser (headless Chromium): 'not yet', then passed
as the ranks report it (live), failed with the reason as the job's error, and 'disabled'; the jobs
list filtered by the verification's outcome."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.api_harness import BOB, Server, make_settings, roomy_launcher
from tests.support.browser_fixtures import (
    ALICE,
    TOKEN_KEY,
    capture_errors,
    create_job,
    shot,
    start_running,
    wait_js,
)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120)]

SPEC: dict[str, Any] = {
    "name": "verified",
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
    "data": {"kind": "passkey", "seq_len": 256},
    "parallel": {"ring_size": 4},
    "train": {"steps": 40},
}
# the job's error as the driver reports a rank's VerificationFailed (TrainingError, driver.py)
REASON = (
    "rank 0: VerificationFailed: verification failed before step 1: largest "
    "difference from the one-rank reference in logits: 0.31 relative "
    "(tolerance 0.0001 for float32, 256 tokens)"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(make_settings(tmp_path_factory.mktemp("verify")), roomy_launcher())
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def _verify_points(d: Any, err: float, passed: bool) -> list[dict[str, Any]]:
    values = {"verify_max_rel_err": err, "verify_tolerance": 1e-4, "verify_passed": float(passed),
              "verify_tokens": 256.0, "verify_seconds": 0.4}  # fmt: skip
    return [d.item("metric", step=0, name=k, value=v) for k, v in values.items()]


def test_job_page_shows_the_verification(browser: Any, server: Server) -> None:
    ok = create_job(server, SPEC)
    bad = create_job(server, {**SPEC, "name": "diverged"})
    off = create_job(server, {**SPEC, "name": "unchecked", "verify": {"enabled": False}})
    d_ok, d_bad = start_running(server, ok["id"]), start_running(server, bad["id"])
    d_bad.post(_verify_points(d_bad, 0.31, False))
    d_bad.state("FAILED", reason=f"training failed: {REASON}", error=REASON)
    ctx = browser.new_context(viewport={"width": 1300, "height": 900})
    ctx.add_init_script(f"localStorage.setItem({TOKEN_KEY!r}, {ALICE!r})")
    page = ctx.new_page()
    errs = capture_errors(page)
    try:
        page.goto(f"{server.url}/#/jobs/{ok['id']}")
        page.locator("#job-verification").wait_for()
        assert page.locator("#job-verification").inner_text() == "not yet"
        d_ok.post(_verify_points(d_ok, 6.1e-7, True))  # arrives live, over the job's event stream
        wait_js(page, "() => document.querySelector('#job-verification .verify-passed') !== null")
        badge = page.locator("#job-verification")
        assert badge.inner_text() == "passed: error 6.1e-7 ≤ tolerance 1e-4"
        shot(page, "verify-passed", full_page=False)

        page.goto(f"{server.url}/#/jobs/{bad['id']}")
        page.locator("#job-verification .verify-failed").wait_for()
        assert badge.inner_text() == "failed: error 3.1e-1 > tolerance 1e-4"
        # the failed check is the job's error
        assert page.locator(".alert pre").inner_text() == REASON
        shot(page, "verify-failed", full_page=False)

        page.goto(f"{server.url}/#/jobs/{off['id']}")
        shown = "() => document.querySelector('#job-verification')?.textContent"
        wait_js(page, f"{shown} === 'disabled'")
        assert not errs.unexpected()
    finally:
        ctx.close()


LISTED = "() => [...document.querySelectorAll('#jobs-table tbody tr[data-job-id]')]" \
    ".map((r) => r.dataset.jobId).sort()"  # fmt: skip


def _wait_listed(page: Any, want: list[str]) -> None:
    """Until the table shows exactly `want` (any order)."""
    wait_js(page, f"(want) => JSON.stringify(({LISTED})()) === JSON.stringify(want)", sorted(want))


def test_jobs_list_filters_by_verification(browser: Any, server: Server) -> None:
    # bob's jobs only: the list is per owner, so the other test's jobs do not show
    ok = create_job(server, {**SPEC, "name": "bob-verified"}, token=BOB)
    bad = create_job(server, {**SPEC, "name": "bob-diverged"}, token=BOB)
    off = create_job(server, {**SPEC, "name": "bob-unchecked", "verify": {"enabled": False}}, BOB)
    pending = create_job(server, {**SPEC, "name": "bob-not-yet"}, token=BOB)
    d_ok, d_bad = start_running(server, ok["id"]), start_running(server, bad["id"])
    start_running(server, pending["id"])  # running, its check not reported yet
    d_ok.post(_verify_points(d_ok, 6.1e-7, True))
    d_bad.post(_verify_points(d_bad, 0.31, False))
    d_bad.state("FAILED", reason=f"training failed: {REASON}", error=REASON)
    everyone = [ok["id"], bad["id"], off["id"], pending["id"]]
    ctx = browser.new_context(viewport={"width": 1300, "height": 900})
    ctx.add_init_script(f"localStorage.setItem({TOKEN_KEY!r}, {BOB!r})")
    page = ctx.new_page()
    errs = capture_errors(page)
    count = "() => document.querySelector('#jobs-count')?.textContent"
    try:
        page.goto(f"{server.url}/#/jobs")
        _wait_listed(page, everyone)
        assert page.locator("#verification-filter").input_value() == ""

        page.select_option("#verification-filter", "passed")
        wait_js(page, "() => location.hash === '#/jobs?verification=passed'")
        _wait_listed(page, [ok["id"]])
        wait_js(page, f"{count} === '1 job verification passed'")
        shot(page, "verify-filter-passed", full_page=False)

        page.select_option("#verification-filter", "failed")
        wait_js(page, "() => location.hash === '#/jobs?verification=failed'")
        _wait_listed(page, [bad["id"]])

        # with the state filter: both in the address, both sent to the API
        page.select_option("#state-filter", "RUNNING")
        wait_js(page, "() => location.hash === '#/jobs?state=RUNNING&verification=failed'")
        empty = "() => document.querySelector('#jobs-table tbody td')?.textContent"
        wait_js(page, f"{empty} === 'No RUNNING jobs with verification failed.'")
        _wait_listed(page, [])
        page.select_option("#verification-filter", "passed")
        wait_js(page, "() => location.hash === '#/jobs?state=RUNNING&verification=passed'")
        _wait_listed(page, [ok["id"]])
        wait_js(page, f"{count} === '1 job RUNNING, verification passed'")

        # back to any outcome: the running jobs, verified or not
        page.select_option("#verification-filter", "")
        wait_js(page, "() => location.hash === '#/jobs?state=RUNNING'")
        _wait_listed(page, [ok["id"], pending["id"]])

        # an address with the filter opens filtered, its select set
        page.goto(f"{server.url}/#/jobs?verification=failed")
        _wait_listed(page, [bad["id"]])
        assert page.locator("#verification-filter").input_value() == "failed"
        assert not errs.unexpected()
    finally:
        ctx.close()
