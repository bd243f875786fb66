// The ringtrain REST API from the browser: bearer token from sessionStorage, one error shape, SSE over fetch
// (EventSource cannot send an Authorization header).
//
// The token lives in sessionStorage: it is gone when the tab closes and never written to the profile on disk, so
// a token left in a shared or lost browser does not outlive the session. (Script on the page could read it from
// either storage; the strict Content-Security-Policy, no inline script and no third-party origin, is what keeps
// such script out.) A token an older dashboard kept in localStorage is moved over once and erased there.

const KEY = "ringtrain.token";
const listeners = new Set();

function migrate() {
  const old = localStorage.getItem(KEY);
  if (old === null) return;
  if (!sessionStorage.getItem(KEY)) sessionStorage.setItem(KEY, old);
  localStorage.removeItem(KEY);
}

export const token = {
  get: () => { migrate(); return sessionStorage.getItem(KEY) || ""; },
  set: (t) => { localStorage.removeItem(KEY); sessionStorage.setItem(KEY, t.trim()); },
  clear: () => { localStorage.removeItem(KEY); sessionStorage.removeItem(KEY); },
};

/** Called with the ApiError whenever the server answers 401 (missing or wrong token). */
export function onUnauthorized(fn) { listeners.add(fn); return () => listeners.delete(fn); }

export class ApiError extends Error {
  constructor(status, body) {
    const e = (body && body.error) || {};
    super(e.message || `HTTP ${status}`);
    this.status = status;
    this.code = e.code || "error";
    this.field = e.field || null;
    this.details = e.details || [];
    this.body = body;
  }
}

function headers(extra = {}) {
  const h = { Accept: "application/json", ...extra };
  const t = token.get();
  if (t) h.Authorization = `Bearer ${t}`;
  return h;
}

async function fail(res) {
  let body = null;
  try { body = await res.json(); } catch { body = { error: { message: `${res.status} ${res.statusText}` } }; }
  const err = new ApiError(res.status, body);
  if (res.status === 401) for (const fn of listeners) fn(err);
  return err;
}

export async function api(path, { method = "GET", body, contentType = "application/json", signal } = {}) {
  const init = { method, headers: headers(), signal };
  if (body !== undefined) {
    init.headers["Content-Type"] = contentType;
    init.body = typeof body === "string" ? body : JSON.stringify(body);
  }
  let res;
  try {
    res = await fetch(path, init);
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError(0, { error: { code: "network", message: `cannot reach the server (${e.message})` } });
  }
  if (!res.ok) throw await fail(res);
  if (res.status === 204) return null;
  return res.json();
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/**
 * Follow /v1/jobs/{id}/events from `after`. handlers: {state, metric, log, end, status(text, cls)}.
 * Reconnects with ?after=<last id> (the server replays what was missed, no gaps, no repeats).
 * Returns a stop() function.
 */
export function followEvents(jobId, after, handlers) {
  let last = after;
  let stopped = false;
  let ctrl = null;
  let retry = 2000;
  const status = handlers.status || (() => {});

  function dispatch(block) {
    let event = "message", data = [], id = null;
    for (const line of block.split("\n")) {
      if (!line || line.startsWith(":")) continue;
      const i = line.indexOf(":");
      const field = i < 0 ? line : line.slice(0, i);
      let value = i < 0 ? "" : line.slice(i + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "event") event = value;
      else if (field === "data") data.push(value);
      else if (field === "id") id = value;
      else if (field === "retry" && /^\d+$/.test(value)) retry = Number(value);
    }
    if (!data.length) return false;
    if (id !== null && /^\d+$/.test(id)) last = Math.max(last, Number(id));
    const payload = JSON.parse(data.join("\n"));
    const fn = handlers[event];
    if (fn) fn(payload);
    return event === "end";
  }

  (async () => {
    while (!stopped) {
      ctrl = new AbortController();
      try {
        const res = await fetch(`/v1/jobs/${encodeURIComponent(jobId)}/events?after=${last}`,
          { headers: headers({ Accept: "text/event-stream" }), signal: ctrl.signal, cache: "no-store" });
        if (!res.ok) {
          const err = await fail(res);
          if (res.status === 401 || res.status === 404) { status(err.message, "off"); return; }
          throw err;
        }
        status("live", "on");
        const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
        let buf = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += value;
          // normalise line ends; keep a trailing \r until we know whether \n follows
          const keep = buf.endsWith("\r") ? "\r" : "";
          buf = buf.slice(0, buf.length - keep.length).replace(/\r\n?/g, "\n");
          let idx;
          while ((idx = buf.indexOf("\n\n")) >= 0) {
            const block = buf.slice(0, idx);
            buf = buf.slice(idx + 2);
            if (dispatch(block)) { stopped = true; status("finished", "off"); ctrl.abort(); return; }
          }
          buf += keep;
        }
      } catch (e) {
        if (stopped || e.name === "AbortError") return;
      }
      if (stopped) return;
      status("reconnecting…", "retry");
      await sleep(retry);
    }
  })();

  return () => { stopped = true; if (ctrl) ctrl.abort(); };
}
