"""The dashboard under its Content-Security-Policy in headless Chromium, against the real server with the default
rate limits on: every page (jobs list, a live job with ring, passkey grid and audit rows, compare runs, submit
and plan, the token prompt, the dark palette) runs with zero CSP violations — caught by a
`securitypolicyviolation` listener installed before any page script, and by the console — and a planted inline
script and style attribute are refused, which shows the listener sees what it should. The token lives in
sessionStorage, never localStorage.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.api_harness import RecordingLauncher, Server, make_settings
from tests.support.browser_fixtures import (
    ALICE,
    TOKEN_KEY,
    PageErrors,
    create_job,
    shot,
    start_running,
    step_items,
    wait_js,
)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120)]

SPEC: dict[str, Any] = {
    "name": "csp",
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
    "data": {"kind": "passkey", "seq_len": 256},
    "parallel": {"ring_size": 4},
    "train": {"steps": 100},
}
WATCH = """
window.__csp = [];
document.addEventListener("securitypolicyviolation", (e) =>
  window.__csp.push(`${e.violatedDirective} blocked ${e.blockedURI || "inline"} at ${e.sourceFile}:${e.lineNumber}`));
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(
        make_settings(tmp_path_factory.mktemp("csp"), rate_limits=True), RecordingLauncher()
    )
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


class Watched:
    """A page with the CSP listener and console capture; `check()` fails on any violation or page error."""

    def __init__(self, browser: Any, scheme: str = "light", legacy_token: bool = False) -> None:
        self.ctx = browser.new_context(viewport={"width": 1300, "height": 950}, color_scheme=scheme)
        self.ctx.add_init_script(WATCH)
        if legacy_token:  # what an older dashboard left behind
            self.ctx.add_init_script(
                f"if (!sessionStorage.getItem({json.dumps(TOKEN_KEY)})) "
                f"localStorage.setItem({json.dumps(TOKEN_KEY)}, {json.dumps(ALICE)})"
            )
        self.page = self.ctx.new_page()
        self.errors = PageErrors()
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda e: self.errors.messages.append(f"pageerror: {e}"))

    def _console(self, m: Any) -> None:
        """Every console error, and a CSP report whatever its level."""
        if m.type == "error" or "Content Security Policy" in m.text:
            self.errors.messages.append(f"console.{m.type}: {m.text}")

    def violations(self) -> list[str]:
        return list(self.page.evaluate("window.__csp || []"))

    def check(self) -> None:
        assert self.violations() == [], self.violations()
        assert self.errors.unexpected() == [], self.errors.unexpected()

    def close(self) -> None:
        self.ctx.close()


@pytest.fixture
def watched(browser: Any) -> Iterator[Watched]:
    w = Watched(browser, legacy_token=True)
    try:
        yield w
    finally:
        w.close()


def test_every_page_runs_without_csp_violations(watched: Watched, server: Server) -> None:
    page = watched.page
    running = create_job(server, {**SPEC, "name": "csp-running"})
    create_job(server, {**SPEC, "name": "csp-queued"})
    d = start_running(server, running["id"], ranks=4)
    for s in range(12):
        assert d.post(step_items(d, s)).status_code == 200
    cells = [
        d.item("metric", step=11, name=f"passkey_acc/len={n}/depth={dp:.2f}", value=v)
        for n, row in ((128, (1.0, 0.5)), (256, (0.75, 0.25)))
        for dp, v in zip((0.0, 1.0), row, strict=True)
    ]
    assert d.post(cells).status_code == 200

    page.goto(f"{server.url}/#/jobs")
    page.locator("#jobs-table").wait_for()
    # the running job's bar (step 11 of 100): its width is set through the CSSOM, not a style attribute
    wait_js(
        page,
        "() => [...document.querySelectorAll('.progress .bar > span')].some((s) => parseFloat(s.style.width) === 11)",
    )
    # a token left in localStorage by an older dashboard moved to this tab's session storage
    assert page.evaluate(f"sessionStorage.getItem({json.dumps(TOKEN_KEY)})") == ALICE
    assert page.evaluate(f"localStorage.getItem({json.dumps(TOKEN_KEY)})") is None

    page.goto(f"{server.url}/#/jobs/{running['id']}")
    wait_js(page, "() => Number(document.querySelector('#chart-loss')?.dataset.points) === 12")
    page.locator("#ring .swatch").first.wait_for()
    page.locator("#passkey-grid td").first.wait_for()
    bg = page.evaluate(
        "getComputedStyle(document.querySelector('#passkey-grid td')).backgroundColor"
    )
    assert bg not in ("", "rgba(0, 0, 0, 0)"), bg  # the heat colour applied
    swatch = page.evaluate(
        "getComputedStyle(document.querySelector('#ring .swatch')).backgroundColor"
    )
    assert swatch not in ("", "rgba(0, 0, 0, 0)"), swatch
    # the audit trail's row for the job's creation is in the timeline
    page.locator("#timeline li.audit").first.wait_for()
    assert "job.create by alice from 127.0.0.1" in page.locator("#timeline").inner_text()
    page.click("#cancel-button")
    page.click("#confirm-yes")
    wait_js(
        page,
        "() => [...document.querySelectorAll('#timeline li.audit')]"
        ".some((li) => li.textContent.includes('job.cancel'))",
    )
    shot(page, "security-csp-job")

    other = create_job(server, {**SPEC, "name": "csp-other"})
    d2 = start_running(server, other["id"], ranks=4)
    for s in range(5):
        assert d2.post(step_items(d2, s)).status_code == 200
    page.goto(f"{server.url}/#/compare?ids={running['id']},{other['id']}&metric=loss")
    page.locator("#compare-plot canvas").first.wait_for()
    page.locator("#spec-diff .swatch, #compare-note").first.wait_for(state="attached")

    page.goto(f"{server.url}/#/submit")
    page.locator("#spec-editor").wait_for()
    page.click("#plan-button")
    page.locator("#plan-preview").wait_for()
    watched.check()


def test_token_prompt_keeps_the_token_in_session_storage(browser: Any, server: Server) -> None:
    w = Watched(browser, scheme="dark")
    try:
        page = w.page
        page.goto(f"{server.url}/")
        page.locator("#token-dialog").wait_for(state="visible")
        page.fill("#token-input", ALICE)
        page.keyboard.press("Enter")
        page.locator("#jobs-table").wait_for()
        assert page.evaluate(f"sessionStorage.getItem({json.dumps(TOKEN_KEY)})") == ALICE
        assert page.evaluate("localStorage.length") == 0
        w.check()
    finally:
        w.close()


def test_planted_inline_script_and_style_are_refused(watched: Watched, server: Server) -> None:
    """The negative control: the policy really applies, and the listener really reports."""
    page = watched.page
    page.goto(f"{server.url}/#/jobs")
    page.locator("#jobs-table").wait_for()
    page.evaluate(
        """() => {
          const s = document.createElement("script");
          s.textContent = "window.__pwned = 1";
          document.body.append(s);
          document.body.setAttribute("style", "outline: 5px solid red");
        }"""
    )
    wait_js(page, "() => window.__csp.length >= 2")
    got = watched.violations()
    assert page.evaluate("window.__pwned") is None
    assert any(v.startswith("script-src") for v in got) and any(
        v.startswith("style-src") for v in got
    ), got
    assert page.evaluate("getComputedStyle(document.body).outlineStyle") != "solid"
    # the page may not be framed
    assert (
        page.request.get(f"{server.url}/")
        .headers["content-security-policy"]
        .endswith("frame-ancestors 'none'")
    )
