// The jobs list: live (polls the API every 2 s), filterable by state and by the outcome of the
// pre-training verification (`?verification=passed|failed`; jobs that have not verified, or have it
// disabled, match neither). The metric columns (latest loss, tokens/s, ...) are the catalog's
// entries marked `column` (metrics.js).
import { api } from "./api.js";
import { Catalog, loadCatalog } from "./metrics.js";
import { age, h, progress, STATES, stateBadge } from "./util.js";

const POLL_MS = 2000;
const VERIFICATIONS = ["passed", "failed"]; // what GET /v1/jobs?verification= accepts

export function mountJobs(root, query) {
  const state = query.get("state") || "";
  const asked = query.get("verification") || "";
  const verification = VERIFICATIONS.includes(asked) ? asked : "";
  const select = h("select#state-filter", { "aria-describedby": "jobs-count" },
    h("option", { value: "" }, "All states"),
    STATES.map((s) => h("option", { value: s, selected: s === state }, s)));
  const verifySelect = h("select#verification-filter", { "aria-describedby": "jobs-count" },
    h("option", { value: "" }, "Any"),
    VERIFICATIONS.map((v) => h("option", { value: v, selected: v === verification }, v)));
  function navigate() {
    const qs = new URLSearchParams();
    if (select.value) qs.set("state", select.value);
    if (verifySelect.value) qs.set("verification", verifySelect.value);
    const search = qs.toString();
    location.hash = search ? `#/jobs?${search}` : "#/jobs";
  }
  select.addEventListener("change", navigate);
  verifySelect.addEventListener("change", navigate);
  const count = h("span#jobs-count.muted", { "aria-live": "polite" });
  const tbody = h("tbody");
  const thead = h("thead");
  let columns = [];
  const table = h("table#jobs-table", {},
    h("caption.sr-only", {}, "Jobs, newest first"), thead, tbody);
  function renderHead() {
    thead.replaceChildren(h("tr", {},
      h("th", { scope: "col" }, "Name"), h("th", { scope: "col" }, "Owner"), h("th", { scope: "col" }, "State"),
      h("th", { scope: "col" }, "Progress"),
      columns.map((m) => h("th.num", { scope: "col", title: m.description }, m.title)),
      h("th.num", { scope: "col" }, "Age")));
  }
  renderHead();
  const err = h("p.error-text", { role: "alert", hidden: true });
  root.append(
    h("section.panel", { "aria-labelledby": "jobs-h" },
      h("div.toolbar", {},
        h("h1#jobs-h", {}, "Jobs"),
        h("span.spacer"),
        h("label", { for: "state-filter" }, "State"), select,
        h("label", { for: "verification-filter" }, "Verification"), verifySelect,
        count,
        h("a.button", { href: "#/submit" }, "New job")),
      err, table));

  let timer = null;
  let stopped = false;
  const ctrl = new AbortController();

  const catalogP = loadCatalog().catch((e) => {
    console.warn("metric catalog (no metric columns):", e.message);
    return new Catalog();
  });

  async function load() {
    if (!columns.length) {
      columns = (await catalogP).marked("column");
      renderHead();
    }
    const qs = new URLSearchParams({ limit: "100" });
    if (state) qs.append("state", state);
    if (verification) qs.append("verification", verification);
    try {
      const res = await api(`/v1/jobs?${qs}`, { signal: ctrl.signal });
      err.hidden = true;
      render(res);
    } catch (e) {
      if (e.name === "AbortError") return;
      err.textContent = `Could not load jobs: ${e.message}`;
      err.hidden = false;
      if (e.status === 401) return; // the token dialog is open; no point polling
    }
    if (!stopped) timer = setTimeout(load, POLL_MS);
  }

  function render(res) {
    const verified = verification ? ` verification ${verification}` : "";
    count.textContent = `${res.total} job${res.total === 1 ? "" : "s"}${state ? ` ${state}` : ""}` +
      (state && verified ? "," : "") + verified;
    if (!res.jobs.length) {
      const filtered = state || verification;
      const none = `No ${state ? `${state} ` : ""}jobs${verified ? ` with${verified}` : ""}.`;
      tbody.replaceChildren(h("tr", {}, h("td.muted", { colspan: 5 + columns.length },
        filtered ? none : "No jobs yet. ",
        filtered ? null : h("a", { href: "#/submit" }, "Submit one."))));
      return;
    }
    tbody.replaceChildren(...res.jobs.map((j) => {
      const lm = j.latest_metrics || {};
      return h("tr", { dataset: { jobId: j.id, state: j.state } },
        h("td", {}, h("a", { href: `#/jobs/${encodeURIComponent(j.id)}` }, j.name), h("div.muted.mono", {}, j.id)),
        h("td", {}, j.owner),
        h("td", { title: j.queue_reason || "" }, stateBadge(j.state),
          j.queue_position != null ? h("span.muted.queue-pos", {}, ` #${j.queue_position}`) : null,
          j.restarts ? h("span.muted", {}, ` ↻${j.restarts}`) : null,
          j.queue_reason ? h("div.muted.queue-reason", {}, j.queue_reason) : null),
        h("td", {}, progress(j.step, j.total_steps)),
        columns.map((m) =>
          h(`td.num.${m.key}`, { dataset: { metric: m.name } }, m.fmt(lm[m.name]?.value))),
        h("td.num", { title: j.created_at }, age(j.created_at)));
    }));
  }

  load();
  return () => { stopped = true; clearTimeout(timer); ctrl.abort(); };
}
