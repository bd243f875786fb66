// The ring as SVG: one circle per data-parallel replica, ranks in ring order, coloured by node, node arcs
// around the outside, and the ring edges that cross a node boundary drawn red and dashed.
import { fmtBytes, fmtSeconds, h, PALETTE, s } from "./util.js";

/**
 * @param {{rank:number, node_id:string, device:string, ring?:number, node_ip?:string}[]} placement
 * @param {Map<number, {mem?: number, stepTime?: number}>} perRank latest per-rank numbers
 * @returns {HTMLElement}
 */
export function renderRing(placement, perRank = new Map(), { caption = "" } = {}) {
  const wrap = h("div.ring");
  if (!placement || !placement.length) {
    wrap.append(h("p.muted", {}, "No placement yet: ranks appear here once the job is placed."));
    return wrap;
  }
  const nodes = [...new Set(placement.map((p) => p.node_id))];
  const color = (node) => PALETTE[nodes.indexOf(node) % PALETTE.length];
  const rings = new Map();
  for (const p of [...placement].sort((a, b) => a.rank - b.rank)) {
    const r = p.ring ?? 0;
    if (!rings.has(r)) rings.set(r, []);
    rings.get(r).push(p);
  }
  const svgs = h("div.ring-wrap");
  let crossingsTotal = 0;
  for (const [ringIdx, ranks] of rings) {
    const { svg, crossings } = ringSvg(ranks, ringIdx, rings.size, color, perRank);
    crossingsTotal += crossings;
    svgs.append(svg);
  }
  wrap.append(svgs);
  wrap.append(h("div.legend-row", {},
    nodes.map((n) => h("span", {}, h("span.swatch", { style: { background: color(n) } }), shortNode(n),
      ` (${placement.filter((p) => p.node_id === n).length} ranks)`)),
    h("span", {}, h("span.swatch.danger"),
      `${crossingsTotal} node crossing${crossingsTotal === 1 ? "" : "s"}`)));
  // the same information as a table, for screen readers and keyboard users
  const rows = [...placement].sort((a, b) => a.rank - b.rank).map((p) => {
    const m = perRank.get(p.rank) || {};
    return h("tr", { dataset: { rank: p.rank } }, h("td.num", {}, p.rank), h("td", {}, p.ring ?? 0),
      h("td.mono", {}, shortNode(p.node_id)), h("td.mono", {}, p.device),
      h("td.num", {}, fmtSeconds(m.stepTime)), h("td.num", {}, fmtBytes(m.mem)));
  });
  wrap.append(h("details.ranks", {}, h("summary", {}, `Ranks table (${placement.length})`),
    h("table.rank-table", {}, caption ? h("caption.sr-only", {}, caption) : null,
      h("thead", {}, h("tr", {}, ["Rank", "Ring", "Node", "Device", "Step time", "Peak memory"]
        .map((t, i) => h(i === 0 || i > 3 ? "th.num" : "th", { scope: "col" }, t)))),
      h("tbody", {}, rows))));
  return wrap;
}

export function shortNode(id) {
  return id && id.length > 14 ? `${id.slice(0, 6)}…${id.slice(-4)}` : id;
}

function ringSvg(ranks, ringIdx, nRings, color, perRank) {
  const n = ranks.length;
  const labels = n <= 16;
  const R = Math.max(70, n * 16);
  const pad = labels ? 110 : 50;
  const size = 2 * (R + pad);
  const side = labels ? 70 : 0; // room for the labels left and right of the ring
  const c = size / 2;
  const cx = c + side;
  const pos = (i, rad = R) => {
    const a = -Math.PI / 2 + (2 * Math.PI * i) / n;
    return [cx + rad * Math.cos(a), c + rad * Math.sin(a), a];
  };
  let crossings = 0;
  const edges = [];
  for (let i = 0; n > 1 && i < n; i++) {
    const j = (i + 1) % n;
    if (n === 2 && i === 1) break; // a ring of 2 has one link
    const a = ranks[i], b = ranks[j];
    const cross = a.node_id !== b.node_id;
    if (cross) crossings += 1;
    const [x1, y1] = pos(i), [x2, y2] = pos(j);
    edges.push(s("path", {
      class: cross ? "edge cross" : "edge",
      d: n === 2 ? `M${x1},${y1} L${x2},${y2}` : `M${x1},${y1} A${R},${R} 0 0 1 ${x2},${y2}`,
      "data-cross": cross ? "1" : "0",
    }, s("title", {}, `rank ${a.rank} → rank ${b.rank}${cross ? ` crosses ${shortNode(a.node_id)} → ${shortNode(b.node_id)}` : " (same node)"}`)));
  }
  // node arcs: contiguous runs of the same node in ring order
  const arcs = [];
  let start = 0;
  for (let i = 1; i <= n; i++) {
    if (i === n || ranks[i].node_id !== ranks[start].node_id) {
      const node = ranks[start].node_id;
      const ro = R + 30;
      const half = Math.PI / n;
      const a0 = -Math.PI / 2 + (2 * Math.PI * start) / n - half * 0.8;
      const a1 = -Math.PI / 2 + (2 * Math.PI * (i - 1)) / n + half * 0.8;
      const p0 = [cx + ro * Math.cos(a0), c + ro * Math.sin(a0)], p1 = [cx + ro * Math.cos(a1), c + ro * Math.sin(a1)];
      const large = a1 - a0 > Math.PI ? 1 : 0;
      const full = i - start === n;
      arcs.push(full
        ? s("circle", { cx, cy: c, r: ro, fill: "none", stroke: color(node), "stroke-width": 6, opacity: 0.55 })
        : s("path", { d: `M${p0[0]},${p0[1]} A${ro},${ro} 0 ${large} 1 ${p1[0]},${p1[1]}`, fill: "none",
          stroke: color(node), "stroke-width": 6, "stroke-linecap": "round", opacity: 0.55 }));
      start = i;
    }
  }
  const dots = ranks.map((p, i) => {
    const [x, y, a] = pos(i);
    const m = perRank.get(p.rank) || {};
    const g = s("g", { class: "rank", "data-rank": p.rank, "data-node": p.node_id },
      s("title", {}, `rank ${p.rank} on ${p.node_id} (${p.device})` +
        `${m.stepTime !== undefined ? `, step ${fmtSeconds(m.stepTime)}` : ""}${m.mem !== undefined ? `, peak ${fmtBytes(m.mem)}` : ""}`),
      s("circle", { cx: x, cy: y, r: 15, fill: color(p.node_id), stroke: "var(--panel)", "stroke-width": 2 }),
      s("text", { x, y: y + 4, "text-anchor": "middle", class: "rank-num" }, p.rank));
    if (labels) {
      const lr = R + 58;
      const lx = cx + lr * Math.cos(a), ly = c + lr * Math.sin(a);
      const anchor = Math.abs(Math.cos(a)) < 0.3 ? "middle" : Math.cos(a) > 0 ? "start" : "end";
      g.append(s("text", { x: lx, y: ly - 6, "text-anchor": anchor, class: "device" }, p.device),
        s("text", { x: lx, y: ly + 8, "text-anchor": anchor, class: "sub" },
          `${fmtSeconds(m.stepTime)} · ${fmtBytes(m.mem)}`));
    }
    return g;
  });
  const title = nRings > 1 ? `ring ${ringIdx}` : `ring of ${n}`;
  const svg = s("svg", {
    class: "ring-svg", viewBox: `0 0 ${size + 2 * side} ${size}`, width: Math.min(size + 2 * side, 640), role: "img",
    "data-ring": ringIdx, "data-crossings": crossings,
    "aria-label": `${title}: ${n} ranks on ${new Set(ranks.map((r) => r.node_id)).size} node(s), ${crossings} node crossing(s)`,
  }, arcs, edges, dots,
  s("text", { x: cx, y: c - 4, "text-anchor": "middle", class: "node-label" }, title),
  s("text", { x: cx, y: c + 12, "text-anchor": "middle", class: "sub" }, `${crossings} crossing${crossings === 1 ? "" : "s"}`));
  return { svg, crossings };
}
