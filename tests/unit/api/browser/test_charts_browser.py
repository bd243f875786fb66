"""The job page's charts on every kind of job, in a real browser (headless Chromium) against the
real server: what each chart drew (its axis tick labels, its legend, a marker where a series has
one point, the stage boundaries across it), and which sections a job's page has, read from the
rendered page.

Jobs are seeded by playing the driver over the real report protocol: a passkey job, a corpus job
(held-out loss by position bucket, twelve ranks), a chat fine-tune (one evaluation: one-point
series), a flat-zero passkey job, a job of one-point, non-finite, very large, RULER and
uncatalogued metrics, and a job with three stages (a context extension: 256, 512, 1024 tokens).
One browser and one page; each test opens one job on it. Screenshots go to
test-artifacts/charts-*.png. The last test checks that units.js and the CLI's units.py write the
same text for each unit.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from api.cli.units import format_value
from tests.support.api_harness import Driver, Server, make_settings, roomy_launcher
from tests.support.browser_fixtures import (
    ALICE,
    TOKEN_KEY,
    capture_errors,
    create_job,
    shot,
    start_running,
    step_items,
    wait_js,
)
from workers.metrics import EFFECTIVE_LENGTH

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120)]

MODEL = {"d_model": 32, "n_layers": 1, "n_heads": 2}
BUCKETS = ["0-64", "64-128", "128-256", "256-512", "512-1024", "1024-2048"]
RULER_LENGTHS = [4096, 8192, 16384, 32768]
RULER_TASKS = ["niah_single", "vt"]
PROBE_LENGTHS = [512, 2048, 1024]  # a family the catalog lacks, posted out of order
PASSKEY_LENGTHS = [1024, 4096, 16384]
DEPTHS = ["0.10", "0.50", "0.90"]


def _metric(d: Driver, step: int, name: str, value: float, rank: int | None = None) -> Any:
    return d.item("metric", step=step, name=name, value=value, rank=rank)


def _post(d: Driver, items: list[dict[str, Any]]) -> None:
    """Report `items`; NaN and inf are sent as the JSON extension Python writes (NaN, Infinity),
    which the server reads and stores as null."""
    body = json.dumps({"items": items})
    r = d.http.post(
        f"/v1/jobs/{d.job_id}/report", content=body, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 200, r.text


def _grid(d: Driver, step: int, value: Any) -> list[dict[str, Any]]:
    return [
        _metric(d, step, f"{name}/len={n}/depth={depth}", value(n, depth))
        for name in ("passkey_acc", "passkey_token_acc")
        for n in PASSKEY_LENGTHS
        for depth in DEPTHS
    ]


def seed_passkey(srv: Server) -> Driver:
    """The demo: training curves, accuracy rising to 100% over four evaluations, its grid."""
    job = create_job(srv, {"name": "passkey", "model": MODEL, "data": {"kind": "passkey",
                     "seq_len": 16384}, "parallel": {"ring_size": 4}, "train": {"steps": 40}})  # fmt: skip
    d = start_running(srv, job["id"], ranks=4)
    _post(d, [_metric(d, 0, "verify_max_rel_err", 6.1e-7), _metric(d, 0, "verify_tolerance", 1e-4),
              _metric(d, 0, "verify_passed", 1.0)])  # fmt: skip
    items = []  # one report: seeding stays quick
    for s in range(40):
        items += step_items(d, s)
        if s in (9, 19, 29, 39):
            acc = (s + 1) / 40
            items += [_metric(d, s, "passkey_acc", acc), _metric(d, s, "passkey_token_acc", acc)]
    _post(d, items + _grid(d, 39, lambda n, depth: 1.0 if n < 16384 else 0.5))
    return d


def seed_corpus(srv: Server, data: Path) -> Driver:
    """A 16K corpus job on 12 ranks: held-out loss and its position buckets, posted in text order
    (0-64, 1024-2048, 128-256, ...); no passkey metric at all."""
    corpus = data / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    job = create_job(srv, {"name": "corpus-16k", "model": MODEL, "data": {"kind": "text",
                     "seq_len": 16384, "path": str(corpus)}, "parallel": {"ring_size": 4,
                     "data_parallel": 3}, "train": {"steps": 40, "batch_size": 3}})  # fmt: skip
    d = start_running(srv, job["id"], ranks=12)
    items = []
    for s in range(40):
        items += step_items(d, s, ranks=12)
        if s in (9, 19, 29, 39):
            drop = s / 400
            items.append(_metric(d, s, "val_loss", 2.6 - drop))
            items += [
                _metric(d, s, f"val_loss/pos={b}", 2.6 - drop * BUCKETS.index(b))
                for b in sorted(BUCKETS)  # text order: the page must not keep it
            ]
    _post(d, items)
    return d


def seed_chat(srv: Server, data: Path) -> Driver:
    """A chat fine-tune on a ring of 2 whose only evaluation ran after the last step: its held-out
    loss series have one point each."""
    job = create_job(srv, {"name": "chat", "model": MODEL, "data": {"kind": "tokens",
                     "seq_len": 2048, "path": str(data / "chat-tokens"), "validation": 0.1},
                     "parallel": {"ring_size": 2}, "train": {"steps": 20}})  # fmt: skip
    d = start_running(srv, job["id"], ranks=2)
    items = [item for s in range(20) for item in step_items(d, s, ranks=2)]
    _post(d, items + [_metric(d, 19, "val_loss", 1.87)] + [
        _metric(d, 19, f"val_loss/pos={b}", 2.0 - 0.05 * i) for i, b in enumerate(BUCKETS)])  # fmt: skip
    return d


def seed_flat_zero(srv: Server) -> Driver:
    """A passkey job that never retrieves: every accuracy 0, a constant learning rate."""
    job = create_job(srv, {"name": "flat-zero", "model": MODEL, "data": {"kind": "passkey",
                     "seq_len": 1024}, "parallel": {"ring_size": 4}, "train": {"steps": 30}})  # fmt: skip
    d = start_running(srv, job["id"], ranks=4)
    items = []
    for s in range(30):
        items += step_items(d, s)
        if s in (9, 19, 29):
            items += [_metric(d, s, "passkey_acc", 0.0), _metric(d, s, "passkey_token_acc", 0.0)]
    for item in items:  # a constant learning rate: a flat series that is not 0
        item["value"] = 3e-4 if item["name"] == "lr" else item["value"]
    _post(d, items + _grid(d, 29, lambda n, depth: 0.0))
    return d


def _ruler(d: Driver, step: int, scores: dict[int, float]) -> list[dict[str, Any]]:
    """One RULER evaluation: the score by length, and each task's at each length (vt 0.2 below
    niah_single), posted in text order (16384 before 4096): the page must order them by number."""
    lengths = sorted(scores, key=str)
    items = [_metric(d, step, f"ruler/len={n}", scores[n]) for n in lengths]
    items += [
        _metric(d, step, f"ruler/{task}/len={n}", scores[n] - 0.2 * t)
        for t, task in enumerate(RULER_TASKS)
        for n in lengths
    ]
    return items


def seed_edges(srv: Server) -> Driver:
    """One point per series (a loss; a RULER evaluation of an exported model with its effective
    length), a throughput of 3.2e15 tokens/s, a gradient norm with NaN and inf among finite values,
    a validation loss that was never finite (nothing to draw), and a family the catalog lacks."""
    job = create_job(srv, {"name": "edges", "model": MODEL, "data": {"kind": "passkey",
                     "seq_len": 1024}, "parallel": {"ring_size": 2}, "train": {"steps": 10}})  # fmt: skip
    d = start_running(srv, job["id"], ranks=2)
    scores = dict(zip(RULER_LENGTHS, (0.97, 0.91, 0.84, 0.62), strict=True))
    _post(d, [
        _metric(d, 7, "loss", 2.5),
        _metric(d, 7, "tokens_per_s", 3.2e15),
        *[_metric(d, s, "grad_norm", v) for s, v in enumerate((1.5, math.nan, math.inf, 0.7, 0.5))],
        *[_metric(d, s, "val_loss", math.nan) for s in (3, 7)],
        *_ruler(d, 7, scores),
        _metric(d, 7, "effective_length", 8192.0),
        *[_metric(d, 7, f"probe/len={n}", n / 4096) for n in PROBE_LENGTHS],
    ])  # fmt: skip
    return d


STAGED: dict[str, Any] = {
    "name": "ext",
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2},
    "data": {"kind": "passkey", "seq_len": 256, "key_digits": 3},
    "stages": [
        {"steps": 4, "name": "short"},
        {"steps": 4, "name": "long", "data": {"seq_len": 512}, "parallel": {"ring_size": 2}},
        {"steps": 4, "name": "longer", "data": {"seq_len": 1024}, "parallel": {"ring_size": 2}},
    ],
}
STAGE_RANKS = [1, 2, 2]  # each stage's world size


def staged_step(d: Driver, step: int) -> list[dict[str, Any]]:
    """One step's points of the staged job (steps 1..12, four a stage): the training curves, each
    rank's memory, the stage index, and an evaluation at each stage's last step."""
    stage = (step - 1) // 4
    items = [*step_items(d, step, ranks=STAGE_RANKS[stage]), _metric(d, step, "stage", stage)]
    if step % 4 == 0:
        items.append(_metric(d, step, "passkey_acc", 0.3 * (stage + 1)))
    return items


def seed_staged(srv: Server) -> Driver:
    """The staged job in its second stage (step 7 done): the first stage done, the third pending."""
    job = create_job(srv, STAGED)
    d = start_running(srv, job["id"], ranks=2)
    _post(d, [item for s in range(1, 8) for item in staged_step(d, s)])
    return d


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict[str, Driver]]]:
    """The server and the seeded jobs' drivers, by kind (a driver's job_id is its job)."""
    tmp = tmp_path_factory.mktemp("charts")
    srv = Server(make_settings(tmp), roomy_launcher())
    srv.start()
    try:
        made = {
            "passkey": seed_passkey(srv),
            "corpus": seed_corpus(srv, tmp),
            "chat": seed_chat(srv, tmp),
            "flat_zero": seed_flat_zero(srv),
            "edges": seed_edges(srv),
            "staged": seed_staged(srv),
        }
        yield srv, made
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def page(browser: Any) -> Iterator[Any]:
    """One page for the module (a page per job would start a renderer each): each test opens its
    job on it; a console error or uncaught exception on any of them fails the test that saw it."""
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    ctx.add_init_script(f"localStorage.setItem({json.dumps(TOKEN_KEY)}, {json.dumps(ALICE)})")
    pg = ctx.new_page()
    capture_errors(pg)
    try:
        yield pg
    finally:
        ctx.close()


def open_job(page: Any, srv: Server, job: Driver, ready: dict[str, int], grids: int = 0) -> None:
    """Open a job's page and wait until each chart of `ready` ({metric key: points}) is drawn and
    `grids` evaluation grids are shown."""
    page.errors.messages.clear()
    page.goto(f"{srv.url}/#/jobs/{job.job_id}")
    page.locator("#job-title").wait_for()
    wait_js(
        page,
        "(want) => Object.entries(want).every(([k, n]) => {"
        " const f = document.querySelector(`figure.chart[data-metric='${k}']`);"
        " return f && Number(f.dataset.points) === n && f.dataset.drawn === '1'; })",
        ready,
    )
    if grids:
        wait_js(page, f"() => document.querySelectorAll('#grids figure.grid').length === {grids}")


def drawn(page: Any, key: str) -> dict[str, Any]:
    """What a chart drew: its y and x tick labels, its legend, its y range and its markers."""
    return page.evaluate(
        """(key) => {
        const f = document.querySelector(`figure.chart[data-metric='${key}']`);
        const d = f.dataset;
        return {yTicks: JSON.parse(d.yTicks), xTicks: JSON.parse(d.xTicks),
                yRange: JSON.parse(d.yRange), markers: JSON.parse(d.markers),
                legend: [...f.querySelectorAll('.u-legend .u-series .u-label')].map((e) => e.textContent),
                caption: f.querySelector('figcaption').textContent};
        }""",
        key,
    )


def painted_at_points(page: Any, key: str) -> list[bool]:
    """For each finite point of the chart's first series: is the canvas painted in the series'
    colour there (a marker or a line through it), read back from the canvas's pixels."""
    return page.evaluate(
        """(key) => {
        const f = document.querySelector(`figure.chart[data-metric='${key}']`);
        const u = f.liveChart.u, canvas = u.ctx.canvas, ctx = u.ctx;
        const [r, g, b] = u.series[1]._stroke.match(/\\w\\w/g).map((x) => parseInt(x, 16));
        const out = [];
        u.data[0].forEach((x, i) => {
          const y = u.data[1][i];
          if (y === null || !Number.isFinite(y)) return;
          const cx = Math.round(u.valToPos(x, 'x', true)), cy = Math.round(u.valToPos(y, 'y', true));
          const px = ctx.getImageData(cx - 2, cy - 2, 5, 5).data;
          let hit = false;
          for (let p = 0; p < px.length; p += 4) {
            if (Math.abs(px[p] - r) + Math.abs(px[p + 1] - g) + Math.abs(px[p + 2] - b) < 60) hit = true;
          }
          out.push(hit && cx >= 0 && cx <= canvas.width && cy >= 0 && cy <= canvas.height);
        });
        return out;
    }""",
        key,
    )


def sections(page: Any) -> dict[str, Any]:
    """Which chart groups, charts and grids the page shows."""
    return page.evaluate(
        """() => ({
        groups: [...document.querySelectorAll('.charts h3.chart-group:not([hidden])')].map((e) => e.dataset.group),
        charts: [...document.querySelectorAll('.charts figure.chart')].map((e) => e.dataset.metric),
        grids: [...document.querySelectorAll('#grids figure.grid table')].map((e) => e.id),
        gridsPanel: !document.querySelector('#grids').closest('section').hidden,
        })"""
    )


def no_errors(page: Any) -> None:
    bad = page.errors.unexpected()
    assert not bad, f"page errors: {bad}"


PERCENT_TICKS = ["0%", "20%", "40%", "60%", "80%", "100%"]


def grid_cells(page: Any, grid_id: str) -> dict[str, Any]:
    return page.evaluate(
        """(id) => { const t = document.getElementById(id);
        return {rows: [...t.querySelectorAll('tbody th')].map((e) => e.textContent),
                cols: [...t.querySelectorAll('thead th')].slice(1).map((e) => e.textContent),
                cells: [...t.querySelectorAll('tbody td')].map((e) => e.textContent)}; }""",
        grid_id,
    )


def test_a_flat_zero_accuracy_reads_0_to_100_percent(jobs: Any, page: Any) -> None:
    """Every accuracy 0: the axis spans 0% to 100% (uPlot alone ranges a flat 0 over 0-100, which
    a percent axis wrote as 0% ... 10000%); a constant learning rate gets a range around it."""
    srv, made = jobs
    open_job(page, srv, made["flat_zero"], {"passkey_acc": 3, "passkey_token_acc": 3, "lr": 30}, 2)
    for key in ("passkey_acc", "passkey_token_acc"):
        acc = drawn(page, key)
        assert acc["yTicks"] == PERCENT_TICKS, acc
        assert acc["yRange"] == [0, 1] and acc["markers"] == [True]
        assert painted_at_points(page, key) == [True] * 3  # three evaluations, each a marker at 0%
    lr = drawn(page, "lr")
    assert lr["yTicks"] == ["2.8e-4", "3.0e-4", "3.2e-4"], lr
    low, high = lr["yRange"]
    assert low < 3e-4 < high and high - low < 1e-4
    grid = grid_cells(page, "passkey-grid")
    assert grid["rows"] == ["1,024", "4,096", "16,384"] and grid["cols"] == DEPTHS
    assert grid["cells"] == ["0%"] * 9
    shot(page, "charts-flat-zero")
    no_errors(page)


def test_a_passkey_job_shows_its_evaluation_in_each_unit(jobs: Any, page: Any) -> None:
    srv, made = jobs
    open_job(page, srv, made["passkey"], {"passkey_acc": 4, "mem_peak_bytes": 40, "loss": 40}, 2)
    shown = sections(page)
    assert shown["groups"] == ["training", "throughput", "memory", "eval"]
    assert "passkey_acc" in shown["charts"] and "passkey_token_acc" in shown["charts"]
    assert shown["grids"] == ["passkey-grid", "passkey_token-grid"] and shown["gridsPanel"]
    acc = drawn(page, "passkey_acc")
    assert acc["yTicks"] == PERCENT_TICKS and acc["markers"] == [True]
    assert painted_at_points(page, "passkey_acc") == [True] * 4
    # one formatter per unit: bytes in GiB, tokens/s with an SI prefix, seconds in ms, nats/token
    assert drawn(page, "mem_peak_bytes")["yTicks"] == ["3.2 GiB", "3.4 GiB", "3.6 GiB", "3.8 GiB"]
    assert drawn(page, "tokens_per_s")["yTicks"] == ["52k", "54k", "56k", "58k"]
    assert drawn(page, "step_time_s")["yTicks"] == ["320 ms", "340 ms", "360 ms", "380 ms"]
    loss = drawn(page, "loss")
    assert loss["yTicks"] == ["3", "4", "5", "6"] and "nats/token" in loss["caption"]
    assert loss["markers"] == [False]  # 40 points on 400 px: a line, no markers
    grid = grid_cells(page, "passkey-grid")
    assert grid["rows"] == ["1,024", "4,096", "16,384"]
    assert grid["cells"] == ["100%"] * 6 + ["50%"] * 3
    assert page.locator("#metric-stats dd").first.inner_text() == "6.10e-7"
    shot(page, "charts-passkey")
    no_errors(page)


def test_a_corpus_job_has_no_passkey_sections_and_orders_families_by_number(
    jobs: Any, page: Any
) -> None:
    srv, made = jobs
    open_job(page, srv, made["corpus"], {"val_loss": 4, "val_loss_pos": 4, "mem_peak_bytes": 40})
    shown = sections(page)
    assert shown["groups"] == ["training", "throughput", "memory", "validation"]
    assert not any(key.startswith("passkey") for key in shown["charts"])
    assert shown["grids"] == [] and not shown["gridsPanel"]  # no retrieval grid, not even empty
    assert page.locator("#grids-h").is_hidden()
    buckets = drawn(page, "val_loss_pos")
    assert buckets["legend"] == ["step", *(f"pos={b}" for b in BUCKETS)]
    assert buckets["markers"] == [True] * 6  # four evaluations each: markers on every bucket
    # the profile is drawn as the snapshot's members are read: wait for all of them
    profile = "document.querySelector(\"figure[data-metric='val_loss_pos-profile']\")?.dataset"
    wait_js(page, f"(x) => {profile}?.drawn && {profile}.x === JSON.stringify(x)", BUCKETS)
    assert drawn(page, "val_loss_pos-profile")["xTicks"] == BUCKETS
    ranks = drawn(page, "mem_peak_bytes")
    assert ranks["legend"] == ["step", *(f"rank {r}" for r in range(12))]
    assert ranks["yTicks"] == ["3 GiB", "4 GiB", "5 GiB"]
    val = drawn(page, "val_loss")
    assert val["yTicks"] == ["2.50", "2.52", "2.54", "2.56", "2.58"], val
    shot(page, "charts-corpus")
    no_errors(page)


def test_a_chat_job_with_one_evaluation_shows_its_points(jobs: Any, page: Any) -> None:
    """One point per series: a marker on it, an x axis of the steps around it (not 0-40), a y axis
    around its value."""
    srv, made = jobs
    open_job(page, srv, made["chat"], {"val_loss": 1, "val_loss_pos": 1, "loss": 20})
    shown = sections(page)
    assert shown["groups"] == ["training", "throughput", "memory", "validation"]
    assert shown["grids"] == [] and not shown["gridsPanel"]
    val = drawn(page, "val_loss")
    assert val["xTicks"] == ["18", "19", "20"], val
    assert val["yTicks"] == ["1.7", "1.8", "1.9", "2.0"] and val["markers"] == [True]
    assert val["yRange"][0] < 1.87 < val["yRange"][1]
    assert painted_at_points(page, "val_loss") == [True]
    buckets = drawn(page, "val_loss_pos")
    assert buckets["markers"] == [True] * 6
    assert buckets["legend"] == ["step", *(f"pos={b}" for b in BUCKETS)]
    assert painted_at_points(page, "val_loss_pos") == [True]
    assert drawn(page, "mem_peak_bytes")["legend"] == ["step", "rank 0", "rank 1"]
    shot(page, "charts-chat")
    no_errors(page)


def test_one_point_non_finite_huge_ruler_and_uncatalogued_series(jobs: Any, page: Any) -> None:
    """Single points, NaN and inf among finite values, a never-finite series, 3.2e15 tokens/s, a
    RULER evaluation drawn from the catalog (its score by length as a family chart and a profile,
    the task x length grid, the effective length), and a family the catalog lacks; live too."""
    srv, made = jobs
    ready = {"loss": 1, "grad_norm": 5, "tokens_per_s": 1, "ruler_len": 1, "probe/len={len}": 1}
    open_job(page, srv, made["edges"], ready, grids=1)
    shown = sections(page)
    assert shown["groups"] == ["training", "throughput", "validation", "eval", "other"]
    assert shown["charts"] == ["loss", "grad_norm", "tokens_per_s", "val_loss", "ruler_len",
                               "ruler_len-profile", "probe/len={len}"]  # fmt: skip
    assert shown["grids"] == ["ruler_task-grid"] and shown["gridsPanel"]
    loss = drawn(page, "loss")
    assert loss["xTicks"] == ["6", "7", "8"] and loss["markers"] == [True]
    assert painted_at_points(page, "loss") == [True]
    assert drawn(page, "tokens_per_s")["yTicks"] == ["3.0P", "3.2P", "3.4P"]
    # NaN and inf: gaps, counted in the caption; the three finite points drawn
    grad = page.locator("figure[data-metric='grad_norm']")
    assert grad.get_attribute("data-non-finite") == "2"
    assert "5 pts, 2 not finite" in grad.locator("figcaption").inner_text()
    assert painted_at_points(page, "grad_norm") == [True, True, True]
    # a series of NaN only: its chart says so, no empty axes
    val = page.locator("figure[data-metric='val_loss']")
    assert val.locator("p.empty").inner_text() == "No finite values (NaN or inf) to draw"
    assert val.locator("canvas").count() == 0
    # RULER, from the catalog: a series per length in numeric order, on a percent axis
    ruler = drawn(page, "ruler_len")
    assert ruler["legend"] == ["step", *(f"len={n}" for n in RULER_LENGTHS)]
    assert ruler["markers"] == [True] * 4 and ruler["xTicks"] == ["6", "7", "8"]
    assert ruler["yTicks"] == PERCENT_TICKS and ruler["caption"].startswith(
        "RULER score by context length"
    )
    wait_profile(page, "ruler_len", [str(n) for n in RULER_LENGTHS])  # drawn as members are read
    profile = drawn(page, "ruler_len-profile")
    assert profile["xTicks"] == ["4,096", "8,192", "16,384", "32,768"]
    assert profile["yTicks"] == PERCENT_TICKS
    assert profile_of(page, "ruler_len") == {"x": [str(n) for n in RULER_LENGTHS], "points": [0.97, 0.91, 0.84, 0.62],
                                             "step": "7", "first": [], "firstStep": ""}  # fmt: skip
    wait_js(page, "() => document.querySelectorAll('#ruler_task-grid tbody td').length === 8")
    grid = grid_cells(page, "ruler_task-grid")
    assert grid == {"rows": RULER_TASKS, "cols": ["4,096", "8,192", "16,384", "32,768"],
                    "cells": ["97%", "91%", "84%", "62%", "77%", "71%", "64%", "42%"]}  # fmt: skip
    effective = page.locator("#metric-stats dd[data-metric='effective_length']").inner_text()
    want = format_value(
        EFFECTIVE_LENGTH.unit, EFFECTIVE_LENGTH.format, EFFECTIVE_LENGTH.digits, 8192.0
    )
    assert effective == want and effective.startswith("8192")  # as `ringtrain status` writes it
    dt = page.locator("#metric-stats dt").all_inner_texts()
    assert dt == ["Effective context length"]
    # a family the catalog lacks: one chart, its members by number
    assert drawn(page, "probe/len={len}")["legend"] == ["step", "len=512", "len=1024", "len=2048"]
    # live: a second RULER evaluation at six lengths (a shorter and a longer one join), and a finite
    # held-out loss
    d = made["edges"]
    scores = {
        2048: 1.0,
        **dict(zip(RULER_LENGTHS, (0.99, 0.95, 0.9, 0.7), strict=True)),
        65536: 0.3,
    }
    _post(d, [*_ruler(d, 9, scores), _metric(d, 9, "val_loss", 2.25)])
    wait_js(
        page,
        "() => document.querySelector(\"figure[data-metric='val_loss']\").dataset.points === '3'",
    )
    wait_js(
        page,
        "() => document.querySelectorAll(\"figure[data-metric='ruler_len'] .u-legend .u-series\").length === 7",
    )
    ruler = drawn(page, "ruler_len")
    lengths = [2048, *RULER_LENGTHS, 65536]
    assert ruler["legend"] == ["step", *(f"len={n}" for n in lengths)]
    wait_js(
        page,
        "() => document.querySelector(\"figure[data-metric='ruler_len-profile']\").dataset.step === '9'",
    )
    wait_js(page, "() => document.querySelectorAll('#ruler_task-grid thead th').length === 7")
    want_profile = {
        "x": [str(n) for n in lengths],
        "points": [1.0, 0.99, 0.95, 0.9, 0.7, 0.3],  # the latest evaluation ...
        "step": "9",
        "first": [None, 0.97, 0.91, 0.84, 0.62, None],  # ... against the first
        "firstStep": "7",
    }
    # live members reach the profile one by one (throttled redraws): read until all are in
    assert read_until(lambda: profile_of(page, "ruler_len"), want_profile, page) == want_profile
    ticks = ["2,048", "4,096", "8,192", "16,384", "32,768", "65,536"]
    assert read_until(lambda: drawn(page, "ruler_len-profile")["xTicks"], ticks, page) == ticks
    wait_js(
        page,
        "() => [...document.querySelectorAll('#ruler_task-grid tbody td')]"
        ".filter((td) => td.textContent.trim()).length === 12",
    )
    grid = grid_cells(page, "ruler_task-grid")
    assert grid["cols"] == ["2,048", "4,096", "8,192", "16,384", "32,768", "65,536"]
    assert grid["cells"] == [
        "100%",
        "99%",
        "95%",
        "90%",
        "70%",
        "30%",
        "80%",
        "79%",
        "75%",
        "70%",
        "50%",
        "10%",
    ]
    val_now = drawn(page, "val_loss")
    assert val_now["markers"] == [True] and painted_at_points(page, "val_loss") == [True]
    shot(page, "charts-edges")
    no_errors(page)


def wait_profile(page: Any, key: str, xs: list[str]) -> None:
    """Wait until a profile chart is drawn with `xs` (its field's values) along x."""
    profile = f"document.querySelector(\"figure[data-metric='{key}-profile']\")?.dataset"
    wait_js(page, f"(x) => {profile}?.drawn && {profile}.x === JSON.stringify(x)", xs)


def profile_of(page: Any, key: str) -> dict[str, Any]:
    """What a profile chart shows: its x (field values), the latest evaluation's values and step,
    the first evaluation's."""
    return page.evaluate(
        """(key) => { const d = document.querySelector(`figure[data-metric='${key}-profile']`).dataset;
        return {x: JSON.parse(d.x), points: JSON.parse(d.points), step: d.step,
                first: JSON.parse(d.first), firstStep: d.firstStep}; }""",
        key,
    )


def stage_rows(page: Any) -> list[list[str]]:
    """The stages table: each row's cells, and "current" last where the row is the current one."""
    return page.evaluate(
        """() => [...document.querySelectorAll('#stages-table tbody tr')].map((tr) =>
        [...[...tr.children].map((c) => c.textContent),
         ...(tr.getAttribute('aria-current') === 'step' ? ['current'] : [])])"""
    )


def marks(page: Any) -> dict[str, list[list[Any]]]:
    """The stage boundaries each chart over steps drew, by chart: [step, label] each."""
    return page.evaluate(
        """() => Object.fromEntries([...document.querySelectorAll('figure.chart:not(.profile)')]
        .filter((f) => f.dataset.drawn === '1')
        .map((f) => [f.dataset.metric, JSON.parse(f.dataset.marks || '[]').map((m) => [m.step, m.label])]))"""
    )


def marks_painted(page: Any, key: str) -> list[dict[str, Any]]:
    """For each boundary a chart drew: where it was noted (CSS px) against where the series' point
    at its step is, and the share of the plot's height painted in the boundary colour on the pixel
    column of that point and on a column 8 px to its left, read back from the canvas."""
    return page.evaluate(
        """(key) => {
        const f = document.querySelector(`figure.chart[data-metric='${key}']`);
        const u = f.liveChart.u, ctx = u.ctx, { top, height } = u.bbox;
        const mark = getComputedStyle(document.documentElement).getPropertyValue('--mark').trim();
        const [r, g, b] = mark.match(/\\w\\w/g).map((x) => parseInt(x, 16));
        const share = (cx) => {
          const px = ctx.getImageData(cx, top, 1, height).data;
          let n = 0;
          for (let p = 0; p < px.length; p += 4) {
            if (Math.abs(px[p] - r) + Math.abs(px[p + 1] - g) + Math.abs(px[p + 2] - b) < 60) n++;
          }
          return n / height;
        };
        return JSON.parse(f.dataset.marks).map((m) => {
          const at = u.data[0][u.data[0].indexOf(m.step)];
          const cx = Math.round(u.valToPos(at, 'x', true));
          return { step: m.step, noted: m.x, point: Math.round(u.valToPos(at, 'x') * 10) / 10,
                   on: share(cx), beside: share(cx - Math.round(8 * devicePixelRatio)) };
        });
    }""",
        key,
    )


SHAPE_1 = "dp 1 × ring 1 × ulysses 1 × tensor 1 (zigzag)"
SHAPE_2 = "dp 1 × ring 2 × ulysses 1 × tensor 1 (zigzag)"


def read_until(read: Any, want: Any, page: Any, timeout_s: float = 15.0) -> Any:
    """`read()` again until it gives `want` or the time is up; returns the last reading."""
    deadline = time.monotonic() + timeout_s
    while (got := read()) != want and time.monotonic() < deadline:
        page.wait_for_timeout(100)
    return got


def marks_painted_once_drawn(
    page: Any, key: str, steps: list[int], timeout_s: float = 15.0
) -> list[dict[str, Any]]:
    """`marks_painted`, read again until the canvas shows every boundary: live points reach the
    chart's data (and its `data-marks`) before its throttled redraw paints them."""
    deadline = time.monotonic() + timeout_s
    while True:
        painted = marks_painted(page, key)
        drawn = [m["step"] for m in painted] == steps and all(m["on"] > 0.4 for m in painted)
        if drawn or time.monotonic() > deadline:
            return painted
        page.wait_for_timeout(100)


def test_a_staged_job_shows_its_stages_and_their_boundaries(jobs: Any, page: Any) -> None:
    """The stages table (steps, length, shape, ranks, state; the current one marked), a dashed line
    labelled with the stage's name on every chart over steps where a stage takes over, no chart of
    the stage index; live, the table follows the job into its next stage."""
    srv, made = jobs
    d = made["staged"]
    open_job(page, srv, d, {"loss": 7, "mem_peak_bytes": 7, "passkey_acc": 1})
    wait_js(page, "() => document.querySelectorAll('#stages-table tbody tr').length === 3")
    assert page.locator("#stages-h").is_visible()
    assert stage_rows(page) == [
        ["1", "short", "1–4", "256", SHAPE_1, "1", "done"],
        ["2", "long current", "5–8", "512", SHAPE_2, "2", "RUNNING", "current"],
        ["3", "longer", "9–12", "1,024", SHAPE_2, "2", "pending"],
    ]
    assert page.locator("#job-shape").inner_text() == f"{SHAPE_2}, seq_len 512 (stage long)"
    shown = sections(page)
    assert "stage" not in shown["charts"]  # its boundaries show it
    assert shown["charts"] == ["loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mem_peak_bytes",
                               "passkey_acc"]  # fmt: skip
    # steps 1..7: one boundary in view, where "long" takes over from step 4, on every chart
    assert marks(page) == {key: [[4, "long"]] for key in shown["charts"]}
    (at4,) = marks_painted_once_drawn(page, "loss", [4])
    assert at4["noted"] == at4["point"] and at4["on"] > 0.4 and at4["beside"] < 0.1, at4
    # live: steps 8 and 9 (the third stage, on the same two ranks: no state change) move the table
    # on and bring the second boundary into view
    _post(d, staged_step(d, 8) + staged_step(d, 9))
    wait_js(
        page,
        "() => document.querySelector('#stages-table tr[aria-current]')?.dataset.stage === '2'",
    )
    wait_js(
        page,
        "() => document.querySelector(\"figure[data-metric='loss']\").dataset.marks.includes('longer')",
    )
    assert stage_rows(page) == [
        ["1", "short", "1–4", "256", SHAPE_1, "1", "done"],
        ["2", "long", "5–8", "512", SHAPE_2, "2", "done"],
        ["3", "longer current", "9–12", "1,024", SHAPE_2, "2", "RUNNING", "current"],
    ]
    assert page.locator("#job-shape").inner_text() == f"{SHAPE_2}, seq_len 1024 (stage longer)"
    wait_js(
        page,
        "() => document.querySelector(\"figure[data-metric='passkey_acc']\").dataset.points === '2'",
    )
    assert marks(page) == {key: [[4, "long"], [8, "longer"]] for key in shown["charts"]}
    painted = marks_painted_once_drawn(page, "loss", [4, 8])
    assert [m["step"] for m in painted] == [4, 8]
    for m in painted:
        assert m["noted"] == m["point"] and m["on"] > 0.4 and m["beside"] < 0.1, m
    assert painted[0]["noted"] < painted[1]["noted"]
    shot(page, "charts-staged")
    no_errors(page)


def test_the_page_and_the_cli_write_values_alike(jobs: Any, page: Any) -> None:
    """units.js and the CLI's units.py: the same text for each unit's known answers."""
    from tests.unit.api.test_cli_units import KNOWN

    srv, _ = jobs
    page.goto(f"{srv.url}/#/jobs")
    page.locator("#jobs-table").wait_for()
    rows = [[unit, fmt, digits, value] for unit, fmt, digits, value, _ in KNOWN]
    shown = page.evaluate(
        """async (rows) => { const { unitOf } = await import('/static/js/units.js');
        return rows.map(([unit, format, digits, v]) => unitOf({ unit, format, digits }).value(v)); }""",
        rows,
    )
    assert shown == [format_value(*row) for row in rows] == [text for *_, text in KNOWN]
    no_errors(page)
