// Small DOM and formatting helpers.

/**
 * h("tag.class#id", {attrs}, ...children): create an element. Strings become text nodes (never HTML).
 * `style` takes an object of CSS properties, set through the CSSOM: the page's Content-Security-Policy refuses
 * style="" attributes, so a string there is a programming error.
 */
export function h(spec, attrs = {}, ...children) {
  const [tag, ...rest] = spec.split(/(?=[.#])/);
  const el = document.createElement(tag || "div");
  for (const r of rest) {
    if (r[0] === ".") el.classList.add(r.slice(1));
    else if (r[0] === "#") el.id = r.slice(1);
  }
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k === "style") setStyle(el, v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  append(el, children);
  return el;
}

/** Set CSS properties (`{"background-color": "red", "--x": "1px"}`) through the CSSOM, which CSP allows. */
export function setStyle(el, props) {
  if (typeof props !== "object") throw new TypeError("style must be an object of CSS properties (CSP: no style attributes)");
  for (const [prop, value] of Object.entries(props)) el.style.setProperty(prop, String(value));
  return el;
}

export function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

export const SVG_NS = "http://www.w3.org/2000/svg";
export function s(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined) continue;
    if (k === "style") setStyle(el, v); else el.setAttribute(k, String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

export const TERMINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);
export const STATES = ["QUEUED", "PLACING", "RUNNING", "RETRYING", "SUCCEEDED", "FAILED", "CANCELLED"];

export function stateBadge(state) {
  return h(`span.state.state-${state}`, {}, state);
}

export function progress(step, total) {
  const pct = total > 0 ? Math.min(100, (100 * step) / total) : 0;
  const bar = h("span.bar", { role: "progressbar", "aria-valuemin": 0, "aria-valuemax": total || 0,
    "aria-valuenow": step, "aria-label": `step ${step} of ${total}` }, h("span", { style: { width: `${pct.toFixed(1)}%` } }));
  return h("div.progress", {}, bar, h("span.txt", {}, `${step} / ${total}`));
}

/** The text of a value that is not a finite number (a dash where there is none), else null. */
function notFinite(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "—";
  if (!Number.isFinite(v)) return v > 0 ? "∞" : "−∞";
  return null;
}

export function fmtNum(v, digits = 4) {
  const odd = notFinite(v);
  if (odd) return odd;
  const a = Math.abs(v);
  if (a === 0) return "0";
  if (a >= 1e6 || a < 1e-3) return v.toExponential(2);
  if (a >= 1000) return v.toLocaleString("en-US", { maximumFractionDigits: 0 });
  return Number(v.toPrecision(digits)).toString();
}

const SI_PREFIXES = [[1e18, "E"], [1e15, "P"], [1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];
const BINARY_PREFIXES = [[2 ** 60, "EiB"], [2 ** 50, "PiB"], [2 ** 40, "TiB"], [2 ** 30, "GiB"],
  [2 ** 20, "MiB"], [2 ** 10, "KiB"]];

export function fmtSI(v) {
  const odd = notFinite(v);
  if (odd) return odd;
  const a = Math.abs(v);
  if (a >= 1e21) return v.toExponential(2);
  for (const [d, u] of SI_PREFIXES) if (a >= d) return `${+(v / d).toFixed(2)}${u}`;
  return fmtNum(v, 3);
}

export function fmtBytes(v) {
  const odd = notFinite(v);
  if (odd) return odd;
  const a = Math.abs(v);
  if (a >= 2 ** 70) return `${v.toExponential(2)} B`;
  for (const [d, u] of BINARY_PREFIXES) {
    if (a >= d) return `${+(v / d).toFixed(a >= 10 * d ? 1 : 2)} ${u}`;
  }
  return `${+v.toFixed(0)} B`;
}

export function fmtSeconds(v) {
  const odd = notFinite(v);
  if (odd) return odd;
  if (Math.abs(v) < 1) return `${+(v * 1000).toPrecision(3)} ms`;
  return `${+v.toPrecision(3)} s`;
}

export function age(iso, now = Date.now()) {
  const t = typeof iso === "number" ? iso * 1000 : Date.parse(iso);
  const s = Math.max(0, Math.round((now - t) / 1000));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

export function clock(unixSeconds) {
  const d = new Date(unixSeconds * 1000);
  return d.toLocaleTimeString([], { hour12: false });
}

export function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

/** Colours for series and nodes, readable on light and dark backgrounds. */
export const PALETTE = ["#3b82f6", "#f97316", "#10b981", "#e11d48", "#8b5cf6", "#eab308", "#06b6d4", "#ec4899",
  "#84cc16", "#64748b"];
