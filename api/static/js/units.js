// One number format per unit of the metric catalog (workers/metrics.py: a fraction shown as a
// percentage, bytes, tokens/s, seconds, nats/token, plain numbers): a value's text (legends,
// tables, grids, figures), an axis's tick labels and an axis's range. Every chart and table takes
// its unit from here, so the same value reads the same everywhere; the CLI's api/cli/units.py
// writes values by the same rules.
import { fmtBytes, fmtNum, fmtSeconds, fmtSI } from "./util.js";

const DASH = "—";
const finite = (v) => typeof v === "number" && Number.isFinite(v);

/** A value's text: a dash for a missing or NaN value, ∞ for an infinite one, else `fn(v)`. */
function guarded(fn) {
  return (v) => {
    if (v === null || v === undefined || Number.isNaN(v)) return DASH;
    if (!Number.isFinite(v)) return v > 0 ? "∞" : "−∞";
    return fn(v);
  };
}

/** Numbers at or beyond this size (or below SMALL, not 0) are written in scientific notation. */
const LARGE = 1e6;
const SMALL = 1e-3;

/** The fewest decimals (up to `most`) that write each of `xs` exactly, to float noise. */
function decimalsFor(xs, most = 6) {
  for (let d = 0; d < most; d++) {
    const k = 10 ** d;
    const exact = (x) => Math.abs(x * k - Math.round(x * k)) < 1e-6 * Math.max(1, Math.abs(x * k));
    if (xs.every(exact)) return d;
  }
  return most;
}

/** Tick labels `text(split / div, decimals) + suffix`, with as many decimals as the ticks need
 * (and more where two ticks would read the same). */
function scaled(splits, div, suffix, most = 3) {
  const xs = splits.map((v) => (finite(v) ? v / div : null));
  const shown = xs.filter((x) => x !== null);
  const big = shown.some((x) => Math.abs(x) >= 1e21);  // toFixed writes those as 1e+21 anyway
  for (let d = decimalsFor(shown, most); d <= 10; d++) {
    const labels = xs.map((x) => {
      if (x === null) return "";
      const text = big ? x.toExponential(Math.min(d, 3))
        : x.toLocaleString("en-US", { minimumFractionDigits: d, maximumFractionDigits: d });
      return `${x === 0 || Math.abs(x) < 0.5 * 10 ** -d ? text.replace("-", "") : text}${suffix}`;
    });
    if (new Set(labels.filter(Boolean)).size === shown.length || d === 10) return labels;
  }
  return [];
}

/** Plain numbers: fixed decimals, scientific notation for very large or very small magnitudes. */
function plainTicks(splits) {
  const shown = splits.filter(finite);
  const top = Math.max(0, ...shown.map(Math.abs));
  if (top >= LARGE || (top > 0 && top < SMALL)) {
    for (let d = 0; d <= 8; d++) {
      const labels = splits.map((v) => (!finite(v) ? "" : v === 0 ? "0" : v.toExponential(d)));
      if (new Set(labels.filter(Boolean)).size === shown.length || d === 8) return labels;
    }
  }
  return scaled(splits, 1, "", 6);
}

/** The prefix of `steps` ([[size, suffix], ...] largest first) for numbers up to `top`. */
const prefixOf = (steps, last, top) => steps.find(([d]) => top >= d) || last;
const topOf = (xs) => Math.max(0, ...xs.filter(finite).map(Math.abs));

/** Ticks in one prefix of `steps`: the one of the axis's largest magnitude `top` (default: the
 * largest tick's), so every tick of an axis is written in the same prefix. */
function prefixed(steps, last) {
  return (splits, top = topOf(splits)) => {
    const [size, suffix] = prefixOf(steps, last, top);
    return scaled(splits, size, suffix);
  };
}

const SI = [[1e15, "P"], [1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];
const BINARY = [[2 ** 50, " PiB"], [2 ** 40, " TiB"], [2 ** 30, " GiB"], [2 ** 20, " MiB"],
  [2 ** 10, " KiB"]];
const ROUND = [0.001, 0.002, 0.0025, 0.005, 0.01, 0.02, 0.025, 0.05, 0.1, 0.2, 0.25, 0.5,
  1, 2, 2.5, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 2500, 5000];

/** Tick spacings of a byte axis from `lo` to `hi`: round numbers of the binary unit its labels
 * are written in (0.25 GiB, never 200 MiB on a GiB axis). */
function byteIncrs(u, axisIdx, lo, hi) {
  const [size] = prefixOf(BINARY, [1], Math.max(Math.abs(lo), Math.abs(hi)));
  return ROUND.map((m) => m * size).filter((x) => x >= 1 || size === 1);
}

/** Whole steps for the x axis (steps are integers: never a tick at 2.5). */
export const STEP_INCRS = Array.from({ length: 16 }, (_, e) => [1, 2, 5].map((m) => m * 10 ** e))
  .flat();

const fixed = (digits) => (v) => (Math.abs(v) >= LARGE ? v.toExponential(2) : v.toFixed(digits));
const percent = (v) => `${+(v * 100).toFixed(1)}%`;

/** Values by the catalog's `format` (for unit "" and units not listed in UNITS). */
const FORMATS = {
  num: (digits) => (v) => fmtNum(v, digits),
  fixed,
  exp: (digits) => (v) => (v === 0 ? "0" : v.toExponential(digits)),
  percent: () => percent,
  seconds: () => fmtSeconds,
  si: () => fmtSI,
  bytes: () => fmtBytes,
};

/**
 * The units, by the catalog's `unit`: `value(digits)` makes a value's writer, `ticks` writes an
 * axis's labels, `range(lo, hi)` (where set) is an axis's [min, max] for data from `lo` to `hi`,
 * `zeroSpan` the span of a series flat at 0, `nonNegative` whether a range may go below 0,
 * `incrs` the tick spacings uPlot picks from, `written` whether a value's text names the unit.
 */
const UNITS = {
  fraction: {
    value: () => percent,
    ticks: (splits) => scaled(splits, 0.01, "%", 2),
    // a fraction inside [0, 1] is shown on the whole of it: 0% to 100%, flat or not
    range: (lo, hi) => (lo >= 0 && hi <= 1 ? [0, 1] : null),
    nonNegative: true,
    written: true,
  },
  bytes: {
    value: () => fmtBytes,
    ticks: prefixed(BINARY, [1, " B"]),
    incrs: byteIncrs,
    zeroSpan: 1024,
    nonNegative: true,
    written: true,
  },
  "tokens/s": { value: () => fmtSI, ticks: prefixed(SI, [1, ""]), nonNegative: true },
  s: {
    value: () => fmtSeconds,
    ticks: (splits, top = topOf(splits)) =>
      (top > 0 && top < 1 ? scaled(splits, 1e-3, " ms") : scaled(splits, 1, " s")),
    nonNegative: true,
    written: true,
  },
  "nats/token": { value: fixed, ticks: plainTicks },
  tokens: { value: fixed, ticks: plainTicks, nonNegative: true },
};

/** The unit of a catalog entry (null: a name the catalog lacks): its `unit`'s, else its
 * `format`'s values on a plain axis. `text` is the unit as the catalog writes it; `ticks(splits,
 * top)` writes an axis's labels, `top` the axis's largest magnitude (it picks GiB or MiB). */
export function unitOf(metric) {
  const digits = metric?.digits ?? 4;
  const known = metric ? UNITS[metric.unit] : undefined;
  const make = known?.value || FORMATS[metric?.format] || FORMATS.num;
  const unit = { ticks: plainTicks, ...known, value: guarded(make(digits)),
    text: metric?.unit || "" };
  unit.axisRange = (lo, hi) => axisRange(unit, lo, hi);
  return unit;
}

/** The plain unit of a name the catalog lacks. */
export const PLAIN = unitOf(null);

/**
 * An axis's [min, max] for data from `lo` to `hi` (null: no finite value). A flat series gets a
 * range around its value (±10%, or the unit's span at 0), never uPlot's 0-100 for a flat 0.
 */
function axisRange(unit, lo, hi) {
  if (!finite(lo) || !finite(hi)) return unit.range?.(0, 0) || [0, unit.zeroSpan || 1];
  const own = unit.range?.(lo, hi);
  if (own) return own;
  const span = unit.zeroSpan || 1;
  if (lo === 0 && hi === 0) return [unit.nonNegative ? 0 : -span, span];
  const pad = (lo === hi ? Math.abs(lo) : hi - lo) * 0.1;
  let a = lo - pad;
  const b = hi + pad;
  if (!Number.isFinite(a) || !Number.isFinite(b)) {  // next to the largest double
    return [Math.min(lo, lo / 2), Math.max(hi, hi / 2)];
  }
  if (unit.nonNegative && lo >= 0) a = Math.max(0, a);
  return nice(a, b);
}

/** [a, b] widened to round numbers at a tenth of the span's order of magnitude. */
function nice(a, b) {
  const span = b - a;
  if (!(span > 0) || !Number.isFinite(span)) return [a, b === a ? a + 1 : b];
  const step = 10 ** Math.floor(Math.log10(span)) / 10;
  const lo = Math.floor(a / step) * step, hi = Math.ceil(b / step) * step;
  return Number.isFinite(lo) && Number.isFinite(hi) && hi > lo ? [lo, hi] : [a, b];
}

/**
 * Whether a series' points get markers: where it has one point, or few enough in view that each
 * stands apart (12 px or more); dense series are lines only.
 */
export function showMarkers(u, si, i0, i1) {
  const ys = u.data[si];
  if (!ys || i0 === null || i0 === undefined) return false;
  const room = Math.max(1, u.bbox.width / (devicePixelRatio || 1) / 12);
  let n = 0;
  for (let i = i0; i <= i1; i++) if (ys[i] != null && ++n > room) return false;
  return n > 0;
}

/** The x scale of a chart over steps: one step alone is shown with a step either side. */
export function stepRange(u, lo, hi) {
  const xs = u.data[0];
  if (xs.length && xs[0] === xs[xs.length - 1]) return [xs[0] - 1, xs[0] + 1];
  return [lo, hi];
}
