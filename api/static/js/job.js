// One job: header with progress and cancel, its stages (a spec with `stages`), live charts, the
// ring, the evaluation grids, state timeline (with the audit trail's rows for the job: who created
// or cancelled it, from where), logs.
// Where each metric goes (a chart, a grid, a figure), its title and format come from the metric
// catalog (metrics.js); a name the catalog lacks still gets a plain chart, under "Other".
// Initial load: GET /v1/jobs/{id}/series (downsampled on the server, consistent as of last_seq); then the
// job's SSE stream from last_seq appends points. Without the /series route it replays the stream from 0.
import { api, ApiError, followEvents } from "./api.js";
import { mountArtifacts } from "./artifacts.js";
import { LiveChart, timings } from "./charts.js";
import { renderGrid } from "./grid.js";
import { Catalog, familyOf, loadCatalog, naturalCompare } from "./metrics.js";
import { ProfileChart } from "./profile.js";
import { pipelineOf, renderRing } from "./ring.js";
import { renderStages, shapeOf, stageMarks } from "./stages.js";
import { PLAIN } from "./units.js";
import { age, clock, fmtSeconds, h, progress, stateBadge, TERMINAL } from "./util.js";

const LOG_TAIL = 500;
// names the catalog lacks: a plain chart each (one per family, e.g. `probe/len={len}`), up to this many
const MAX_OTHER_CHARTS = 24;
// the two per-rank figures the ring view draws (catalog names)
const RING_MEMORY = "mem_peak_bytes";
const RING_STEP_TIME = "step_time_s";
// the stage index of each step: no chart of its own where the page shows the job's stages (their
// table, and their boundaries on every chart over steps say the same)
const STAGE_INDEX = "stage";

export function mountJob(root, jobId) {
  const ctrl = new AbortController();
  let stopEvents = null;
  let job = null;
  let destroyed = false;
  const transitions = new Map();
  let auditRows = [];
  const logs = [];
  const perRank = new Map();
  let globalStepTime;
  let catalog = new Catalog();
  const charts = new Map(); // chart key -> LiveChart, created on a metric's first point
  const slots = new Map(); // chart key or "group:<id>" -> where its chart goes, in catalog order
  const groupHeads = new Map(); // group id -> its heading, shown once the group has a chart
  const grids = new Map(); // grid entry key -> {metric, cells: Map name -> {fields, value}}
  const stats = new Map(); // "name|rank" -> {metric, label, step, value} of "stat" entries
  const profiles = new Map(); // entry key -> ProfileChart of a family with `profile` set
  let otherCharts = 0;
  let marks = []; // the stage boundaries every chart over steps draws (stages.js)
  const timers = new Set();

  const head = h("section.panel.job-head-wrap", { "aria-labelledby": "job-title" });
  const errorBox = h("section.panel.alert", { role: "alert", hidden: true });
  const stagesBox = h("div");
  const stagesPanel = h("section.panel#stages", { "aria-labelledby": "stages-h", hidden: true },
    h("h2#stages-h", {}, "Stages"), stagesBox); // shown for a job with stages
  const chartsGrid = h("div.charts");
  const ringBox = h("div#ring");
  const gridsBox = h("div#grids");
  const gridsPanel = h("section.panel", { "aria-labelledby": "grids-h", hidden: true },
    h("h2#grids-h", {}, "Evaluation grids"), gridsBox); // shown once the job has a grid's member
  const statsBox = h("dl#metric-stats.stats", { hidden: true });
  const noMetrics = h("p.muted#metrics-empty", {}, "No metric points yet.");
  const timeline = h("ol.timeline#timeline");
  const logBox = h("pre.logs#logs", { tabindex: 0, "aria-label": "log tail" });
  const live = h("span.live", { "aria-live": "polite" }, "connecting…");
  const modelBox = h("div#artifacts");
  root.append(
    h("nav", { "aria-label": "Breadcrumb" }, h("a", { href: "#/jobs" }, "← Jobs")),
    head, errorBox, stagesPanel,
    h("section.panel", { "aria-labelledby": "metrics-h" },
      h("div.toolbar", {}, h("h2#metrics-h", {}, "Metrics"), live,
        h("span.muted", {}, "Drag across a chart to zoom, double-click to reset; hover for values.")),
      noMetrics, statsBox, chartsGrid),
    h("div.two", {},
      h("section.panel", { "aria-labelledby": "ring-h" }, h("h2#ring-h", {}, "Ring"), ringBox),
      h("div", {},
        gridsPanel,
        h("section.panel", { "aria-labelledby": "timeline-h" }, h("h2#timeline-h", {}, "State timeline"), timeline))),
    h("section.panel", { "aria-labelledby": "model-h" }, h("h2#model-h", {}, "Model"), modelBox),
    h("section.panel", { "aria-labelledby": "logs-h" },
      h("div.toolbar", {}, h("h2#logs-h", {}, "Logs"), h("span.muted", {}, `last ${LOG_TAIL} lines`)),
      logBox));
  const model = mountArtifacts(modelBox, jobId, ctrl.signal);

  function later(fn, ms) {
    const t = setTimeout(() => { timers.delete(t); fn(); }, ms);
    timers.add(t);
    return t;
  }
  function throttled(fn, ms) { // leading call now, then at most one per `ms`
    let pending = null, last = -Infinity;
    const run = () => { pending = null; last = performance.now(); if (!destroyed) fn(); };
    return () => {
      if (pending) return;
      const wait = last + ms - performance.now();
      if (wait <= 0) run(); else pending = later(run, wait);
    };
  }

  // ---- rendering ------------------------------------------------------------------------------
  function renderHead() {
    if (!job) return;
    const terminal = TERMINAL.has(job.state);
    const cancel = h("button.danger#cancel-button", { type: "button", disabled: terminal || job.cancel_requested },
      job.cancel_requested && !terminal ? "Cancelling…" : "Cancel job");
    cancel.addEventListener("click", confirmCancel);
    const meta = job.metadata || {};
    head.replaceChildren(h("div.job-head", {},
      h("div.title", {},
        h("h1#job-title", {}, job.name, " ", h("span#job-state", {}, stateBadge(job.state))),
        progress(job.step, job.total_steps),
        h("dl", {},
          h("dt", {}, "Job"), h("dd.mono", {}, job.id),
          h("dt", {}, "Owner"), h("dd", {}, job.owner),
          h("dt", {}, "Created"), h("dd", { title: job.created_at }, `${age(job.created_at)} ago`),
          job.queue_position != null ? [h("dt", {}, "Queue"), h("dd#job-queue", {},
            `#${job.queue_position} (priority ${job.priority ?? 0}): ${job.queue_reason || "waiting"}`)] : null,
          h("dt", {}, "Verified"), h("dd#job-verification", {}, verificationBadge(job)),
          h("dt", {}, "Restarts"), h("dd", {}, `${job.restarts} of ${job.spec?.max_restarts ?? "?"}`),
          h("dt", {}, "Parallel"), h("dd#job-shape", {}, shapeText(job)),
          h("dt", {}, "Memory"), h("dd#job-memory", {}, job.memory_knobs || ""),
          job.spec?.init_from ? [h("dt", {}, "Starts from"), h("dd#job-init-from", {}, initFrom(job.spec.init_from))] : null,
          Object.keys(meta).length ? [h("dt", {}, "Runtime"), h("dd.mono", {},
            Object.entries(meta).map(([k, v]) => `${k}=${v}`).join("  "))] : null)),
      h("div", {}, cancel)));
    if (job.error) {
      errorBox.hidden = false;
      errorBox.replaceChildren(h("h2", {}, "Error"), h("pre", {}, job.error));
    } else errorBox.hidden = true;
  }

  // The stored shape (a `ring_size: auto` job shows what submission resolved it to); a job with
  // stages, its current stage's.
  function shapeText(j) {
    const stage = j.stages?.find((s) => s.index === j.stage);
    if (stage) return `${shapeOf(stage.parallel)}, seq_len ${stage.seq_len} (stage ${stage.name})`;
    return `${shapeOf(j.spec?.parallel)}, seq_len ${j.spec?.data?.seq_len ?? "?"}`;
  }

  function renderStagesPanel() {
    stagesPanel.hidden = !job.stages?.length;
    stagesBox.replaceChildren(job.stages?.length ? renderStages(job) : "");
    marks = stageMarks(job);
    for (const c of charts.values()) c.setMarks(marks);
  }

  // Where a job's weights came from (`init_from`): a link to the source job, or its directory.
  function initFrom(src) {
    const what = `step ${src.step ?? "latest"}, ${src.state === "full" ? "full state" : "weights"}`;
    if (!src.job) return h("span.mono", {}, `${src.checkpoint} (${what})`);
    return [h("a.mono", { href: `#/jobs/${encodeURIComponent(src.job)}` }, src.job), ` (${what})`];
  }

  // The pre-training check of the job's math (derived by the server from the verify_* points).
  function verificationBadge(j) {
    const v = j.verification;
    if (!v) return h("span.muted", {}, j.spec?.verify?.enabled === false ? "disabled" : "not yet");
    const err = v.max_rel_err == null ? "non-finite" : v.max_rel_err.toExponential(1);
    const tol = v.tolerance == null ? "?" : v.tolerance.toExponential(0);
    const fp32 = v.fp32_rel_err == null ? "" : `, ${v.fp32_rel_err.toExponential(1)} vs fp32`;
    const took = v.seconds == null ? "" : `, ${fmtSeconds(v.seconds)}`;
    const title = `distributed forward/backward against a one-rank reference on ${v.tokens} ` +
      `random tokens${took}`;
    const verdict = v.passed ? `passed: error ${err} ≤` : `failed: error ${err} >`;
    return h(`span.verify.${v.passed ? "verify-passed" : "verify-failed"}`, { title },
      `${verdict} tolerance ${tol}${fp32}`);
  }

  const renderRingSoon = throttled(() => {
    const vals = new Map();
    for (const p of job?.placement || []) {
      const m = perRank.get(p.rank) || {};
      vals.set(p.rank, { mem: m.mem, stepTime: m.stepTime ?? globalStepTime });
    }
    // the shape the placement was made for: the current stage's, or the job's
    const parallel = job?.stages?.find((st) => st.index === job.stage)?.parallel ?? job?.spec?.parallel;
    const pipeline = pipelineOf(parallel, job?.spec?.model?.n_layers);
    ringBox.replaceChildren(renderRing(job?.placement || [], vals, { caption: "ranks of this job", pipeline }));
  }, 500);
  const renderGridsSoon = throttled(() => {
    const shown = [...grids.values()].filter((g) => g.cells.size);
    shown.sort((a, b) => a.metric.order - b.metric.order);
    gridsPanel.hidden = !shown.length;
    gridsBox.replaceChildren(...shown.map((g) => renderGrid(g.metric, g.cells)));
  }, 500);
  const renderProfilesSoon = throttled(() => { for (const p of profiles.values()) p.draw(); }, 300);
  const renderStatsSoon = throttled(() => {
    const byMetric = new Map();
    for (const st of stats.values()) {
      if (!byMetric.has(st.metric)) byMetric.set(st.metric, []);
      byMetric.get(st.metric).push(st);
    }
    const entries = [...byMetric].sort((a, b) => a[0].order - b[0].order);
    statsBox.hidden = !entries.length;
    if (entries.length) noMetrics.hidden = true;
    statsBox.replaceChildren(...entries.flatMap(([m, list]) => [
      h("dt", { title: m.description }, m.title),
      h("dd", { dataset: { metric: m.key } },
        list.sort((a, b) => naturalCompare(a.label, b.label)).map((st) => h("span.stat",
          { title: `step ${st.step}` }, st.label ? `${st.label}: ` : "", m.fmt(st.value))))]));
  }, 300);

  // ---- where each metric goes (from the catalog) ----------------------------------------------
  function useCatalog(c) {
    catalog = c;
    const groups = [...c.groups, { id: "other", title: "Other" }];
    for (const g of groups) {
      const head = h("h3.chart-group", { hidden: true, dataset: { group: g.id } }, g.title);
      groupHeads.set(g.id, head);
      chartsGrid.append(head);
      for (const m of c.shownAs("line").filter((x) => x.group === g.id)) {
        const slot = h("div.chart-slot");
        slots.set(m.key, slot);
        chartsGrid.append(slot);
        if (m.profile) { // its profile chart follows the family's chart
          const at = h("div.chart-slot");
          slots.set(`profile:${m.key}`, at);
          chartsGrid.append(at);
        }
      }
      const rest = h("div.chart-slot"); // the group's charts of names the catalog lacks
      slots.set(`group:${g.id}`, rest);
      chartsGrid.append(rest);
    }
  }

  /** The chart and series label of a metric, the chart created on first use; null: not charted. */
  function chartOf(name) {
    const hit = catalog.lookup(name);
    if (hit && hit.metric.view !== "line") return null;
    if (name === STAGE_INDEX && job?.stages?.length) return null;
    const family = hit ? null : familyOf(name);  // a name the catalog lacks: its own family, if any
    const id = family ? family.pattern : name;
    const key = hit ? hit.metric.key : `other:${id}`;
    let chart = charts.get(key);
    if (!chart) {
      const group = hit ? hit.metric.group : "other";
      if (!hit && ++otherCharts > MAX_OTHER_CHARTS) return null;
      const slot = (hit && slots.get(key)) || slots.get(`group:${group}`) || chartsGrid;
      chart = new LiveChart(slot, hit
        ? { id: key, title: hit.metric.title, unit: hit.metric.unitFormat }
        : { id, title: id, unit: PLAIN });
      chart.setMarks(marks);
      charts.set(key, chart);
      groupHeads.get(group)?.removeAttribute("hidden");
      noMetrics.hidden = true;
    }
    return { chart, label: hit?.label || family?.label || null };
  }

  function renderTimeline() {
    const states = [...transitions.values()].sort((a, b) => a.seq - b.seq).map((t) => [t.time, h("li", { dataset: { to: t.to } },
      h("time", { datetime: new Date(t.time * 1000).toISOString() }, clock(t.time)),
      h("span", {}, stateBadge(t.to)),
      h("span", {}, t.reason || h("span.muted", {}, "—"), t.from ? h("span.muted", {}, ` (from ${t.from})`) : null,
        t.resume_step !== null && t.resume_step !== undefined
          ? h("span.resume", {}, ` — resuming from step ${t.resume_step}; later points superseded`) : null))]);
    const audits = auditRows.map((a) => {
      const t = Date.parse(a.time) / 1000;
      return [t, h("li.audit", { dataset: { audit: a.action } },
        h("time", { datetime: a.time }, clock(t)),
        h("span", {}, h("span.state.audit-badge", {}, "audit")),
        h("span", {}, `${a.action} by ${a.owner} from ${a.client}`,
          h("span.muted", {}, ` (${a.status} ${a.outcome})`)))];
    });
    // stable sort: a transition and the request that caused it keep their order when the times tie
    timeline.replaceChildren(...[...states, ...audits].sort((x, y) => x[0] - y[0]).map((x) => x[1]));
  }

  const loadAudit = throttled(async () => {
    try {
      const page = await api(`/v1/audit?job_id=${encodeURIComponent(jobId)}&limit=100`, { signal: ctrl.signal });
      auditRows = page.events;
      renderTimeline();
    } catch (e) { if (e.name !== "AbortError") console.warn("audit trail:", e.message); }
  }, 1000);

  const renderLogsSoon = throttled(() => {
    const atBottom = logBox.scrollTop + logBox.clientHeight >= logBox.scrollHeight - 8;
    logBox.textContent = logs.length
      ? logs.map((l) => `${clock(l.time)} [${l.source}] ${l.line}`).join("\n")
      : "No log lines yet.";
    if (atBottom) logBox.scrollTop = logBox.scrollHeight;
  }, 300);
  const renderHeadSoon = throttled(renderHead, 250);

  // ---- data -----------------------------------------------------------------------------------
  function notePoint(name, rank, step, value) {
    if (rank !== null && rank !== undefined) {
      const m = perRank.get(rank) || {};
      if (name === RING_MEMORY) m.mem = value;
      if (name === RING_STEP_TIME) m.stepTime = value;
      perRank.set(rank, m);
      renderRingSoon();
    } else if (name === RING_STEP_TIME) {
      globalStepTime = value;
      renderRingSoon();
    }
    const hit = catalog.lookup(name);
    if (hit?.metric.profile) notePoints(hit, [step], [value]);
    if (hit?.metric.view === "grid") {
      const key = hit.metric.key;
      if (!grids.has(key)) grids.set(key, { metric: hit.metric, cells: new Map() });
      grids.get(key).cells.set(name, { fields: hit.fields, value });
      renderGridsSoon();
    } else if (hit?.metric.view === "stat") {
      const who = rank === null || rank === undefined ? "" : `rank ${rank}`;
      const label = [hit.label, who].filter(Boolean).join(" ");
      stats.set(`${name}|${rank ?? ""}`, { metric: hit.metric, label, step, value });
      renderStatsSoon();
    }
  }

  /** Points of a profile family's member (its entry's `profile` field is the chart's x). */
  function notePoints(hit, steps, values) {
    const key = hit.metric.key;
    let chart = profiles.get(key);
    if (!chart) {
      chart = new ProfileChart(slots.get(`profile:${key}`) || chartsGrid, hit.metric);
      profiles.set(key, chart);
    }
    steps.forEach((s, i) => chart.push(hit.fields, s, values[i]));
    renderProfilesSoon();
  }

  function onMetric(p) {
    const where = chartOf(p.name);
    if (where) where.chart.push(p.step, p.rank, p.value, where.label);
    notePoint(p.name, p.rank, p.step, p.value);
    // the server derives the job's `verification` from the points of the verification group
    if (catalog.lookup(p.name)?.metric.group === "verification") refreshJob();
    if (job && p.rank === null && p.step > job.step && !TERMINAL.has(job.state)) {
      job.step = p.step;
      job.latest_metrics ||= {};
      renderHeadSoon();
      // the current stage's last step done: the server says which stage runs now
      const stage = job.stages?.find((s) => s.index === job.stage);
      if (stage && p.step >= stage.end_step) refreshJob();
    }
  }

  function onState(t) {
    transitions.set(t.seq, t);
    renderTimeline();
    loadAudit();
    if (t.resume_step !== null && t.resume_step !== undefined) {  // a retry, or a resubmitted driver
      for (const c of charts.values()) c.truncateAfter(t.resume_step);
      for (const c of profiles.values()) c.truncateAfter(t.resume_step);
      renderProfilesSoon();
    }
    if (job) { job.state = t.to; renderHead(); }
    refreshJob();
  }

  function onLog(l) {
    logs.push(l);
    if (logs.length > LOG_TAIL) logs.splice(0, logs.length - LOG_TAIL);
    renderLogsSoon();
  }

  const refreshJob = throttled(async () => {
    try {
      const j = await api(`/v1/jobs/${encodeURIComponent(jobId)}`, { signal: ctrl.signal });
      setJob(j);
    } catch (e) { if (e.name !== "AbortError") console.warn("refresh job:", e.message); }
  }, 300);

  let queueTimer = null;
  const latestSeq = (ts) => Math.max(-1, ...[...ts].map((t) => t.seq));
  function setJob(j) {
    // Two reads can be in flight and answer out of order: one that misses a state change an event already
    // brought is stale, and applying it would show the older state until the next change.
    if (job && j.transitions && latestSeq(j.transitions) < latestSeq(transitions.values())) return;
    const placementChanged = JSON.stringify(j.placement) !== JSON.stringify(job?.placement);
    if (!job || TERMINAL.has(j.state)) model.refresh(j);  // the model appears when the job succeeds
    job = j;
    for (const t of j.transitions || []) if (!transitions.has(t.seq)) transitions.set(t.seq, t);
    renderHead();
    renderStagesPanel();
    renderTimeline();
    if (placementChanged) renderRingSoon();
    // a waiting job's queue position changes without events: re-read it while it waits
    clearTimeout(queueTimer);
    if (j.state === "QUEUED") queueTimer = setTimeout(() => { if (!ctrl.signal.aborted) refreshJob(); }, 2000);
  }

  async function confirmCancel() {
    const dlg = document.getElementById("confirm-dialog");
    document.getElementById("confirm-text").textContent =
      `Cancel “${job.name}” (${job.id})? Training stops and the job's cluster resources are released. ` +
      "Checkpoints already written are kept.";
    dlg.returnValue = "";
    dlg.showModal();
    dlg.addEventListener("close", async () => {
      if (dlg.returnValue !== "yes") return;
      try {
        setJob(await api(`/v1/jobs/${encodeURIComponent(jobId)}/cancel`, { method: "POST", signal: ctrl.signal }));
        loadAudit();
      } catch (e) {
        if (e.name !== "AbortError") { errorBox.hidden = false; errorBox.replaceChildren(`Cancel failed: ${e.message}`); }
      }
    }, { once: true });
  }

  async function load() {
    const t0 = performance.now();
    let after = 0;
    const catalogP = loadCatalog().catch((e) => {
      console.warn("metric catalog (charting every metric plainly):", e.message);
      return new Catalog();
    });
    const seriesP = api(
      `/v1/jobs/${encodeURIComponent(jobId)}/series?max_points=4000&logs=${LOG_TAIL}`,
      { signal: ctrl.signal });
    seriesP.catch(() => {}); // in flight while the catalog loads; its failure is handled below
    useCatalog(await catalogP);
    try {
      const snap = await seriesP;
      const tFetch = performance.now();
      after = snap.last_seq;
      setJob(snap.job);
      const byChart = new Map();
      for (const s of snap.series) {
        const where = chartOf(s.name);
        if (where) {
          if (!byChart.has(where.chart)) byChart.set(where.chart, []);
          byChart.get(where.chart).push({ ...s, label: where.label });
        }
        const n = s.value.length;
        if (n) notePoint(s.name, s.rank, s.step[n - 1], s.value[n - 1]);
        const hit = catalog.lookup(s.name);  // a profile shows the first evaluation too
        if (n > 1 && hit?.metric.profile) {
          notePoints(hit, s.step.slice(0, -1), s.value.slice(0, -1));
        }
      }
      for (const [chart, list] of byChart) chart.load(list);
      for (const l of snap.logs) onLog(l);
      timings.snapshots.push({ job: jobId, fetchMs: tFetch - t0, totalMs: performance.now() - t0,
        points: snap.series.reduce((a, s) => a + s.count, 0),
        returned: snap.series.reduce((a, s) => a + s.step.length, 0) });
    } catch (e) {
      if (e.name === "AbortError") return;
      if (e instanceof ApiError && e.status === 404 && e.field !== "id") {
        // the /series route is not mounted: read the job, then replay the whole stream
        try { setJob(await api(`/v1/jobs/${encodeURIComponent(jobId)}`, { signal: ctrl.signal })); } catch (e2) {
          if (e2.name !== "AbortError") head.replaceChildren(h("p.error-text", {}, e2.message));
          return;
        }
      } else {
        head.replaceChildren(h("h1#job-title", {}, "Job ", jobId),
          h("p.error-text", { role: "alert" }, e.status === 404 ? `Job ${jobId} not found.` : e.message));
        live.textContent = "";
        return;
      }
    }
    renderRingSoon();
    renderGridsSoon();
    renderLogsSoon();
    loadAudit();
    if (destroyed) return;
    stopEvents = followEvents(jobId, after, {
      metric: onMetric, state: onState, log: onLog,
      end: () => refreshJob(),
      status: (text, cls) => { live.textContent = text; live.className = `live ${cls}`; },
    });
  }

  load();
  return () => {
    destroyed = true;
    ctrl.abort();
    if (stopEvents) stopEvents();
    for (const t of timers) clearTimeout(t);
    for (const c of charts.values()) c.destroy();
    for (const c of profiles.values()) c.destroy();
  };
}
