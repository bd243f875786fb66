// Compare runs (#/compare?ids=a,b,c&metric=loss): pick jobs, overlay one metric of each on one chart (uPlot,
// x = step), and list where their specs differ, side by side. Data: each job's /series snapshot (downsampled on
// the server, as the job page loads it). Per-rank metrics are shown as their mean over ranks at each step.
import uPlot from "../vendor/uplot/uPlot.esm.js";
import { api } from "./api.js";
import { unitAxes } from "./charts.js";
import { Catalog, loadCatalog, naturalCompare } from "./metrics.js";
import { PLAIN, showMarkers } from "./units.js";
import { cssVar, h, PALETTE, stateBadge } from "./util.js";

const MAX_JOBS = PALETTE.length;
const HEIGHT = 320;
const state = (window.__ringtrain ||= { renders: [], snapshots: [] });

/** {"model": {"d_model": 32}} → {"model.d_model": "32"}; lists as JSON. */
export function flatten(obj, prefix = "", out = {}) {
  for (const [k, v] of Object.entries(obj || {})) {
    const key = prefix + k;
    if (v && typeof v === "object" && !Array.isArray(v) && Object.keys(v).length) flatten(v, `${key}.`, out);
    else out[key] = typeof v === "string" ? v : JSON.stringify(v);
  }
  return out;
}

/** One (steps, values) line per job for `name`: the global series, else the mean over ranks at each step. */
function line(snap, name) {
  const all = snap.series.filter((s) => s.name === name);
  const global = all.find((s) => s.rank === null);
  if (global) return [global.step, global.value];
  const sums = new Map();
  for (const s of all) {
    s.step.forEach((st, i) => {
      const v = s.value[i];
      if (v === null) return;
      const [sum, n] = sums.get(st) || [0, 0];
      sums.set(st, [sum + v, n + 1]);
    });
  }
  const steps = [...sums.keys()].sort((a, b) => a - b);
  return [steps, steps.map((st) => sums.get(st)[0] / sums.get(st)[1])];
}

export function mountCompare(root, query) {
  const ctrl = new AbortController();
  const selected = [...new Set((query.get("ids") || "").split(",").filter(Boolean))].slice(0, MAX_JOBS);
  let metric = query.get("metric") || ""; // none asked for: the first in catalog order (the loss)
  let catalog = new Catalog();
  const snaps = new Map(); // job id -> /series snapshot
  let u = null;
  let destroyed = false;

  const picker = h("tbody");
  const metricSel = h("select#compare-metric", { "aria-label": "Metric" });
  metricSel.addEventListener("change", () => { metric = metricSel.value; remember(); draw(); });
  const plot = h("div.plot#compare-plot");
  const note = h("p.muted#compare-note", { "aria-live": "polite" });
  const diffBox = h("div#spec-diff");
  const err = h("p.error-text", { role: "alert", hidden: true });
  root.append(
    h("section.panel", { "aria-labelledby": "compare-h" },
      h("div.toolbar", {}, h("h1#compare-h", {}, "Compare runs"), h("span.spacer"),
        h("label", { for: "compare-metric" }, "Metric"), metricSel),
      err,
      h("div.compare", {},
        h("div.compare-pick", {},
          h("table#compare-jobs", {}, h("caption.sr-only", {}, "Jobs to compare"),
            h("thead", {}, h("tr", {}, h("th", { scope: "col" }, h("span.sr-only", {}, "Compare")),
              h("th", { scope: "col" }, "Job"), h("th", { scope: "col" }, "State"))),
            picker)),
        h("div.compare-main", {},
          h("figure.chart.compare-chart", { "aria-label": "The selected jobs' metric, one line per job" },
            plot, note),
          h("h2", {}, "Spec differences"), diffBox))));
  const ro = new ResizeObserver(() => { if (u) u.setSize({ width: width(), height: HEIGHT }); });
  ro.observe(plot);

  function width() { return Math.max(300, plot.clientWidth || 600); }

  function remember() {
    const ids = selected.map(encodeURIComponent).join(",");  // commas kept readable: a link to share
    history.replaceState(null, "", `#/compare?${ids ? `ids=${ids}&` : ""}metric=${encodeURIComponent(metric)}`);
  }

  async function loadJobs() {
    try {
      const res = await api("/v1/jobs?limit=100", { signal: ctrl.signal });
      const known = new Set(res.jobs.map((j) => j.id));
      const rows = res.jobs.map((j) => pickRow(j.id, j.name, j.state));
      for (const id of selected) if (!known.has(id)) rows.push(pickRow(id, id, ""));
      picker.replaceChildren(...(rows.length ? rows : [h("tr", {}, h("td.muted", { colspan: 3 }, "No jobs yet."))]));
    } catch (e) {
      if (e.name !== "AbortError") { err.textContent = `Could not load jobs: ${e.message}`; err.hidden = false; }
    }
  }

  function pickRow(id, name, st) {
    const box = h("input", { type: "checkbox", id: `pick-${id}`, dataset: { jobId: id }, checked: selected.includes(id) });
    box.addEventListener("change", () => {
      const i = selected.indexOf(id);
      if (box.checked && i < 0) {
        if (selected.length >= MAX_JOBS) { box.checked = false; note.textContent = `At most ${MAX_JOBS} jobs at once.`; return; }
        selected.push(id);
      } else if (!box.checked && i >= 0) selected.splice(i, 1);
      remember();
      refresh();
    });
    return h("tr", { dataset: { jobId: id } }, h("td", {}, box),
      h("td", {}, h("label", { for: `pick-${id}` }, name), h("div.muted.mono", {}, id)),
      h("td", {}, st ? stateBadge(st) : null));
  }

  async function refresh() {
    const missing = selected.filter((id) => !snaps.has(id));
    try {
      await Promise.all(missing.map(async (id) => {
        const snap = await api(`/v1/jobs/${encodeURIComponent(id)}/series?max_points=4000&logs=0`, { signal: ctrl.signal });
        snaps.set(id, snap);
      }));
      err.hidden = true;
    } catch (e) {
      if (e.name === "AbortError") return;
      err.textContent = `Could not load a job's metrics: ${e.message}`;
      err.hidden = false;
    }
    if (destroyed) return;
    const names = new Set();
    for (const id of selected) for (const s of snaps.get(id)?.series || []) names.add(s.name);
    // catalog order (its entries' order, then the names a family holds), then names it lacks
    const rank = (n) => catalog.lookup(n)?.metric.order ?? Infinity;
    const sorted = [...names].sort((a, b) => rank(a) - rank(b) || naturalCompare(a, b));
    if (sorted.length && !names.has(metric)) metric = sorted[0];
    metricSel.replaceChildren(...sorted.map((n) => h("option", { value: n, selected: n === metric }, n)));
    draw();
  }

  function jobsShown() { return selected.filter((id) => snaps.has(id)).map((id) => snaps.get(id)); }

  function draw() {
    if (u) { u.destroy(); u = null; }
    const shown = jobsShown();
    renderDiff(shown);
    const lines = shown.map((s) => line(s, metric));
    state.compare = { metric, jobs: shown.map((s, i) => ({ id: s.job.id, points: lines[i][0].length })) };
    if (shown.length < 2) note.textContent = "Pick two or more jobs to compare.";
    else if (!lines.some((l) => l[0].length)) note.textContent = `No ${metric} points in these jobs yet.`;
    else note.textContent = "Drag across the chart to zoom, double-click to reset.";
    if (!shown.length || !lines.some((l) => l[0].length)) { plot.hidden = true; return; }
    plot.hidden = false;
    const data = uPlot.join(lines.map(([x, y]) => [x, y]));
    const axis = { stroke: cssVar("--muted"), grid: { stroke: cssVar("--grid"), width: 1 },
      ticks: { stroke: cssVar("--grid"), width: 1 } };
    const unit = catalog.lookup(metric)?.metric.unitFormat || PLAIN; // its unit (units.js)
    u = new uPlot({
      width: width(), height: HEIGHT, ...unitAxes(unit, axis),
      series: [{ label: "step" }, ...shown.map((s, i) => ({
        label: `${s.job.name} (${s.job.id})`, stroke: PALETTE[i % PALETTE.length], width: 1.5, spanGaps: true,
        points: { show: showMarkers, size: 6 }, value: (_, v) => unit.value(v),
      }))],
      cursor: { drag: { x: true, y: false, setScale: true } },
      legend: { live: true },
    }, data, plot);
  }

  function renderDiff(shown) {
    if (shown.length < 2) { diffBox.replaceChildren(h("p.muted", {}, "Pick two or more jobs to see how their specs differ.")); return; }
    const flat = shown.map((s) => flatten(s.job.spec));
    const keys = [...new Set(flat.flatMap((f) => Object.keys(f)))].sort();
    const differ = keys.filter((k) => new Set(flat.map((f) => f[k] ?? "—")).size > 1);
    const finals = shown.map((s) => { const [, y] = line(s, metric); return y.length ? y[y.length - 1] : null; });
    const unit = catalog.lookup(metric)?.metric.unitFormat || PLAIN; // as the chart's axis
    const head = h("tr", {}, h("th", { scope: "col" }, "Parameter"), shown.map((s, i) => h("th", { scope: "col" },
      h("span.swatch", { style: { background: PALETTE[i % PALETTE.length] } }), s.job.name, " ", stateBadge(s.job.state),
      h("div.muted.mono", {}, s.job.id))));
    const rows = [
      h("tr.final", {}, h("th", { scope: "row" }, `last ${metric}`),
        finals.map((v) => h("td.num", {}, unit.value(v)))),
      ...differ.map((k) => h("tr", { dataset: { param: k } }, h("th.mono", { scope: "row" }, k),
        flat.map((f) => h("td.mono", {}, f[k] ?? "—")))),
    ];
    diffBox.replaceChildren(
      h("table#spec-diff-table", {}, h("caption.sr-only", {}, "Parameters that differ between the selected jobs"),
        h("thead", {}, head), h("tbody", {}, rows)),
      h("p.muted", {}, differ.length
        ? `${differ.length} of ${keys.length} parameters differ; the other ${keys.length - differ.length} are the same.`
        : `The specs are identical (${keys.length} parameters).`));
  }

  loadJobs();
  loadCatalog().then((c) => { catalog = c; }, (e) => console.warn("metric catalog:", e.message))
    .finally(() => { if (!destroyed) refresh(); });
  return () => { destroyed = true; ctrl.abort(); ro.disconnect(); if (u) u.destroy(); };
}
