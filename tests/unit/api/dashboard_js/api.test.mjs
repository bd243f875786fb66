// The dashboard's REST and event-stream client (api.js) against a real HTTP server on loopback (node's
// http): the bearer token from sessionStorage (moved over from localStorage once), one error shape for
// every failure, and the job event stream read across awkward chunk boundaries, resumed after a drop from
// the last event id, stopped by `end` or a 401. Node has no page, so the browser's storage and its
// relative URLs are given here: a Map-backed Storage, and fetch resolving paths against the server.
import assert from "node:assert/strict";
import http from "node:http";
import { after, before, test as nodeTest } from "node:test";

// every test bounded: a client that never stops following fails its test instead of hanging the run
const test = (name, fn) => nodeTest(name, { timeout: 15000 }, fn);

class MemoryStorage {
  #m = new Map();
  getItem(k) { return this.#m.has(k) ? this.#m.get(k) : null; }
  setItem(k, v) { this.#m.set(k, String(v)); }
  removeItem(k) { this.#m.delete(k); }
}
globalThis.sessionStorage = new MemoryStorage();
globalThis.localStorage = new MemoryStorage();

const seen = [];  // every request: {method, url, auth, type, body}
let handler = null;  // (req, res, body) => void, set by each test
const server = http.createServer((req, res) => {
  let body = "";
  req.on("data", (c) => { body += c; });
  req.on("end", () => {
    seen.push({ method: req.method, url: req.url, auth: req.headers.authorization, type: req.headers["content-type"], body });
    handler(req, res, body);
  });
});
let base = "";
const realFetch = globalThis.fetch;
before(async () => {
  await new Promise((ok) => server.listen(0, "127.0.0.1", ok));
  base = `http://127.0.0.1:${server.address().port}`;
  globalThis.fetch = (path, init) => realFetch(new URL(path, base), init);
});
after(() => { server.closeAllConnections(); server.close(); });

const { api, ApiError, followEvents, onUnauthorized, token } = await import(`${process.env.RINGTRAIN_STATIC}/js/api.js`);
const json = (res, status, obj) => { res.writeHead(status, { "content-type": "application/json" }); res.end(JSON.stringify(obj)); };
const until = async (what, ms = 5000) => {
  const end = Date.now() + ms;
  while (!what()) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 10));
  }
};

test("the token: moved once from localStorage, sent as a bearer token, trimmed, cleared", async () => {
  localStorage.setItem("ringtrain.token", "old-token");
  assert.equal(token.get(), "old-token");
  assert.equal(localStorage.getItem("ringtrain.token"), null);
  assert.equal(sessionStorage.getItem("ringtrain.token"), "old-token");
  token.set("  tok-1 \n");
  handler = (req, res) => json(res, 200, { ok: true });
  assert.deepEqual(await api("/v1/jobs?limit=2"), { ok: true });
  assert.equal(seen.at(-1).auth, "Bearer tok-1");
  assert.equal(seen.at(-1).url, "/v1/jobs?limit=2");
  token.clear();
  await api("/v1/jobs");
  assert.equal(seen.at(-1).auth, undefined);
  // a token already in this tab wins over an older one left in localStorage, which is erased
  sessionStorage.setItem("ringtrain.token", "tab-token");
  localStorage.setItem("ringtrain.token", "stale-token");
  assert.equal(token.get(), "tab-token");
  assert.equal(localStorage.getItem("ringtrain.token"), null);
  token.set("tok-1");
});

test("a body is sent as JSON (or as given), a 204 gives null", async () => {
  handler = (req, res) => { res.writeHead(204); res.end(); };
  assert.equal(await api("/v1/jobs/j1/cancel", { method: "POST", body: { a: [1, 2] } }), null);
  assert.deepEqual([seen.at(-1).method, seen.at(-1).type, seen.at(-1).body], ["POST", "application/json", '{"a":[1,2]}']);
  await api("/v1/plan", { method: "POST", body: "name: x\n", contentType: "application/yaml" });
  assert.deepEqual([seen.at(-1).type, seen.at(-1).body], ["application/yaml", "name: x\n"]);
});

test("errors: the server's shape (code, field, message), a body that is not JSON, an unreachable server, 401 to the listeners", async () => {
  handler = (req, res) => json(res, 422, { error: { code: "invalid_spec", field: "data.seq_len",
    message: "data.seq_len: must be divisible by 4", details: [{ field: "data.seq_len" }] } });
  const e = await api("/v1/jobs", { method: "POST", body: {} }).catch((x) => x);
  assert.ok(e instanceof ApiError);
  assert.deepEqual([e.status, e.code, e.field, e.message, e.details.length],
    [422, "invalid_spec", "data.seq_len", "data.seq_len: must be divisible by 4", 1]);
  handler = (req, res) => { res.writeHead(502, "Bad Gateway"); res.end("<html>proxy</html>"); };
  const p = await api("/v1/jobs").catch((x) => x);
  assert.deepEqual([p.status, p.code, p.field, p.message], [502, "error", null, "502 Bad Gateway"]);
  const told = [];
  const off = onUnauthorized((err) => told.push([err.status, err.code]));
  handler = (req, res) => json(res, 401, { error: { code: "unauthorized", message: "missing or invalid token" } });
  const u = await api("/v1/jobs").catch((x) => x);
  assert.equal(u.status, 401);
  assert.deepEqual(told, [[401, "unauthorized"]]);
  off();
  await api("/v1/jobs").catch(() => null);
  assert.equal(told.length, 1);  // unsubscribed
  const saved = globalThis.fetch;
  globalThis.fetch = (path, init) => realFetch(new URL(path, "http://127.0.0.1:1"), init);
  const n = await api("/v1/jobs").catch((x) => x);
  globalThis.fetch = saved;
  assert.deepEqual([n.status, n.code], [0, "network"]);
  assert.match(n.message, /cannot reach the server/);
});

test("events: split frames, CRLF, comments, multi-line data; resumed after a drop from the last id; ended by `end`", async () => {
  const got = [];
  const statuses = [];
  let connections = 0;
  handler = (req, res) => {
    connections += 1;
    res.writeHead(200, { "content-type": "text/event-stream" });
    if (connections === 1) {
      // chunks split inside a field, between \r and \n, and inside the JSON
      const chunks = ["retry: 20\n\n: keep-alive\n\nid: 5\r\nevent: met", "ric\r", "\ndata: {\"step\": 1,", " \"value\": 2.5}\r\n\r\n",
        "id: 7\nevent: state\ndata: {\"state\":\n", "data: \"RUNNING\"}\n\n", "id: 6\nevent: metric\ndata: {\"step\": 0}\n\n"];
      let i = 0;
      const next = () => {
        if (i < chunks.length) { res.write(chunks[i++]); setTimeout(next, 5); } else res.destroy();  // dropped
      };
      next();
    } else {
      res.write("id: 8\nevent: metric\ndata: {\"step\": 2}\n\nevent: end\ndata: {}\n\n");
    }
  };
  const stop = followEvents("job/1", 3, {
    metric: (p) => got.push(["metric", p]), state: (p) => got.push(["state", p]),
    end: () => got.push(["end"]), status: (text, cls) => statuses.push([text, cls]),
  });
  try {
    await until(() => got.some((g) => g[0] === "end"));
  } finally {
    stop();
  }
  const urls = seen.filter((s) => s.url.includes("/events")).map((s) => [s.url, s.auth]);
  assert.deepEqual(urls, [["/v1/jobs/job%2F1/events?after=3", "Bearer tok-1"], ["/v1/jobs/job%2F1/events?after=7", "Bearer tok-1"]]);
  assert.deepEqual(got, [["metric", { step: 1, value: 2.5 }], ["state", { state: "RUNNING" }], ["metric", { step: 0 }],
    ["metric", { step: 2 }], ["end"]]);
  assert.deepEqual(statuses, [["live", "on"], ["reconnecting…", "retry"], ["live", "on"], ["finished", "off"]]);
  await new Promise((r) => setTimeout(r, 100));
  assert.equal(connections, 2);  // `end` stops it: no third connection
});

test("events: a 401 or 404 stops following and says why", async () => {
  let connections = 0;
  handler = (req, res) => { connections += 1; json(res, 404, { error: { code: "not_found", message: "no job j9" } }); };
  const statuses = [];
  const stop = followEvents("j9", 0, { status: (text, cls) => statuses.push([text, cls]) });
  try {
    await until(() => statuses.length > 0);
    await new Promise((r) => setTimeout(r, 100));
    assert.deepEqual(statuses, [["no job j9", "off"]]);
    assert.equal(connections, 1);
  } finally {
    stop();
  }
});

test("events: stop() ends a live stream and no reconnect follows", async () => {
  let connections = 0;
  let dropped = false;  // the client closed the stream before the server would have ended it
  handler = (req, res) => {
    connections += 1;
    res.writeHead(200, { "content-type": "text/event-stream" });
    res.write("retry: 200\nid: 1\nevent: metric\ndata: {\"step\": 1}\n\n");
    const end = setTimeout(() => res.end(), 300);  // a client still following reconnects 200 ms later
    res.on("close", () => { if (!res.writableEnded) dropped = true; clearTimeout(end); });
  };
  const got = [];
  const stop = followEvents("j2", 0, { metric: (p) => got.push(p) });
  try {
    await until(() => got.length === 1);
  } finally {
    stop();
  }
  await new Promise((r) => setTimeout(r, 800));
  assert.deepEqual([connections, dropped], [1, true]);
});

test("events: the server's `retry` sets the wait before a reconnect (here 3.5 s, longer than the 2 s default)", async () => {
  let connections = 0;
  handler = (req, res) => {
    connections += 1;
    res.writeHead(200, { "content-type": "text/event-stream" });
    res.end("retry: 3500\nid: 1\nevent: metric\ndata: {\"step\": 1}\n\n");  // then the stream ends
  };
  const statuses = [];
  const stop = followEvents("j3", 0, { status: (text) => statuses.push(text) });
  try {
    await until(() => statuses.includes("reconnecting…"));
    await new Promise((r) => setTimeout(r, 2300));
    assert.equal(connections, 1);  // the default would have reconnected by now
  } finally {
    stop();
  }
});
