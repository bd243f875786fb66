"""The dashboard's comparison view and the job page's Model panel, in headless Chromium against the real server.

Three jobs with different specs are fed over the real report protocol; the test picks them in #/compare and
checks the overlaid chart (one line per job, as many points as the store holds), the spec differences
(exactly the parameters that differ, each job's value in its column) and switching the metric. One job
succeeds with a model exported into its checkpoint directory: its page lists the files with links that
download without a token, and a from_pretrained snippet. Screenshots: test-artifacts/compare-*.png.
Console errors fail the test (the page runs under the strict CSP of api/security.py).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.api_harness import ALICE, Driver, Server, make_settings, wait_for
from tests.support.api_harness import RecordingLauncher as Launcher
from tests.support.browser_fixtures import (
    CHROMIUM,
    CHROMIUM_ARGS,
    TOKEN_KEY,
    capture_errors,
    chromium_missing,
    create_job,
    shot,
    wait_js,
)
from tests.support.require import missing

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]

BASE: dict[str, Any] = {
    "name": "base",
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
    "data": {"kind": "passkey", "seq_len": 256},
    "parallel": {"ring_size": 2},
    "train": {"steps": 60, "lr": 3e-4},
}


def variant(name: str, lr: float, ring: int) -> dict[str, Any]:
    spec = copy.deepcopy(BASE)
    spec["name"], spec["train"]["lr"], spec["parallel"]["ring_size"] = name, lr, ring
    return spec


@pytest.fixture(scope="module")
def jobs(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Server, list[dict[str, Any]], Path]]:
    tmp = tmp_path_factory.mktemp("compare")
    srv = Server(make_settings(tmp), Launcher()).start()
    try:
        made = []
        for i, (name, lr, ring, n) in enumerate(
            [("lr-3e-4", 3e-4, 2, 60), ("lr-1e-3", 1e-3, 2, 45), ("ring4", 3e-4, 4, 30)]
        ):
            job = create_job(srv, variant(name, lr, ring))
            d = Driver(srv, job["id"])
            assert d.state("RUNNING").status_code == 200
            items = []
            for s in range(1, n + 1):
                items.append(
                    d.item(
                        "metric", step=s, name="loss", value=(5.0 - i) / (1 + 0.05 * s * (i + 1))
                    )
                )
                items.append(
                    d.item("metric", step=s, name="tokens_per_s", value=1000.0 * (i + 1) + s)
                )
                items += [
                    d.item("metric", step=s, name="mem_peak_bytes", value=1e6 * (r + 1), rank=r)
                    for r in (0, 1)
                ]
            assert d.post(items).status_code == 200
            if i == 0:
                model = tmp / "ckpt" / job["id"] / "model"
                model.mkdir(parents=True)
                (model / "config.json").write_text(
                    json.dumps({"model_type": "llama", "hidden_size": 32})
                )
                (model / "model.safetensors").write_bytes(bytes(range(256)) * 64)
                assert d.state("SUCCEEDED", reason="done").status_code == 200
            made.append({**job, "points": n})
        yield srv, made, tmp
    finally:
        srv.stop()


@pytest.fixture
def page(jobs: Any) -> Iterator[Any]:
    why = chromium_missing()
    if why:
        missing("chromium", why)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
        ctx.add_init_script(f"localStorage.setItem({json.dumps(TOKEN_KEY)}, {json.dumps(ALICE)})")
        pg = ctx.new_page()
        errs = capture_errors(pg)
        try:
            yield pg
            assert not errs.unexpected(), f"page errors: {errs.unexpected()}"
        finally:
            browser.close()


def test_compare_overlays_jobs_and_lists_spec_differences(jobs: Any, page: Any) -> None:
    srv, made, _ = jobs
    page.goto(f"{srv.url}/#/compare")
    for job in made:
        page.locator(f'#compare-jobs input[data-job-id="{job["id"]}"]').check()
    wait_js(page, "window.__ringtrain.compare && window.__ringtrain.compare.jobs.length === 3")
    state = page.evaluate("window.__ringtrain.compare")
    assert state["metric"] == "loss"
    assert [(j["id"], j["points"]) for j in state["jobs"]] == [(j["id"], j["points"]) for j in made]
    labels = page.locator("#compare-plot .u-legend .u-series .u-label").all_inner_texts()
    assert [x for x in labels if x != "step"] == [f"{j['name']} ({j['id']})" for j in made]
    assert page.locator("#compare-plot canvas").count() >= 1

    params = page.locator("#spec-diff-table tbody tr[data-param]")
    assert sorted(params.evaluate_all("rows => rows.map(r => r.dataset.param)")) == [
        "name",
        "parallel.ring_size",
        "train.lr",
    ]
    lr = page.locator('#spec-diff-table tr[data-param="train.lr"] td').all_inner_texts()
    ring = page.locator('#spec-diff-table tr[data-param="parallel.ring_size"] td').all_inner_texts()
    assert [float(v) for v in lr] == [3e-4, 1e-3, 3e-4] and ring == ["2", "2", "4"]
    assert "model.d_model" not in page.locator("#spec-diff").inner_text()
    assert "#/compare?ids=" + ",".join(j["id"] for j in made) in page.url
    shot(page, "compare-loss")
    page.reload()  # the link restores the comparison
    wait_js(page, "window.__ringtrain.compare && window.__ringtrain.compare.jobs.length === 3")
    wait_js(
        page, "() => document.querySelectorAll('#compare-jobs input:checked').length === 3"
    )  # its own fetch

    page.select_option(
        "#compare-metric", "mem_peak_bytes"
    )  # per rank: the mean over ranks, one line per job
    wait_js(page, "window.__ringtrain.compare.metric === 'mem_peak_bytes'")
    state = page.evaluate("window.__ringtrain.compare")
    assert [j["points"] for j in state["jobs"]] == [j["points"] for j in made]
    last = page.locator("#spec-diff-table tr.final td").all_inner_texts()
    # the mean of 1e6 and 2e6 bytes over the two ranks, in the metric's unit (as its axis)
    assert last == ["1.43 MiB"] * 3
    shot(page, "compare-mem")

    page.locator(f'#compare-jobs input[data-job-id="{made[2]["id"]}"]').uncheck()
    wait_js(page, "window.__ringtrain.compare.jobs.length === 2")
    assert page.locator('#spec-diff-table tr[data-param="parallel.ring_size"]').count() == 0


def test_job_page_lists_the_model_with_links_and_snippet(jobs: Any, page: Any) -> None:
    srv, made, tmp = jobs
    job = made[0]
    page.goto(f"{srv.url}/#/jobs/{job['id']}")
    page.wait_for_selector("#artifacts-table tbody tr")
    rows = page.locator("#artifacts-table tbody tr")
    assert rows.evaluate_all("rs => rs.map(r => r.dataset.file)") == [
        "config.json",
        "model.safetensors",
    ]
    href = page.locator('#artifacts-table tr[data-file="model.safetensors"] a').get_attribute(
        "href"
    )
    r = page.request.get(srv.url + href)  # a signed link: no Authorization header needed
    data = (tmp / "ckpt" / job["id"] / "model" / "model.safetensors").read_bytes()
    assert (
        r.status == 200 and hashlib.sha256(r.body()).hexdigest() == hashlib.sha256(data).hexdigest()
    )
    snippet = page.locator("#hf-snippet").inner_text()
    assert 'AutoModelForCausalLM.from_pretrained("./lr-3e-4-model")' in snippet
    assert (
        f"ringtrain pull {job['id']} ./lr-3e-4-model" in page.locator("#pull-snippet").inner_text()
    )
    page.locator("#artifacts").scroll_into_view_if_needed()
    shot(page, "compare-job-model", full_page=False)

    other = made[1]  # still running: the panel says when the model will appear
    page.goto(f"{srv.url}/#/jobs/{other['id']}")
    wait_for(
        lambda: "exported here when the job succeeds" in page.locator("#artifacts").inner_text(),
        timeout=15,
    )
