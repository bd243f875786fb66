// The job page's "Model" panel: the exported model's files (GET /v1/jobs/{id}/artifacts) with signed download
// links (a plain <a href> cannot send the bearer token; the listing, owner-only, hands out per-file links), and
// ready-to-paste commands: `ringtrain pull` (checksums verified) and transformers' from_pretrained.
import { api, ApiError } from "./api.js";
import { fmtBytes, h, TERMINAL } from "./util.js";

export function mountArtifacts(box, jobId, signal) {
  let loaded = false;

  function copyButton(text) {
    const b = h("button.ghost.copy", { type: "button" }, "Copy");
    b.addEventListener("click", async () => {
      try { await navigator.clipboard.writeText(text); b.textContent = "Copied"; } catch { b.textContent = "Select and copy"; }
    });
    return b;
  }

  function snippet(id, text) {
    return h("div.snippet", {}, h("pre", { id, tabindex: 0 }, h("code", {}, text)), copyButton(text));
  }

  function render(list, jobName) {
    const dest = `./${(jobName || jobId).replace(/[^A-Za-z0-9_.-]+/g, "-")}-model`;
    const rows = list.files.map((f) => h("tr", { dataset: { file: f.name } },
      h("td.mono", {}, h("a", { href: f.url, download: f.name.split("/").pop() }, f.name)),
      h("td.num", {}, fmtBytes(f.size)),
      h("td.mono.sha", { title: f.sha256 }, f.sha256.slice(0, 16), "…")));
    box.replaceChildren(
      h("p.muted", {}, `${list.files.length} files, ${fmtBytes(list.total_bytes)}; on the cluster at `,
        h("code", {}, list.model_path), ". Download links expire after an hour (reload for new ones)."),
      h("table#artifacts-table", {},
        h("caption.sr-only", {}, "Files of the exported model"),
        h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "File"), h("th.num", { scope: "col" }, "Size"),
          h("th", { scope: "col" }, "SHA-256"))),
        h("tbody", {}, rows)),
      h("h3", {}, "Use it"),
      snippet("pull-snippet", `ringtrain pull ${jobId} ${dest}   # every file checked against its SHA-256`),
      snippet("hf-snippet", [
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        `model = AutoModelForCausalLM.from_pretrained("${dest}")`,
        `tokenizer = AutoTokenizer.from_pretrained("${dest}")`,
      ].join("\n")));
  }

  /** (Re)load the listing; `job` is the current job JSON. Quiet until the model exists. */
  async function refresh(job) {
    if (loaded) return;
    if (job?.state !== "SUCCEEDED") {  // only a job that succeeded exports its model: nothing to ask for yet
      box.replaceChildren(h("p.muted#artifacts-empty", {}, job && TERMINAL.has(job.state)
        ? `This job ended ${job.state}: no model was exported.`
        : "The trained model is exported here when the job succeeds."));
      return;
    }
    try {
      const list = await api(`/v1/jobs/${encodeURIComponent(jobId)}/artifacts`, { signal });
      loaded = true;
      render(list, job?.name);
    } catch (e) {
      if (e.name === "AbortError") return;
      const why = e instanceof ApiError && e.code === "no_artifacts"
        ? "No exported model was found for this job (the checkpoint directory is not visible to the server?)."
        : `Could not list the model's files: ${e.message}`;
      box.replaceChildren(h("p.muted#artifacts-empty", {}, why));
    }
  }

  box.replaceChildren(h("p.muted", {}, "Looking for the exported model…"));
  return { refresh };
}
