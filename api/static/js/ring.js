// The ring as SVG: one circle per data-parallel replica, ranks in ring order, coloured by node, node arcs
// around the outside, and the ring edges that cross a node boundary drawn red and dashed.
// A pipeline job (parallel.pipeline_size P > 1): the rings grouped into one box per pipeline rank (its
// stages and the layers they hold), and between consecutive boxes the stage-to-stage hops (each rank
// to the rank at the same place in the next stage: rank + world/P), drawn as arrows, not ring edges.
import { fmtBytes, fmtSeconds, h, PALETTE, s } from "./util.js";

/**
 * What each pipeline rank holds, for the picture; null without a pipeline (pipeline_size 1).
 * Stage s runs on pipeline rank s mod P (the interleaved schedules give each rank 2 stages); its
 * layers come from the resolved `pipeline_split`, else the even split of `nLayers` (null when
 * neither is known).
 * @param {{pipeline_size?: number, pipeline_schedule?: string, pipeline_split?: number[]|string}} parallel
 * @param {number} [nLayers] the model's n_layers
 * @returns {{size: number, virtual: number, ranks: {pp: number, stages: number[], layers: number[][]|null,
 *   count: number|null}[]}|null}
 */
export function pipelineOf(parallel, nLayers) {
  const P = parallel?.pipeline_size ?? 1;
  if (!(P > 1)) return null;
  const V = (parallel.pipeline_schedule ?? "1f1b") === "1f1b" ? 1 : 2;
  const n = P * V;
  let split = Array.isArray(parallel.pipeline_split) && parallel.pipeline_split.length === n
    ? parallel.pipeline_split : null;
  if (!split && Number.isInteger(nLayers) && nLayers % n === 0) split = Array(n).fill(nLayers / n);
  const starts = [];
  for (let i = 0, at = 0; split && i < n; at += split[i], i++) starts.push(at);
  const ranks = [];
  for (let pp = 0; pp < P; pp++) {
    const stages = Array.from({ length: V }, (_, v) => pp + v * P);
    const layers = split ? stages.map((st) => [starts[st], starts[st] + split[st]]) : null;
    ranks.push({ pp, stages, layers, count: layers ? layers.reduce((a, [x, y]) => a + y - x, 0) : null });
  }
  return { size: P, virtual: V, ranks };
}

/**
 * @param {{rank:number, node_id:string, device:string, ring?:number, node_ip?:string}[]} placement
 * @param {Map<number, {mem?: number, stepTime?: number}>} perRank latest per-rank numbers
 * @param {{caption?: string, pipeline?: ReturnType<typeof pipelineOf>}} [opts] `pipeline`: the job's
 *   stages (`pipelineOf`), null for today's picture
 * @returns {HTMLElement}
 */
export function renderRing(placement, perRank = new Map(), { caption = "", pipeline = null } = {}) {
  const wrap = h("div.ring");
  if (!placement || !placement.length) {
    wrap.append(h("p.muted", {}, "No placement yet: ranks appear here once the job is placed."));
    return wrap;
  }
  const nodes = [...new Set(placement.map((p) => p.node_id))];
  const color = (node) => PALETTE[nodes.indexOf(node) % PALETTE.length];
  // a pipeline's stages split the world into P equal contiguous blocks (pp is the outermost dimension)
  const P = pipeline && placement.length % pipeline.size === 0 ? pipeline.size : 1;
  const stageSize = placement.length / P;
  const ppOf = (rank) => Math.floor(rank / stageSize);
  const rings = new Map(); // a ring never spans two stages, whatever the placement's ring numbers say
  for (const p of [...placement].sort((a, b) => a.rank - b.rank)) {
    const r = p.ring ?? 0;
    const key = P > 1 ? `${ppOf(p.rank)}/${r}` : r;
    if (!rings.has(key)) rings.set(key, { idx: r, pp: ppOf(p.rank), ranks: [] });
    rings.get(key).ranks.push(p);
  }
  let crossingsTotal = 0;
  const ringSvgs = [];
  for (const { idx, pp, ranks } of rings.values()) {
    const { svg, crossings } = ringSvg(ranks, idx, rings.size, color, perRank);
    crossingsTotal += crossings;
    ringSvgs.push({ pp, svg });
  }
  let hops = null;
  if (P > 1) {
    hops = pipelineBoxes(placement, ringSvgs, pipeline, stageSize, color);
    wrap.append(hops.box);
  } else {
    wrap.append(h("div.ring-wrap", {}, ringSvgs.map((r) => r.svg)));
  }
  wrap.append(h("div.legend-row", {},
    nodes.map((n) => h("span", {}, h("span.swatch", { style: { background: color(n) } }), shortNode(n),
      ` (${placement.filter((p) => p.node_id === n).length} ranks)`)),
    h("span", {}, h("span.swatch.danger"),
      `${crossingsTotal} node crossing${crossingsTotal === 1 ? "" : "s"}`),
    hops ? h("span", {}, h("span.swatch.pp"), `${hops.count} stage hop${hops.count === 1 ? "" : "s"}` +
      ` (${hops.crossings} across nodes)`) : null));
  // the same information as a table, for screen readers and keyboard users
  const rows = [...placement].sort((a, b) => a.rank - b.rank).map((p) => {
    const m = perRank.get(p.rank) || {};
    return h("tr", { dataset: { rank: p.rank } }, h("td.num", {}, p.rank),
      P > 1 ? h("td.num", {}, ppOf(p.rank)) : null, h("td", {}, p.ring ?? 0),
      h("td.mono", {}, shortNode(p.node_id)), h("td.mono", {}, p.device),
      h("td.num", {}, fmtSeconds(m.stepTime)), h("td.num", {}, fmtBytes(m.mem)));
  });
  const cols = ["Rank", ...(P > 1 ? ["Stage"] : []), "Ring", "Node", "Device", "Step time", "Peak memory"];
  const numeric = new Set(["Rank", "Stage", "Step time", "Peak memory"]);
  wrap.append(h("details.ranks", {}, h("summary", {}, `Ranks table (${placement.length})`),
    h("table.rank-table", {}, caption ? h("caption.sr-only", {}, caption) : null,
      h("thead", {}, h("tr", {}, cols.map((c) => h(numeric.has(c) ? "th.num" : "th", { scope: "col" }, c)))),
      h("tbody", {}, rows))));
  return wrap;
}

/** "0–3" of a half-open layer range [a, b); "4" of a one-layer one. */
const span = ([a, b]) => (b - a === 1 ? `${a}` : `${a}–${b - 1}`);

/**
 * One box per pipeline rank (its stages, layers and rings) and, between consecutive boxes, the
 * stage-to-stage hops; with two stages per rank a last strip for the hop from the last rank back to
 * the first (its second stage). Returns the box, the hops drawn and how many cross nodes.
 */
function pipelineBoxes(placement, ringSvgs, pipeline, stageSize, color) {
  const P = pipeline.size;
  const byRank = new Map(placement.map((p) => [p.rank, p]));
  const box = h("div.pipeline", { dataset: { pipelineSize: P, stageSize } });
  let count = 0, crossings = 0;
  const strip = (from, to, wrapAround) => {
    const next = wrapAround ? pipeline.ranks[to].stages[1] : pipeline.ranks[to].stages[0];
    const label = `${wrapAround ? "↺ back to" : "↓ to"} stage ${next} (activations; gradients back)`;
    const { svg, n, cross } = hopSvg(from, to, stageSize, byRank, color, wrapAround, label);
    count += n;
    crossings += cross;
    return svg;
  };
  for (let pp = 0; pp < P; pp++) {
    const info = pipeline.ranks[pp];
    const first = pp * stageSize, last = first + stageSize - 1;
    const stages = info.stages.length > 1 ? `stages ${info.stages.join(" & ")}` : `stage ${pp}`;
    const layers = info.layers
      ? `layers ${info.layers.map(span).join(", ")} (${info.count} layer${info.count === 1 ? "" : "s"})`
      : "layers unknown";
    const nodes = new Set(placement.filter((p) => p.rank >= first && p.rank <= last).map((p) => p.node_id));
    box.append(h("section.pp-stage", {
      dataset: {
        ppRank: pp, stages: info.stages.join(","), layers: info.count ?? "",
        layerRanges: info.layers ? info.layers.map(span).join(",") : "",
        ranks: ringSvgs.filter((r) => r.pp === pp)
          .flatMap((r) => [...r.svg.querySelectorAll(".rank")].map((g) => Number(g.dataset.rank)))
          .sort((a, b) => a - b).join(","),
      },
      "aria-label": `pipeline rank ${pp}: ${stages}, ${layers}`,
    },
    h("div.pp-head", {}, h("strong", {}, stages[0].toUpperCase() + stages.slice(1)), ` · ${layers} · ` +
      `ranks ${first === last ? first : `${first}–${last}`} on ${nodes.size} node${nodes.size === 1 ? "" : "s"}`),
    h("div.ring-wrap", {}, ringSvgs.filter((r) => r.pp === pp).map((r) => r.svg))));
    if (pp + 1 < P) box.append(strip(pp, pp + 1, false));
  }
  if (pipeline.virtual > 1) box.append(strip(P - 1, 0, true));
  return { box, count, crossings };
}

/** The hops from pipeline rank `from` to `to`: rank from·S + k sends to to·S + k (k < S). */
function hopSvg(from, to, S, byRank, color, wrapAround, label) {
  const labels = S <= 16;
  const gap = 44;
  const WE = Math.max(120, S * gap); // the arrows' width; the label goes to their right
  const W = WE + 300;
  const H = labels ? 60 : 44;
  const y0 = labels ? 20 : 8, y1 = H - 6;
  let cross = 0;
  const edges = [];
  for (let k = 0; k < S; k++) {
    const a = byRank.get(from * S + k), b = byRank.get(to * S + k);
    if (!a || !b) continue;
    const x = (k + 0.5) * (WE / S);
    const crosses = a.node_id !== b.node_id;
    if (crosses) cross += 1;
    edges.push(s("g", { class: crosses ? "pp-edge cross" : "pp-edge", "data-from": a.rank, "data-to": b.rank,
      "data-cross": crosses ? "1" : "0" },
    s("title", {}, `stage hop: rank ${a.rank} → rank ${b.rank}` +
      (crosses ? ` crosses ${shortNode(a.node_id)} → ${shortNode(b.node_id)}` : " (same node)")),
    s("line", { x1: x, y1: y0, x2: x, y2: y1 - 7 }),
    s("polygon", { points: `${x - 5},${y1 - 8} ${x + 5},${y1 - 8} ${x},${y1}` }),
    labels ? s("text", { x, y: y0 - 6, "text-anchor": "middle", class: "sub" }, `${a.rank}→${b.rank}`) : null,
    s("circle", { cx: x, cy: y0, r: 3, fill: color(a.node_id) })));
  }
  const what = wrapAround ? `pipeline rank ${from} back to pipeline rank ${to} (its next stage)`
    : `pipeline rank ${from} to pipeline rank ${to}`;
  const svg = s("svg", {
    class: `pp-hops${wrapAround ? " wrap" : ""}`, viewBox: `0 0 ${W} ${H}`, width: Math.min(W, 640), role: "img",
    "data-from-stage": from, "data-to-stage": to, "data-hops": edges.length, "data-crossings": cross,
    "aria-label": `stage hops from ${what}: ${edges.length} hop(s), ${cross} across nodes`,
  }, edges, s("text", { x: WE + 8, y: (y0 + y1) / 2 + 4, class: "pp-label" }, label));
  return { svg, n: edges.length, cross };
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
