// The passkey needle-in-a-haystack grid: rows = context length, columns = needle depth, cell = accuracy.
import { h } from "./util.js";

export const PASSKEY_RE = /^passkey_acc\/len=(\d+)\/depth=([0-9.]+)$/;

export function renderPasskey(values) {
  const lens = new Set(), depths = new Set(), cell = new Map();
  for (const [name, v] of values) {
    const m = PASSKEY_RE.exec(name);
    if (!m) continue;
    lens.add(Number(m[1]));
    depths.add(m[2]);
    cell.set(`${Number(m[1])}|${m[2]}`, v);
  }
  if (!lens.size) return h("p.muted", {}, "No passkey evaluation yet (it runs at the evaluation interval).");
  const L = [...lens].sort((a, b) => a - b);
  const D = [...depths].sort((a, b) => Number(a) - Number(b));
  return h("table.heat#passkey-grid", {},
    h("caption.muted", {}, "Retrieval accuracy by context length (rows) and needle depth (columns)"),
    h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "len \\ depth"), D.map((d) => h("th", { scope: "col" }, d)))),
    h("tbody", {}, L.map((len) => h("tr", {}, h("th", { scope: "row" }, len.toLocaleString("en-US")),
      D.map((d) => {
        const v = cell.get(`${len}|${d}`);
        if (v === undefined || v === null) return h("td.none", {}, "—");
        const hue = Math.round(120 * Math.max(0, Math.min(1, v)));
        return h("td", { style: { background: `hsl(${hue} 65% var(--heat-l))` }, title: `len ${len}, depth ${d}: ${v}` },
          `${Math.round(v * 100)}%`);
      })))));
}
