// A catalog family drawn as a profile (the entry's `profile` field, e.g. held-out loss by position
// bucket): x = the field's values in numeric order, y = the latest evaluation's value of each
// member, with the first evaluation's as a second series, so what changed along x is visible.
// uPlot (vendored) as in charts.js; x is the member's index, labelled with the field's value.
import uPlot from "../vendor/uplot/uPlot.esm.js";
import { noteDrawn, unitAxes, unitHint } from "./charts.js";
import { fieldText, naturalCompare } from "./metrics.js";
import { cssVar, h, PALETTE } from "./util.js";

const HEIGHT = 220;

export class ProfileChart {
  /** @param {HTMLElement} parent where the <figure> goes; @param metric the catalog entry */
  constructor(parent, metric) {
    this.metric = metric;
    this.field = metric.profile;
    this.members = new Map(); // field value -> Map step -> value
    this.u = null;
    this.plot = h("div.plot");
    this.fig = h("figure.chart.profile", {
      id: `profile-${metric.key}`, tabindex: 0, dataset: { metric: `${metric.key}-profile` },
      "aria-label": `${metric.title} against ${this.field}, latest and first evaluation`,
    }, h("figcaption", {}, `${metric.title}: against ${this.field}`,
      unitHint(metric.unitFormat, metric.title), h("span.hint.count", {}, "")),
    this.plot);
    this.count = this.fig.querySelector(".count");
    parent.append(this.fig);
    this.ro = new ResizeObserver(() => {
      if (this.u) this.u.setSize({ width: this.width(), height: HEIGHT });
    });
    this.ro.observe(this.plot);
    this.mq = matchMedia("(prefers-color-scheme: dark)");
    this.onScheme = () => this.draw();
    this.mq.addEventListener("change", this.onScheme);
  }

  width() { return Math.max(200, this.plot.clientWidth || this.fig.clientWidth - 16); }

  /** One point of a member (`fields` as the catalog's lookup reads them); draw() shows it. */
  push(fields, step, value) {
    const x = fields[this.field];
    if (!this.members.has(x)) this.members.set(x, new Map());
    this.members.get(x).set(step, value);
  }

  /** A retry resumed from `step`: evaluations after it are superseded. */
  truncateAfter(step) {
    for (const at of this.members.values()) {
      for (const s of [...at.keys()]) if (s > step) at.delete(s);
    }
  }

  /** {xs: field values in order, evals: [{step, values}] latest first, then the first}. */
  profile() {
    const xs = [...this.members.keys()].filter((x) => this.members.get(x).size);
    xs.sort(naturalCompare);
    const steps = xs.flatMap((x) => [...this.members.get(x).keys()]);
    if (!steps.length) return { xs: [], evals: [] };
    const last = Math.max(...steps), first = Math.min(...steps);
    const at = (s) => ({ step: s, values: xs.map((x) => this.members.get(x).get(s) ?? null) });
    return { xs, evals: first === last ? [at(last)] : [at(last), at(first)] };
  }

  draw() {
    const { xs, evals } = this.profile();
    const d = this.fig.dataset;
    d.x = JSON.stringify(xs);
    d.points = JSON.stringify(evals[0]?.values ?? []);
    d.step = evals[0] ? String(evals[0].step) : "";
    d.first = JSON.stringify(evals[1]?.values ?? []);
    d.firstStep = evals[1] ? String(evals[1].step) : "";
    this.count.textContent = evals.length ? `step ${evals.map((e) => e.step).join(" vs ")}` : "";
    if (this.u) { this.u.destroy(); this.u = null; }
    if (!xs.length) return;
    const unit = this.metric.unitFormat;
    const axis = { stroke: cssVar("--muted"), grid: { stroke: cssVar("--grid"), width: 1 },
      ticks: { stroke: cssVar("--grid"), width: 1 } };
    const idx = xs.map((_, i) => i);
    // long labels (0-64 ... 16384-32768) slant rather than run into each other
    const labels = xs.map(fieldText);
    const slant = 7 * Math.max(...labels.map((x) => x.length)) * xs.length > this.width() - 80;
    const series = [{ label: this.field, value: (u, i) => (i === null ? "—" : labels[i]) },
      ...evals.map((e, i) => ({
        label: `${i ? "first" : "latest"} (step ${e.step})`,
        stroke: i ? PALETTE[1] : cssVar("--accent"),
        dash: i ? [4, 4] : undefined, width: 1.5, spanGaps: true,
        points: { show: true, size: 5 },
        value: (u, v) => unit.value(v),
      }))];
    const { scales, axes: [, yAxis] } = unitAxes(unit, axis);
    this.u = new uPlot({
      width: this.width(), height: HEIGHT, series,
      scales: { x: { time: false, range: () => [-0.5, xs.length - 0.5] }, y: scales.y },
      axes: [{ ...axis, splits: () => idx,
        values: (u, splits) => splits.map((i) => labels[i] ?? ""),
        rotate: slant ? 30 : 0, size: slant ? 64 : 50 }, yAxis],
      cursor: { drag: { x: false, y: false } },
      legend: { live: true },
      hooks: { draw: [(u) => noteDrawn(u, this.fig)] },
    }, [idx, ...evals.map((e) => e.values)], this.plot);
  }

  destroy() {
    this.ro.disconnect();
    this.mq.removeEventListener("change", this.onScheme);
    if (this.u) this.u.destroy();
  }
}
