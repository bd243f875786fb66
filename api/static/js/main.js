// Entry point: the token prompt, the banner and a tiny hash router (#/jobs, #/jobs/<id>, #/submit).
import { onUnauthorized, token } from "./api.js";
import { mountJob } from "./job.js";
import { mountJobs } from "./jobs.js";
import { mountSubmit } from "./submit.js";
import { mountCompare } from "./compare.js";
import { mountDatasets } from "./datasets.js";
import { mountEvals } from "./evals.js";

const main = document.getElementById("main");
const banner = document.getElementById("banner");
const dialog = document.getElementById("token-dialog");
const input = document.getElementById("token-input");
const tokenError = document.getElementById("token-error");
let unmount = null;
let lastRoute = "";

export function showBanner(text) {
  banner.replaceChildren(text);
  if (text) {
    const b = document.createElement("button");
    b.type = "button"; b.className = "ghost"; b.textContent = "Dismiss";
    b.addEventListener("click", () => { banner.hidden = true; });
    banner.append(b);
  }
  banner.hidden = !text;
}

function askToken(message) {
  tokenError.hidden = !message;
  tokenError.textContent = message || "";
  input.value = "";
  if (!dialog.open) dialog.showModal();
  input.focus();
}

dialog.addEventListener("close", () => {
  if (dialog.returnValue === "save" && input.value.trim()) {
    token.set(input.value);
    showBanner("");
    route(true);
  }
  dialog.returnValue = "";
});
document.getElementById("token-forget").addEventListener("click", () => {
  token.clear();
  input.value = "";
  tokenError.hidden = false;
  tokenError.textContent = "Token forgotten. Enter a token to use the dashboard.";
});
document.getElementById("token-button").addEventListener("click", () => askToken(""));

onUnauthorized((err) => {
  const msg = token.get()
    ? `The server rejected this API token (401: ${err.message}). Enter a valid token.`
    : `An API token is needed (401: ${err.message}).`;
  showBanner(msg);
  askToken(msg);
});

function parseHash() {
  const raw = location.hash.replace(/^#\/?/, "") || "jobs";
  const [path, query = ""] = raw.split("?");
  return { parts: path.split("/").filter(Boolean).map(decodeURIComponent), query: new URLSearchParams(query) };
}

function route(force = false) {
  const key = location.hash;
  if (!force && key === lastRoute) return;
  lastRoute = key;
  const { parts, query } = parseHash();
  if (unmount) { try { unmount(); } catch (e) { console.warn(e); } unmount = null; }
  main.replaceChildren();
  let nav = "jobs";
  if (!token.get()) {
    main.append(Object.assign(document.createElement("p"), {
      className: "muted", textContent: "Enter your API token to see your jobs." }));
    askToken("");
    return;
  }
  if (parts[0] === "jobs" && parts[1]) unmount = mountJob(main, parts[1]);
  else if (parts[0] === "submit") { nav = "submit"; unmount = mountSubmit(main); }
  else if (parts[0] === "compare") { nav = "compare"; unmount = mountCompare(main, query); }
  else if (parts[0] === "datasets") {
    nav = "datasets";
    const off = [mountDatasets(main), mountEvals(main)];
    unmount = () => off.forEach((f) => f());
  }
  else unmount = mountJobs(main, query);
  for (const a of document.querySelectorAll("header nav a")) {
    if (a.dataset.nav === nav) a.setAttribute("aria-current", "page"); else a.removeAttribute("aria-current");
  }
}

window.addEventListener("hashchange", () => route());
export function navigate(hash, { replace = false } = {}) {
  if (replace) { history.replaceState(null, "", hash); route(); } else location.hash = hash;
}
route(true);
