// Live line charts on uPlot (vendored, MIT): x = step, one series per metric (and per rank where
// the metric is per rank, or per member of a catalog family). Initial data comes downsampled from
// the server; live points are appended in place and redrawn at most every DRAW_MS. Drag to zoom,
// double-click or "Reset" to reset; keyboard: + − ← → 0.
// The y axis is the metric's unit (units.js: tick labels, a range that holds a flat series); a
// point that stands alone gets a marker; a NaN or inf value (stored as null) is a gap in its line
// and counted in the caption. A job with stages has a dashed line at each stage's first step
// (stages.js), labelled with the stage's name.
import uPlot from "../vendor/uplot/uPlot.esm.js";
import { naturalCompare } from "./metrics.js";
import { drawMarks } from "./stages.js";
import { PLAIN, showMarkers, STEP_INCRS, stepRange } from "./units.js";
import { cssVar, h, PALETTE } from "./util.js";

const DRAW_MS = 250;
const HEIGHT = 220;
export const timings = (window.__ringtrain ||= { renders: [], snapshots: [] });
const finite = (v) => typeof v === "number" && Number.isFinite(v);

function lowerBound(xs, x) {
  let lo = 0, hi = xs.length;
  while (lo < hi) { const m = (lo + hi) >> 1; if (xs[m] < x) lo = m + 1; else hi = m; }
  return lo;
}

/** The axes, scales and size of a chart's y axis in `unit` (units.js), and its x axis of steps. */
export function unitAxes(unit, axis) {
  return {
    scales: {
      x: { time: false, range: stepRange },
      y: { range: (u, lo, hi) => unit.axisRange(lo, hi) },
    },
    axes: [{ ...axis, incrs: STEP_INCRS }, {
      ...axis, incrs: unit.incrs,
      values: (u, splits) => {
        const { min, max } = u.scales.y;
        return unit.ticks(splits, Math.max(Math.abs(min), Math.abs(max)));
      },
      size: (u, values) => 18 + 7 * Math.max(3, ...(values || []).map((v) => String(v).length)),
    }],
  };
}

/** What a uPlot chart drew, on its figure's dataset: tick labels (uPlot keeps the last ones in
 * `axes[i]._values`), y range, which series have markers; the canvas holds only pixels. */
export function noteDrawn(u, fig) {
  const [i0, i1] = u.series[0].idxs || [null, null];
  const d = fig.dataset;
  d.xTicks = JSON.stringify(u.axes[0]._values || []);
  d.yTicks = JSON.stringify(u.axes[1]._values || []);
  d.yRange = JSON.stringify([u.scales.y.min, u.scales.y.max]);
  const marked = u.series.slice(1).map((s, i) => Boolean(s.points.show(u, i + 1, i0, i1)));
  d.markers = JSON.stringify(marked);
  d.drawn = "1";
}

export class LiveChart {
  /**
   * @param {HTMLElement} parent where the <figure> goes
   * @param {{id: string, title: string, unit?: object, fmt?: (v:number)=>string}} opts `unit`:
   *   units.js's (values, ticks, range); `fmt` alone: values so written on a plain axis
   */
  constructor(parent, opts) {
    this.opts = opts;
    const fmt = opts.fmt;  // writes finite values only: the plain unit writes the others
    const written = fmt && ((v) => (finite(v) ? fmt(v) : PLAIN.value(v)));
    this.unit = opts.unit || (fmt ? { ...PLAIN, value: written } : PLAIN);
    this.bad = new Set(); // "key|step" of the points that were not finite (NaN, inf: stored null)
    this.marks = []; // [{step, label}]: the stage boundaries drawn across the chart
    this.xs = [];
    this.keys = []; // series keys: "" (one global series), "rank N", or a family member's label
    this.ys = new Map();
    this.u = null;
    this.userZoom = false;
    this.dirty = false;
    this.keysChanged = false;
    this.lastDraw = 0;
    this.timer = null;
    this.plot = h("div.plot");
    this.empty = h("p.empty", {}, "No points yet");
    this.reset = h("button", { type: "button", title: "Reset zoom (0)", onclick: () => this.resetZoom() }, "Reset");
    this.fig = h("figure.chart", {
      id: `chart-${opts.id}`, tabindex: 0, dataset: { metric: opts.id },
      "aria-label": `${opts.title} chart. Drag or press + and − to zoom, arrow keys to pan, 0 to reset.`,
    }, h("figcaption", {}, opts.title, unitHint(this.unit, opts.title),
      h("span.hint.count", {}, ""), this.reset), this.plot, this.empty);
    this.fig.liveChart = this; // the chart behind a figure (the browser tests read its canvas)
    this.count = this.fig.querySelector(".count");
    this.fig.addEventListener("keydown", (e) => this.onKey(e));
    parent.append(this.fig);
    this.ro = new ResizeObserver(() => {
      if (this.u) this.u.setSize({ width: this.width(), height: HEIGHT });
    });
    this.ro.observe(this.plot);
    this.mq = matchMedia("(prefers-color-scheme: dark)");
    this.onScheme = () => this.rebuild();
    this.mq.addEventListener("change", this.onScheme);
  }

  width() { return Math.max(200, this.plot.clientWidth || this.fig.clientWidth - 16); }

  key(rank, label) {
    const r = rank === null || rank === undefined ? "" : `rank ${rank}`;
    return label ? (r ? `${label} ${r}` : label) : r;
  }

  static order(a, b) { return a === "" ? -1 : b === "" ? 1 : naturalCompare(a, b); }

  /** Replace everything with server series: [{rank, label?, step: [...], value: [...]}]. */
  load(seriesList) {
    const keyed = seriesList.map((s) => ({ key: this.key(s.rank, s.label), s }));
    keyed.sort((a, b) => LiveChart.order(a.key, b.key));
    this.keys = keyed.map((x) => x.key);
    this.bad = new Set(keyed.flatMap(({ key, s }) =>
      s.step.filter((_, i) => !finite(s.value[i])).map((st) => `${key}|${st}`)));
    const sorted = keyed.map(({ s }) =>
      ({ step: s.step, value: s.value.map((v) => (finite(v) ? v : null)) }));
    if (sorted.length === 1) {
      this.xs = sorted[0].step.slice();
      this.ys = new Map([[this.keys[0], sorted[0].value.slice()]]);
    } else if (sorted.length > 1) {
      const joined = uPlot.join(sorted.map((s) => [s.step, s.value]));
      this.xs = Array.from(joined[0]);
      this.ys = new Map(this.keys.map((k, i) => [k, Array.from(joined[i + 1])]));
    }
    this.keysChanged = true;
    this.draw();
  }

  /** Append (or overwrite) one point; cheap for increasing steps. `label`: a family member. */
  push(step, rank, raw, label) {
    const k = this.key(rank, label);
    const value = finite(raw) ? raw : null;
    if (value === null) this.bad.add(`${k}|${step}`); else this.bad.delete(`${k}|${step}`);
    let ys = this.ys.get(k);
    if (!ys) {
      ys = new Array(this.xs.length).fill(undefined);
      this.ys.set(k, ys);
      this.keys.push(k);
      this.keys.sort(LiveChart.order);
      this.keysChanged = true;
    }
    const n = this.xs.length;
    if (n === 0 || step > this.xs[n - 1]) {
      this.xs.push(step);
      for (const arr of this.ys.values()) arr.push(undefined);
      ys[n] = value;
    } else {
      const i = lowerBound(this.xs, step);
      if (this.xs[i] !== step) {
        this.xs.splice(i, 0, step);
        for (const arr of this.ys.values()) arr.splice(i, 0, undefined);
      }
      ys[i] = value;
    }
    this.schedule();
  }

  /** A retry resumed from `step`: points after it are superseded. */
  truncateAfter(step) {
    const i = lowerBound(this.xs, step + 1);
    if (i >= this.xs.length) return;
    this.xs.length = i;
    for (const arr of this.ys.values()) arr.length = i;
    for (const b of [...this.bad]) {
      if (Number(b.slice(b.lastIndexOf("|") + 1)) > step) this.bad.delete(b);
    }
    this.schedule();
  }

  get points() { return this.xs.length; }

  /** The stage boundaries to draw ([{step, label}], stages.js's stageMarks), redrawn now. */
  setMarks(marks) {
    if (JSON.stringify(marks) === JSON.stringify(this.marks)) return;
    this.marks = marks;
    if (this.u) this.u.redraw(false);
  }

  schedule() {
    this.dirty = true;
    if (this.timer) return;
    const wait = Math.max(0, DRAW_MS - (performance.now() - this.lastDraw));
    this.timer = setTimeout(() => { this.timer = null; requestAnimationFrame(() => this.draw()); }, wait);
  }

  data() { return [this.xs, ...this.keys.map((k) => this.ys.get(k))]; }

  draw() {
    this.dirty = false;
    this.lastDraw = performance.now();
    const n = this.xs.length;
    // points, but none finite (NaN or inf only): nothing to draw, and the page says why
    const drawable = n > 0 && [...this.ys.values()].some((ys) => ys.some((v) => v != null));
    this.empty.hidden = drawable;
    this.empty.textContent = n ? "No finite values (NaN or inf) to draw" : "No points yet";
    this.plot.hidden = !drawable;
    this.fig.dataset.points = String(n);
    this.fig.dataset.nonFinite = String(this.bad.size);
    this.count.textContent = n ? `${n.toLocaleString("en-US")} pts` +
      (this.bad.size ? `, ${this.bad.size.toLocaleString("en-US")} not finite` : "") : "";
    if (!drawable) {
      if (this.u) { this.u.destroy(); this.u = null; }
      return;
    }
    if (!this.u || this.keysChanged) { this.rebuild(); return; }
    this.drawStart = performance.now();
    this.u.setData(this.data(), !this.userZoom);
  }

  rebuild() {
    if (this.u) { this.u.destroy(); this.u = null; }
    this.keysChanged = false;
    if (!this.xs.length) return;
    const unit = this.unit;
    const axis = { stroke: cssVar("--muted"), grid: { stroke: cssVar("--grid"), width: 1 },
      ticks: { stroke: cssVar("--grid"), width: 1 } };
    const multi = this.keys.length > 1 || this.keys[0] !== "";
    // a gap where a value was not finite (null); steps a series lacks (undefined) are spanned
    const series = [{ label: "step" }, ...this.keys.map((k, i) => {
      const stroke = multi ? PALETTE[i % PALETTE.length] : cssVar("--accent");
      return { label: k || this.opts.title, stroke, width: 1.5,
        points: { show: showMarkers, size: 7, fill: stroke }, value: (u, v) => unit.value(v) };
    })];
    const t0 = performance.now();
    this.drawStart = t0;
    let measured = false;
    const points = this.xs.length;
    const opts = {
      width: this.width(), height: HEIGHT, series, ...unitAxes(unit, axis),
      cursor: { drag: { x: true, y: false, setScale: true } },
      legend: { live: true },
      hooks: {
        setSelect: [(u) => { if (u.select.width > 2) this.userZoom = true; }],
        draw: [(u) => {
          this.lastDrawMs = performance.now() - this.drawStart;
          drawMarks(u, this.marks, this.fig);
          noteDrawn(u, this.fig);
          if (measured) return;
          measured = true;
          timings.renders.push({ chart: this.opts.id, points, series: this.keys.length, ms: performance.now() - t0 });
        }],
      },
    };
    this.u = new uPlot(opts, this.data(), this.plot);
    this.u.over.addEventListener("dblclick", () => { this.userZoom = false; });
  }

  resetZoom() {
    this.userZoom = false;
    if (this.u) this.u.setData(this.data(), true);
  }

  onKey(e) {
    if (!this.u || e.target !== this.fig) return;
    const { min, max } = this.u.scales.x;
    const span = max - min;
    let lo = min, hi = max;
    if (e.key === "+" || e.key === "=") { lo = min + span / 4; hi = max - span / 4; }
    else if (e.key === "-" || e.key === "_") { lo = min - span / 2; hi = max + span / 2; }
    else if (e.key === "ArrowLeft") { lo = min - span / 5; hi = max - span / 5; }
    else if (e.key === "ArrowRight") { lo = min + span / 5; hi = max + span / 5; }
    else if (e.key === "0") { this.resetZoom(); e.preventDefault(); return; }
    else return;
    e.preventDefault();
    this.userZoom = true;
    this.u.setScale("x", { min: lo, max: hi });
  }

  destroy() {
    clearTimeout(this.timer);
    this.ro.disconnect();
    this.mq.removeEventListener("change", this.onScheme);
    if (this.u) this.u.destroy();
  }
}

/** The unit beside a chart's title, where neither its values nor its title name it (nats/token;
 * not "tokens/s" beside "Tokens / s"); null where they do. */
export function unitHint(unit, title) {
  const squash = (t) => t.toLowerCase().replace(/\s+/g, "");
  if (!unit.text || unit.written || squash(title).includes(squash(unit.text))) return null;
  return h("span.hint.unit", {}, unit.text);
}
