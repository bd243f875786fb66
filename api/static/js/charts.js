// Live line charts on uPlot (vendored, MIT): x = step, one series per metric (and per rank where
// the metric is per rank, or per member of a catalog family). Initial data comes downsampled from
// the server; live points are appended in place and redrawn at most every DRAW_MS. Drag to zoom,
// double-click or "Reset" to reset; keyboard: + − ← → 0.
import uPlot from "../vendor/uplot/uPlot.esm.js";
import { naturalCompare } from "./metrics.js";
import { cssVar, h, PALETTE } from "./util.js";

const DRAW_MS = 250;
const HEIGHT = 220;
export const timings = (window.__ringtrain ||= { renders: [], snapshots: [] });

function lowerBound(xs, x) {
  let lo = 0, hi = xs.length;
  while (lo < hi) { const m = (lo + hi) >> 1; if (xs[m] < x) lo = m + 1; else hi = m; }
  return lo;
}

/** Axis labels: the chart's own format, with more digits where it would print two ticks the same. */
export function tickLabels(splits, fmt) {
  let labels = splits.map((v) => (v === null ? "" : fmt(v)));
  for (let d = 2; d <= 8 && new Set(labels).size < labels.length; d++) {
    labels = splits.map((v) => {
      if (v === null) return "";
      const a = Math.abs(v);
      return a !== 0 && (a < 1e-3 || a >= 1e6) ? v.toExponential(d) : String(+v.toPrecision(d + 1));
    });
  }
  return labels;
}

export class LiveChart {
  /**
   * @param {HTMLElement} parent where the <figure> goes
   * @param {{id: string, title: string, fmt: (v:number)=>string, perRank?: boolean}} opts
   */
  constructor(parent, opts) {
    this.opts = opts;
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
    }, h("figcaption", {}, opts.title, h("span.hint.count", {}, ""), this.reset), this.plot, this.empty);
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
    const sorted = keyed.map((x) => x.s);
    if (sorted.length === 1) {
      this.xs = sorted[0].step.slice();
      this.ys = new Map([[this.keys[0], sorted[0].value.slice()]]);
    } else if (sorted.length > 1) {
      const joined = uPlot.join(sorted.map((s) => [s.step, s.value]));
      this.xs = Array.from(joined[0]);
      this.ys = new Map(this.keys.map((k, i) => [k, Array.from(joined[i + 1], (v) => (v === undefined ? null : v))]));
    }
    this.keysChanged = true;
    this.draw();
  }

  /** Append (or overwrite) one point; cheap for increasing steps. `label`: a family member. */
  push(step, rank, value, label) {
    const k = this.key(rank, label);
    let ys = this.ys.get(k);
    if (!ys) {
      ys = new Array(this.xs.length).fill(null);
      this.ys.set(k, ys);
      this.keys.push(k);
      this.keys.sort(LiveChart.order);
      this.keysChanged = true;
    }
    const n = this.xs.length;
    if (n === 0 || step > this.xs[n - 1]) {
      this.xs.push(step);
      for (const arr of this.ys.values()) arr.push(null);
      ys[n] = value;
    } else {
      const i = lowerBound(this.xs, step);
      if (this.xs[i] !== step) {
        this.xs.splice(i, 0, step);
        for (const arr of this.ys.values()) arr.splice(i, 0, null);
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
    this.schedule();
  }

  get points() { return this.xs.length; }

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
    this.empty.hidden = n > 0;
    this.plot.hidden = n === 0;
    this.fig.dataset.points = String(n);
    this.count.textContent = n ? `${n.toLocaleString("en-US")} pts` : "";
    if (n === 0) return;
    if (!this.u || this.keysChanged) { this.rebuild(); return; }
    this.drawStart = performance.now();
    this.u.setData(this.data(), !this.userZoom);
  }

  rebuild() {
    if (this.u) { this.u.destroy(); this.u = null; }
    this.keysChanged = false;
    if (!this.xs.length) return;
    const fmt = this.opts.fmt;
    const axis = { stroke: cssVar("--muted"), grid: { stroke: cssVar("--grid"), width: 1 },
      ticks: { stroke: cssVar("--grid"), width: 1 } };
    const multi = this.keys.length > 1 || this.keys[0] !== "";
    const series = [{ label: "step" }, ...this.keys.map((k, i) => ({
      label: k || this.opts.title,
      stroke: multi ? PALETTE[i % PALETTE.length] : cssVar("--accent"),
      width: 1.5, spanGaps: true, points: { show: false },
      value: (u, v) => (v === null || v === undefined ? "—" : fmt(v)),
    }))];
    const t0 = performance.now();
    this.drawStart = t0;
    let measured = false;
    const points = this.xs.length;
    const opts = {
      width: this.width(), height: HEIGHT, series,
      scales: { x: { time: false } },
      axes: [{ ...axis }, { ...axis, values: (u, splits) => tickLabels(splits, fmt),
        size: (u, values) => 18 + 7 * Math.max(3, ...(values || []).map((v) => String(v).length)) }],
      cursor: { drag: { x: true, y: false, setScale: true } },
      legend: { live: true },
      hooks: {
        setSelect: [(u) => { if (u.select.width > 2) this.userZoom = true; }],
        draw: [() => {
          this.lastDrawMs = performance.now() - this.drawStart;
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
