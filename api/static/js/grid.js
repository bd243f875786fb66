// A catalog family shown as a grid (e.g. passkey retrieval, needle in a haystack, RULER's tasks):
// rows and columns are the two fields the catalog names (context length x needle depth, task x
// length), each in its numbers' order; a cell is the latest value of that member.
import { fieldText, naturalCompare } from "./metrics.js";
import { h } from "./util.js";

/** @param metric the catalog entry; @param cells Map name -> {fields, value} */
export function renderGrid(metric, cells) {
  const { rows: rowField, columns: colField } = metric.grid;
  const rows = new Set(), cols = new Set(), at = new Map();
  for (const { fields, value } of cells.values()) {
    const r = fields[rowField], c = fields[colField];
    rows.add(r);
    cols.add(c);
    at.set(`${r}|${c}`, value);
  }
  const R = [...rows].sort(naturalCompare);
  const C = [...cols].sort(naturalCompare);
  const heat = metric.unit === "fraction";
  const table = h("table.heat", { id: `${metric.key}-grid`, dataset: { metric: metric.name },
    "aria-label": metric.title },
    h("thead", {}, h("tr", {}, h("th", { scope: "col" }, `${rowField} \\ ${colField}`),
      C.map((c) => h("th", { scope: "col" }, fieldText(c))))),
    h("tbody", {}, R.map((r) => h("tr", {},
      h("th", { scope: "row" }, fieldText(r)),
      C.map((c) => {
        const v = at.get(`${r}|${c}`);
        if (v === undefined || v === null) return h("td.none", {}, "—");
        const hue = Math.round(120 * Math.max(0, Math.min(1, v)));
        return h("td", { style: heat ? { background: `hsl(${hue} 65% var(--heat-l))` } : null,
          title: `${rowField} ${r}, ${colField} ${c}: ${v}` }, metric.fmt(v));
      })))));
  return h("figure.grid", {}, h("figcaption.muted", {}, metric.title), table);
}
