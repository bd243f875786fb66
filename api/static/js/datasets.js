// Prepared datasets (#/datasets): each prepare with its state, progress and counts; polls while any runs.
import { api } from "./api.js";
import { fmtBytes, fmtSI, h, progress, stateBadge } from "./util.js";

const POLL_MS = 2000;

export function mountDatasets(root) {
  const tbody = h("tbody");
  const err = h("p.error-text", { role: "alert", hidden: true });
  root.append(
    h("section.panel", { "aria-labelledby": "datasets-h" },
      h("div.toolbar", {}, h("h1#datasets-h", {}, "Datasets")),
      h("p.muted", {}, "Prepare one with `ringtrain data prepare SOURCE --tokenizer DIR --out DIR` or POST /v1/datasets."),
      err,
      h("table#datasets-table", {},
        h("caption.sr-only", {}, "Prepared datasets, newest first"),
        h("thead", {}, h("tr", {},
          h("th", { scope: "col" }, "Output"), h("th", { scope: "col" }, "Format"),
          h("th", { scope: "col" }, "State"), h("th", { scope: "col" }, "Progress"),
          h("th.num", { scope: "col" }, "Documents"), h("th.num", { scope: "col" }, "Tokens"),
          h("th.num", { scope: "col" }, "Source size"))),
        tbody)));

  let timer = null;
  let stopped = false;
  const ctrl = new AbortController();

  function row(d) {
    const p = d.progress || { done_bytes: 0, total_bytes: 0 };
    return h("tr", { "data-id": d.id },
      h("td", { title: d.error || d.source }, d.out),
      h("td", {}, d.format),
      h("td", {}, stateBadge(d.state), d.error ? h("div.error-text", {}, d.error) : null),
      h("td", {}, progress(p.done_bytes, p.total_bytes || 1)),
      h("td.num", {}, d.documents == null ? "" : d.documents.toLocaleString()),
      h("td.num", {}, d.tokens == null ? "" : fmtSI(d.tokens)),
      h("td.num", {}, d.bytes == null ? "" : fmtBytes(d.bytes)));
  }

  async function load() {
    let running = false;
    try {
      const list = await api("/v1/datasets", { signal: ctrl.signal });
      err.hidden = true;
      tbody.replaceChildren(...(list.length ? list.map(row)
        : [h("tr", {}, h("td.muted", { colspan: 7 }, "No datasets yet."))]));
      running = list.some((d) => d.state === "QUEUED" || d.state === "RUNNING");
    } catch (e) {
      if (e.name === "AbortError") return;
      err.textContent = `Could not load datasets: ${e.message}`;
      err.hidden = false;
      if (e.status === 401) return;
    }
    if (!stopped && running) timer = setTimeout(load, POLL_MS);
  }
  load();
  return () => { stopped = true; ctrl.abort(); clearTimeout(timer); };
}
