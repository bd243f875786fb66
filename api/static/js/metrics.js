// The metric catalog (GET /v1/metrics/catalog, defined once in workers/metrics.py): which entry a
// metric name belongs to, how the job page shows it (a line chart, a grid, a figure) and how its
// values are written. The job page, the jobs list and the evaluation grids draw from it, so the
// dashboard's code names no metric (but the two the ring view draws, and the stage index, which a
// job's stages show instead of a chart).
import { api } from "./api.js";
import { unitOf } from "./units.js";

let pending = null;

/** The catalog, fetched once per page load; a failed fetch is tried again by the next caller. */
export function loadCatalog() {
  pending ||= api("/v1/metrics/catalog").then(
    (body) => new Catalog(body),
    (e) => { pending = null; throw e; });
  return pending;
}

const NUMBER = /(\d+(?:\.\d+)?)/;

/**
 * Text with numbers in it, ordered by the numbers' values: "len=256" before "len=1024", the
 * bucket "128-256" before "1024-2048", "rank 2" before "rank 10", "0.5" before "0.75"; where a
 * number stands against text, the number first.
 */
export function naturalCompare(a, b) {
  const x = String(a).split(NUMBER), y = String(b).split(NUMBER); // odd indices: numbers
  for (let i = 0; i < Math.min(x.length, y.length); i++) {
    if (x[i] === y[i]) continue;
    if (i % 2) return Number(x[i]) - Number(y[i]) || (x[i] < y[i] ? -1 : 1);
    if (x[i] === "" || y[i] === "") return x[i] === "" ? -1 : 1;  // a number against text
    return x[i].localeCompare(y[i], "en");
  }
  return x.length - y.length;
}

/** A family's field value as a label: a whole number grouped ("16,384"), other text as written
 * (a depth "0.10", a bucket "0-64", a task "niah_single"). */
export function fieldText(v) {
  const text = String(v);
  return /^\d+$/.test(text) ? Number(text).toLocaleString("en-US") : text;
}

/** The value formatter of a catalog entry, by its unit (units.js; the CLI writes the same). */
export function formatter(metric) {
  return unitOf(metric).value;
}

const FIELD = /^([A-Za-z_][A-Za-z0-9_]*)=([^/]+)$/;

/**
 * A name the catalog lacks, read as a member of a family where it has `field=value` parts
 * (`probe/len=4096`, `probe/vt/len=8192`): {pattern: "probe/len={len}", label: "len=4096"}, so
 * the members share one chart, a series each, ordered by their values. Null: no such part.
 */
export function familyOf(name) {
  const labels = [];
  const parts = name.split("/").map((part) => {
    const hit = FIELD.exec(part);
    if (!hit) return part;
    labels.push(part);
    return `${hit[1]}={${hit[1]}}`;
  });
  return labels.length ? { pattern: parts.join("/"), label: labels.join(" ") } : null;
}

export class Catalog {
  /** @param {{groups: {id: string, title: string}[], metrics: object[]}} body the route's answer */
  constructor(body = { groups: [], metrics: [] }) {
    this.groups = body.groups;
    // unitFormat: the entry's values, axis ticks and axis range (units.js); fmt: its values
    this.metrics = body.metrics.map((m, order) => {
      const unitFormat = unitOf(m);
      return { ...m, order, test: new RegExp(m.regex), unitFormat, fmt: unitFormat.value };
    });
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
