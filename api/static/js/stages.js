// A job's stages (a spec with `stages`; GET /v1/jobs/{id} gives each as it runs, its overrides
// applied): the job page's table of them, and the boundaries every chart over steps draws, a
// dashed line at the step where a stage takes over, labelled with its name. Which stage is current
// and each stage's state come from the server, so the page and `ringtrain status` agree.
import { cssVar, h, stateBadge } from "./util.js";

/** "dp 1 × ring 2 × ulysses 1 × tensor 1 (zigzag)" of a spec's or a stage's `parallel`; a pipeline
 * job's starts "pp 2 (1f1b) × ". */
export function shapeOf(p = {}) {
  const pp = (p.pipeline_size ?? 1) > 1 ? `pp ${p.pipeline_size} (${p.pipeline_schedule ?? "1f1b"}) × ` : "";
  return `${pp}dp ${p.data_parallel ?? 1} × ring ${p.ring_size ?? "?"}` +
    ` × ulysses ${p.ulysses_size ?? 1} × tensor ${p.tensor_size ?? 1}` +
    (p.layout ? ` (${p.layout})` : "");
}

/** The boundaries of a job's stages, [{step, label}]: each later stage's start_step (the last
 * step of the stage before it) and name. None for a job without stages. */
export function stageMarks(job) {
  return (job?.stages || []).slice(1).map((s) => ({ step: s.start_step, label: s.name }));
}

/** The table of a job's stages: one row a stage, the current one marked. */
export function renderStages(job) {
  const current = job.stage;
  const row = (s) => {
    const now = s.index === current;
    const state = s.state === "done" || s.state === "pending"
      ? h(`span.stage-state.stage-${s.state}`, {}, s.state) : stateBadge(s.state);
    return h(`tr${now ? ".current" : ""}`, { dataset: { stage: s.index },
      "aria-current": now ? "step" : null },
    h("td.num", {}, String(s.index + 1)),
    h("th", { scope: "row" }, s.name, now ? [" ", h("span.now", {}, "current")] : null),
    h("td.num", {}, `${(s.start_step + 1).toLocaleString("en-US")}–` +
      s.end_step.toLocaleString("en-US")),
    h("td.num", {}, s.seq_len.toLocaleString("en-US")),
    h("td", {}, shapeOf(s.parallel)),
    h("td.num", {}, String(s.world_size)),
    h("td", {}, state));
  };
  const cols = [["#", "num"], ["Stage"], ["Steps", "num"], ["Seq len", "num"], ["Shape"],
    ["Ranks", "num"], ["State"]];
  return h("table#stages-table", {},
    h("caption.sr-only", {}, "The job's stages, in the order they run"),
    h("thead", {}, h("tr", {}, cols.map(([t, cls]) => h(`th${cls ? `.${cls}` : ""}`,
      { scope: "col" }, t)))),
    h("tbody", {}, job.stages.map(row)));
}

const ROW_PX = 13;  // a label's line, in CSS pixels
const ROWS = 3;  // labels that would overlap go one row lower, up to this many rows

/**
 * Draws `marks` ([{step, label}], those inside the x scale) on a uPlot chart over steps: a dashed
 * line at the step and its label at the top of the plot. Called from the chart's draw hook; notes
 * what it drew on `fig.dataset.marks` ([{step, label, x}], x in CSS pixels from the plot's left),
 * since the canvas holds only pixels.
 */
export function drawMarks(u, marks, fig) {
  const { min, max } = u.scales.x;
  const shown = (marks || []).filter((m) => m.step >= min && m.step <= max);
  const noted = [];
  if (shown.length) {
    const pr = devicePixelRatio || 1;
    const { left, top, width, height } = u.bbox;
    const ctx = u.ctx;
    const colour = cssVar("--mark");
    ctx.save();
    ctx.beginPath();
    ctx.rect(left, top, width, height);
    ctx.clip();
    ctx.strokeStyle = colour;
    ctx.fillStyle = colour;
    ctx.lineWidth = Math.max(1, Math.round(pr));
    ctx.setLineDash([4 * pr, 3 * pr]);
    ctx.font = `${Math.round(11 * pr)}px system-ui, sans-serif`;
    ctx.textAlign = "left";
    ctx.textBaseline = "top";
    const ends = new Array(ROWS).fill(-Infinity);  // where each row's last label ends
    for (const m of shown) {
      // on the pixel grid: a line one device pixel wide covers that pixel column only
      const x = Math.round(u.valToPos(m.step, "x", true)) + (ctx.lineWidth % 2) / 2;
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, top + height);
      ctx.stroke();
      const w = ctx.measureText(m.label).width;
      const right = x + 3 * pr + w <= left + width;  // else the label goes left of the line
      const from = right ? x + 3 * pr : x - 3 * pr - w;
      let row = ends.findIndex((end) => end < from);
      if (row < 0) row = ROWS - 1;
      ends[row] = from + w + 4 * pr;
      ctx.fillText(m.label, from, top + (2 + row * ROW_PX) * pr);
      noted.push({ step: m.step, label: m.label, x: Math.round(u.valToPos(m.step, "x") * 10) / 10,
        row });
    }
    ctx.restore();
  }
  fig.dataset.marks = JSON.stringify(noted);
}
