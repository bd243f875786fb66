// Submit: a YAML/JSON spec editor; Plan (POST /v1/plan) previews placement and memory; Submit creates the job.
// A 422 names the failing field (`error.field`, e.g. "data.seq_len"): we find that key in the text, mark its
// line in the gutter and put the message beside it.
import { api } from "./api.js";
import { pipelineOf, renderRing } from "./ring.js";
import { fmtBytes, h } from "./util.js";

export const EXAMPLE = `name: passkey-16k
model: {d_model: 256, n_layers: 4, n_heads: 8, n_kv_heads: 2, ffn_mult: 4}
data: {kind: passkey, seq_len: 16384}        # or {kind: text, path: corpus.txt}
parallel: {ring_size: 4, data_parallel: 1, layout: zigzag}
train: {steps: 200, batch_size: 1, lr: 3.0e-4, warmup_steps: 20, seed: 0}
checkpoint: {every_steps: 50, keep: 3}
resources: {accelerator: auto, cpus_per_worker: 1}
max_restarts: 2
`;
const DRAFT = "ringtrain.draft";

/** The 0-based line where a dotted field path is written in YAML (block or flow) or JSON text, or -1. */
export function findFieldLine(text, field) {
  if (!field) return -1;
  const parts = field.split(".").filter((p) => !/^\d+$/.test(p));
  const lines = text.split("\n");
  let idx = 0, best = -1;
  for (let i = 0; i < lines.length && idx < parts.length; i++) {
    const line = lines[i].replace(/#.*$/, "");
    let from = 0;
    while (idx < parts.length) {
      const key = parts[idx].replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
      const re = new RegExp(`(^|[\\s{,])["']?${key}["']?\\s*:`, "g");
      re.lastIndex = from;
      const m = re.exec(line);
      if (!m) break;
      best = i;
      idx += 1;
      from = m.index + m[0].length;
    }
  }
  return best;
}

export function mountSubmit(root) {
  const ta = h("textarea#spec-editor", { spellcheck: "false", autocomplete: "off", wrap: "off",
    "aria-describedby": "spec-help field-errors" });
  ta.value = sessionStorage.getItem(DRAFT) || EXAMPLE;
  const gutter = h("div.gutter", { "aria-hidden": "true" });
  const mark = h("div.line-mark", { hidden: true });
  const editor = h("div.editor", {}, gutter, ta, mark);
  const errors = h("ul.field-errors#field-errors", { "aria-live": "assertive" });
  const result = h("div#plan-result", { "aria-live": "polite" });
  const planBtn = h("button.primary#plan-button", { type: "button" }, "Plan");
  const submitBtn = h("button#submit-button", { type: "button" }, "Submit job");
  const resetBtn = h("button.ghost", { type: "button" }, "Reset to example");
  let badLine = -1;

  root.append(h("section.panel", { "aria-labelledby": "submit-h" },
    h("div.toolbar", {}, h("h1#submit-h", {}, "Submit a job"), h("span.spacer"), resetBtn, planBtn, submitBtn),
    h("div.editor-grid", {},
      h("div", {},
        h("label", { for: "spec-editor" }, h("strong", {}, "Job spec"), " — YAML or JSON"),
        h("p#spec-help.muted", {}, "Plan checks the spec against the live cluster and previews placement and " +
          "per-rank memory; it reserves nothing. Ctrl+Enter plans."),
        editor),
      h("div", {}, h("h2", {}, "Problems"), errors, result))));

  function lineHeight() { return parseFloat(getComputedStyle(ta).lineHeight) || 21; }
  function paintGutter() {
    const n = ta.value.split("\n").length;
    if (gutter.childElementCount !== n) {
      gutter.replaceChildren(...Array.from({ length: n }, (_, i) => h("div", {}, i + 1)));
    }
    gutter.querySelectorAll("div.bad").forEach((d) => d.classList.remove("bad"));
    if (badLine >= 0 && gutter.children[badLine]) gutter.children[badLine].classList.add("bad");
    sync();
  }
  function sync() {
    gutter.scrollTop = ta.scrollTop;
    if (badLine >= 0) {
      mark.hidden = false;
      mark.style.top = `${8 + badLine * lineHeight() - ta.scrollTop}px`;
    } else mark.hidden = true;
  }
  ta.addEventListener("scroll", sync);
  ta.addEventListener("input", () => {
    sessionStorage.setItem(DRAFT, ta.value);
    paintGutter();
  });
  ta.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); plan(); }
    if (e.key === "Tab" && !e.shiftKey && !e.ctrlKey && !e.altKey && ta.selectionStart === ta.selectionEnd &&
        ta.value.slice(0, ta.selectionStart).split("\n").pop().trim() === "") {
      // indent on an empty line; elsewhere Tab moves focus as usual (keyboard users can leave the editor)
      e.preventDefault();
      ta.setRangeText("  ", ta.selectionStart, ta.selectionEnd, "end");
    }
  });
  resetBtn.addEventListener("click", () => { ta.value = EXAMPLE; sessionStorage.removeItem(DRAFT); clear(); paintGutter(); });
  planBtn.addEventListener("click", () => plan());
  submitBtn.addEventListener("click", () => submit());

  function contentType() { return ta.value.trimStart().startsWith("{") ? "application/json" : "application/yaml"; }

  function clear() {
    badLine = -1;
    errors.replaceChildren(h("li.muted", {}, "None so far."));
    editor.classList.remove("invalid");
    ta.removeAttribute("aria-invalid");
    paintGutter();
  }

  function showError(e) {
    const details = e.details && e.details.length ? e.details : [{ field: e.field, message: e.message }];
    badLine = findFieldLine(ta.value, e.field);
    editor.classList.add("invalid");
    ta.setAttribute("aria-invalid", "true");
    errors.replaceChildren(...details.map((d, i) => {
      const line = findFieldLine(ta.value, d.field);
      const li = h("li.field-error", { dataset: { field: d.field || "" } },
        d.field ? h("code", {}, d.field) : null, d.field ? " — " : null,
        i === 0 && !e.details?.length ? e.message : d.message,
        h("div.where", {}, line >= 0 ? `line ${line + 1}` : `HTTP ${e.status} ${e.code}`));
      if (line >= 0) {
        li.tabIndex = 0;
        li.title = "Go to the field";
        const go = () => goToLine(line);
        li.addEventListener("click", go);
        li.addEventListener("keydown", (ev) => { if (ev.key === "Enter") go(); });
      }
      return li;
    }));
    if (e.details?.length && e.message) errors.prepend(h("li.muted", {}, e.message));
    paintGutter();
    if (badLine >= 0) {
      // keep the message next to the field: scroll the editor so the line is visible
      const y = badLine * lineHeight();
      if (y < ta.scrollTop || y > ta.scrollTop + ta.clientHeight - 2 * lineHeight()) ta.scrollTop = Math.max(0, y - 60);
      sync();
    }
  }

  function goToLine(line) {
    const lines = ta.value.split("\n");
    const start = lines.slice(0, line).reduce((a, l) => a + l.length + 1, 0);
    ta.focus();
    ta.setSelectionRange(start, start + lines[line].length);
  }

  async function plan() {
    planBtn.disabled = true;
    result.replaceChildren(h("p.muted", {}, "Planning…"));
    try {
      const p = await api("/v1/plan", { method: "POST", body: ta.value, contentType: contentType() });
      clear();
      result.replaceChildren(renderPlan(p));
    } catch (e) {
      result.replaceChildren();
      showError(e);
    } finally { planBtn.disabled = false; }
  }

  async function submit() {
    submitBtn.disabled = true;
    try {
      const job = await api("/v1/jobs", { method: "POST", body: ta.value, contentType: contentType() });
      sessionStorage.removeItem(DRAFT);
      location.hash = `#/jobs/${encodeURIComponent(job.id)}`;
    } catch (e) {
      showError(e);
    } finally { submitBtn.disabled = false; }
  }

  clear();
  return () => {};
}

function renderPlan(p) {
  const mem = p.memory || {};
  const parts = mem.bytes || {};
  return h("section#plan-preview", { "aria-labelledby": "plan-h" },
    h("h2#plan-h", {}, "Plan ",
      p.fits ? h("span.plan-ok", {}, "✓ fits now") : p.valid ? h("span.plan-bad", {}, "valid, but does not fit now")
        : h("span.plan-bad", {}, "✗ cannot be placed")),
    h("p", {}, `${p.world_size} rank(s) · ${p.accelerator} · ${p.strategy} · ${p.nodes_used} node(s) · ` +
      `${p.node_crossings} node crossing(s) · bundle ${Object.entries(p.bundle || {}).map(([k, v]) => `${k}:${v}`).join(", ")}`),
    p.warnings?.length ? h("ul.warnings", {}, p.warnings.map((w) => h("li", {}, w))) : null,
    h("h3", {}, "Placement preview"),
    renderRing(p.placement || [], new Map(), { caption: "planned ranks",
      // a spec with stages previews its largest stage's placement: drawn without stage boxes
      pipeline: p.spec?.stages?.length ? null : pipelineOf(p.spec?.parallel, p.spec?.model?.n_layers) }),
    h("h3", {}, "Memory per rank (estimate)"),
    h("table#memory-table", {},
      h("tbody", {},
        Object.entries(parts).map(([k, v]) => h("tr", {}, h("th", { scope: "row" }, k.replace("_", " ")),
          h("td.num", {}, fmtBytes(v)))),
        h("tr", {}, h("th", { scope: "row" }, "total"), h("td.num", {}, h("strong", {}, fmtBytes(mem.total_bytes)))),
        mem.param_count ? h("tr", {}, h("th", { scope: "row" }, "parameters"),
          h("td.num", {}, Number(mem.param_count).toLocaleString("en-US"))) : null,
        mem.local_tokens ? h("tr", {}, h("th", { scope: "row" }, "tokens per rank"),
          h("td.num", {}, Number(mem.local_tokens).toLocaleString("en-US"))) : null)),
    mem.formula ? h("details", {}, h("summary", {}, "How this is estimated"), h("p.mono", {}, mem.formula)) : null);
}
