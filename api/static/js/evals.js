// Evaluations (beside the datasets, #/datasets): each RULER-style eval run on the cluster with its
// state, progress, effective length and score per length; polls while any runs.
import { api } from "./api.js";
import { h, progress, stateBadge } from "./util.js";

const POLL_MS = 2000;

export function mountEvals(root) {
  const tbody = h("tbody");
  const err = h("p.error-text", { role: "alert", hidden: true });
  root.append(
    h("section.panel", { "aria-labelledby": "evals-h" },
      h("div.toolbar", {}, h("h2#evals-h", {}, "Evaluations")),
      h("p.muted", {}, "Run one with `ringtrain eval MODEL_DIR|JOB_ID --on-cluster --lengths ...` or POST /v1/evals."),
      err,
      h("table#evals-table", {},
        h("caption.sr-only", {}, "Evaluations, newest first"),
        h("thead", {}, h("tr", {},
          h("th", { scope: "col" }, "Model"), h("th", { scope: "col" }, "State"),
          h("th", { scope: "col" }, "Progress"), h("th.num", { scope: "col" }, "Effective length"),
          h("th", { scope: "col" }, "Score by length"))),
        tbody)));

  let timer = null;
  let stopped = false;
  const ctrl = new AbortController();

  function row(e) {
    const p = e.progress || { samples_done: 0, samples_total: 0 };
    const scores = e.result ? Object.entries(e.result.by_length)
      .map(([n, v]) => `${n}: ${v.toFixed(2)}`).join(" · ") : "";
    return h("tr", { "data-id": e.id },
      h("td", { title: e.model }, e.job ? `job ${e.job}` : e.model),
      h("td", {}, stateBadge(e.state), e.error ? h("div.error-text", {}, e.error) : null),
      h("td", {}, progress(p.samples_done, p.samples_total || 1)),
      h("td.num", {}, e.result ? String(e.result.effective_length) : ""),
      h("td", { title: e.result ? `threshold ${e.result.threshold}` : "" }, scores));
  }

  async function load() {
    let running = false;
    try {
      const list = await api("/v1/evals", { signal: ctrl.signal });
      err.hidden = true;
      tbody.replaceChildren(...(list.length ? list.map(row)
        : [h("tr", {}, h("td.muted", { colspan: 5 }, "No evaluations yet."))]));
      running = list.some((e) => e.state === "QUEUED" || e.state === "RUNNING");
    } catch (e) {
      if (e.name === "AbortError") return;
      err.textContent = `Could not load evaluations: ${e.message}`;
      err.hidden = false;
      if (e.status === 401) return;
    }
    if (!stopped && running) timer = setTimeout(load, POLL_MS);
  }
  load();
  return () => { stopped = true; ctrl.abort(); clearTimeout(timer); };
}
