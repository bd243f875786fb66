// The metric catalog (GET /v1/metrics/catalog, defined once in workers/metrics.py): which entry a
// metric name belongs to, how the job page shows it (a line chart, a grid, a figure) and how its
// values are written. The job page, the jobs list and the evaluation grids draw from it, so the
// dashboard's code names no metric (but the two the ring view draws).
import { api } from "./api.js";
import { fmtBytes, fmtNum, fmtSeconds, fmtSI } from "./util.js";

let pending = null;

/** The catalog, fetched once per page load; a failed fetch is tried again by the next caller. */
export function loadCatalog() {
  pending ||= api("/v1/metrics/catalog").then(
    (body) => new Catalog(body),
    (e) => { pending = null; throw e; });
  return pending;
}

/** Numbers by value, before other text: "len=256" before "len=1024". */
export function naturalCompare(a, b) {
  return String(a).localeCompare(String(b), "en", { numeric: true });
}

const DASH = "—";

/** The value formatter of a catalog entry (the CLI's `format_value` writes the same). */
export function formatter(metric) {
  const d = metric.digits;
  const guard = (fn) => (v) => (v === null || v === undefined || Number.isNaN(v) ? DASH : fn(v));
  switch (metric.format) {
    case "fixed": return guard((v) => v.toFixed(d));
    case "exp": return guard((v) => (v === 0 ? "0" : v.toExponential(d)));
    case "percent": return guard((v) => `${+(v * 100).toFixed(1)}%`);
    case "seconds": return guard(fmtSeconds);
    case "si": return guard(fmtSI);
    case "bytes": return guard(fmtBytes);
    default: return (v) => fmtNum(v, d);
  }
}

export class Catalog {
  /** @param {{groups: {id: string, title: string}[], metrics: object[]}} body the route's answer */
  constructor(body = { groups: [], metrics: [] }) {
    this.groups = body.groups;
    this.metrics = body.metrics.map((m, order) =>
      ({ ...m, order, test: new RegExp(m.regex), fmt: formatter(m) }));
    // a name's entry is its exact one, else the first family that matches
    const exact = this.metrics.filter((m) => !m.fields.length);
    this.ordered = [...exact, ...this.metrics.filter((m) => m.fields.length)];
    this.cache = new Map();
  }

  /** {metric, fields: {field: value}, label} for a metric name; null where the catalog lacks it. */
  lookup(name) {
    if (this.cache.has(name)) return this.cache.get(name);
    let found = null;
    for (const metric of this.ordered) {
      const hit = metric.test.exec(name);
      if (!hit) continue;
      const fields = Object.fromEntries(metric.fields.map((f, i) => [f, hit[i + 1]]));
      found = { metric, fields, label: metric.fields.map((f) => `${f}=${fields[f]}`).join(" ") };
      break;
    }
    this.cache.set(name, found);
    return found;
  }

  /** The entries with `flag` (column, progress) set, in catalog order. */
  marked(flag) { return this.metrics.filter((m) => m[flag]); }

  /** The entries shown as `view` (line, grid, stat), in catalog order. */
  shownAs(view) { return this.metrics.filter((m) => m.view === view); }
}
