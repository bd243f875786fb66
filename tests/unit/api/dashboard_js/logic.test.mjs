// The dashboard's logic that needs no page: how values, ticks and axis ranges are written (units.js,
// util.js), how metric names sort and group (metrics.js), what a pipeline rank holds (ring.js), a
// job's shape and stage boundaries (stages.js), and the line a 422's field is on (submit.js).
// Known answers written by hand from each function's rule. Run by tests/unit/api/test_dashboard_js.py
// (`node --test`); RINGTRAIN_STATIC is a copy of api/static that node reads as ES modules.
import assert from "node:assert/strict";
import { test } from "node:test";

const STATIC = process.env.RINGTRAIN_STATIC;
const util = await import(`${STATIC}/js/util.js`);
const units = await import(`${STATIC}/js/units.js`);
const metrics = await import(`${STATIC}/js/metrics.js`);
const ring = await import(`${STATIC}/js/ring.js`);
const stages = await import(`${STATIC}/js/stages.js`);
const submit = await import(`${STATIC}/js/submit.js`);

test("units.js writes the CLI's known answers (tests/unit/api/test_cli_units.py KNOWN)", () => {
  const known = JSON.parse(process.env.RINGTRAIN_UNITS_KNOWN);
  assert.ok(known.length > 10);
  const shown = known.map(([unit, format, digits, v]) => units.unitOf({ unit, format, digits }).value(v));
  assert.deepEqual(shown, known.map((row) => row[4]));
});

test("numbers: plain, SI, binary bytes, seconds, and the dash and infinities", () => {
  assert.deepEqual(
    [0, 1e6, 0.0005, 1234.5, 3.14159, -0.25, NaN, null, Infinity, -Infinity].map((v) => util.fmtNum(v)),
    ["0", "1.00e+6", "5.00e-4", "1,235", "3.142", "-0.25", "—", "—", "∞", "−∞"]);
  assert.deepEqual([999, 1234, 1.5e6, -2500, 2e21].map(util.fmtSI), ["999", "1.23k", "1.5M", "-2.5k", "2.00e+21"]);
  // two decimals below ten of a unit, one from ten up
  assert.deepEqual([1023, 1024, 10 * 2 ** 20, 9.99 * 2 ** 20, -1536, 2.5 * 2 ** 40].map(util.fmtBytes),
    ["1023 B", "1 KiB", "10 MiB", "9.99 MiB", "-1.5 KiB", "2.5 TiB"]);
  assert.deepEqual([0.0123, 0.5, 1, 1.234, 65.4321].map(util.fmtSeconds), ["12.3 ms", "500 ms", "1 s", "1.23 s", "65.4 s"]);
});

test("age: seconds, minutes, hours, days; never negative; unix seconds or ISO text", () => {
  const now = Date.parse("2026-12-05T12:00:00Z");
  assert.deepEqual([
    util.age("2026-12-05T11:59:15Z", now), util.age("2026-12-05T10:58:30Z", now),
    util.age("2026-12-03T09:00:00Z", now), util.age(now / 1000 + 5, now), util.age((now - 125000) / 1000, now),
    util.age((now - 59999) / 1000, now), util.age((now - 3600000) / 1000, now),
  ], ["45s", "1h 1m", "2d 3h", "0s", "2m 5s", "1m 0s", "1h 0m"]);
});

test("names sort by the numbers in them", () => {
  const sorted = (xs) => [...xs].sort(metrics.naturalCompare);
  assert.deepEqual(sorted(["len=4096", "len=256", "len=1024"]), ["len=256", "len=1024", "len=4096"]);
  assert.deepEqual(sorted(["1024-2048", "0-64", "128-256", "64-128"]), ["0-64", "64-128", "128-256", "1024-2048"]);
  assert.deepEqual(sorted(["rank 10", "rank 2", "rank 1"]), ["rank 1", "rank 2", "rank 10"]);
  assert.deepEqual(sorted(["0.75", "0.5", "0.1"]), ["0.1", "0.5", "0.75"]);
  assert.deepEqual(sorted(["b", "a10", "a2", "10", "a"]), ["10", "a", "a2", "a10", "b"]);
  assert.deepEqual(["16384", "0.10", "0-64", 512].map(metrics.fieldText), ["16,384", "0.10", "0-64", "512"]);
});

test("a name the catalog lacks groups by its field=value parts", () => {
  assert.deepEqual(metrics.familyOf("probe/len=4096"), { pattern: "probe/len={len}", label: "len=4096" });
  assert.deepEqual(metrics.familyOf("probe/vt/len=8192"), { pattern: "probe/vt/len={len}", label: "len=8192" });
  assert.deepEqual(metrics.familyOf("a/x=1/y=2"), { pattern: "a/x={x}/y={y}", label: "x=1 y=2" });
  assert.equal(metrics.familyOf("loss"), null);
});

test("the catalog: an exact entry before a family, fields read from the name, its unit's writer", () => {
  const catalog = new metrics.Catalog({ groups: [], metrics: [
    { name: "ruler/{task}/len={len}", regex: "^ruler/([^/]+)/len=(\\d+)$", fields: ["task", "len"],
      unit: "fraction", format: "percent", digits: 3, view: "grid" },
    { name: "ruler/niah/len=8", regex: "^ruler/niah/len=8$", fields: [], unit: "", format: "num", digits: 4,
      view: "line", column: true },
    { name: "loss", regex: "^loss$", fields: [], unit: "nats/token", format: "fixed", digits: 4, view: "line" },
  ] });
  const family = catalog.lookup("ruler/vt/len=4096");
  assert.equal(family.metric.name, "ruler/{task}/len={len}");
  assert.deepEqual(family.fields, { task: "vt", len: "4096" });
  assert.equal(family.label, "task=vt len=4096");
  assert.equal(family.metric.fmt(0.8564), "85.6%");
  assert.equal(catalog.lookup("ruler/niah/len=8").metric.name, "ruler/niah/len=8");
  assert.equal(catalog.lookup("nope"), null);
  assert.equal(catalog.lookup("loss").metric.fmt(2.345678), "2.3457");
  assert.deepEqual(catalog.shownAs("line").map((m) => m.name), ["ruler/niah/len=8", "loss"]);
  assert.deepEqual(catalog.marked("column").map((m) => m.name), ["ruler/niah/len=8"]);
});

test("axis ranges: a fraction's whole 0-100%, a flat series around its value, never below 0 for sizes", () => {
  const frac = units.unitOf({ unit: "fraction", format: "percent", digits: 3 });
  const bytes = units.unitOf({ unit: "bytes", format: "bytes" });
  const plain = units.PLAIN;
  assert.deepEqual(frac.axisRange(0.2, 0.9), [0, 1]);
  assert.deepEqual(frac.axisRange(0, 1), [0, 1]);
  assert.deepEqual(frac.axisRange(0.5, 1.5), [0.4, 1.6]);
  assert.deepEqual(bytes.axisRange(0, 0), [0, 1024]);
  assert.deepEqual(bytes.axisRange(100, 300), [80, 320]);
  assert.deepEqual(bytes.axisRange(10, 1000), [0, 1100]);  // 10 - 99 clamped at 0, 1000 + 99 rounded up
  assert.deepEqual(plain.axisRange(0, 0), [-1, 1]);
  assert.deepEqual(plain.axisRange(5, 5), [4.5, 5.5]);
  assert.deepEqual(plain.axisRange(-5, -5), [-5.5, -4.5]);
  assert.deepEqual(plain.axisRange(10, 1000), [-100, 1100]);  // -89 and 1099 out to hundreds
  assert.deepEqual(plain.axisRange(null, 3), [0, 1]);
});

test("tick labels: one prefix per axis, as many decimals as the ticks need", () => {
  const u = (unit) => units.unitOf({ unit });
  assert.deepEqual(u("fraction").ticks([0, 0.25, 0.5]), ["0%", "25%", "50%"]);
  assert.deepEqual(u("bytes").ticks([0, 2 ** 29, 2 ** 30]), ["0.0 GiB", "0.5 GiB", "1.0 GiB"]);
  assert.deepEqual(u("bytes").ticks([0, 512 * 2 ** 20, 768 * 2 ** 20]), ["0 MiB", "512 MiB", "768 MiB"]);
  assert.deepEqual(u("bytes").ticks([0, 2 ** 29], 2 ** 30), ["0.0 GiB", "0.5 GiB"]);  // the axis's top decides
  assert.deepEqual(u("s").ticks([0, 0.25, 0.5]), ["0 ms", "250 ms", "500 ms"]);
  assert.deepEqual(u("s").ticks([0, 5, 10]), ["0 s", "5 s", "10 s"]);
  assert.deepEqual(u("s").ticks([0, 0.5, 1]), ["0.0 s", "0.5 s", "1.0 s"]);  // a second is not 1000 ms
  assert.deepEqual(u("tokens/s").ticks([0, 50000, 100000]), ["0k", "50k", "100k"]);
  assert.deepEqual(units.PLAIN.ticks([0, 1e6, 2e6]), ["0", "1e+6", "2e+6"]);
  assert.deepEqual(units.PLAIN.ticks([0, 5e5, 1e6]), ["0", "5e+5", "1e+6"]);  // from 1e6 up
  assert.deepEqual(units.PLAIN.ticks([0, 4e5, 8e5]), ["0", "400,000", "800,000"]);
  assert.deepEqual(units.PLAIN.ticks([1.5, 1.5001]), ["1.5000", "1.5001"]);
  assert.deepEqual(units.PLAIN.ticks([0, 0.0005, 0.001]), ["0.0000", "0.0005", "0.0010"]);
  assert.deepEqual(units.PLAIN.ticks([-1, 0, 1]), ["-1", "0", "1"]);
});

test("the step axis: whole steps, one step alone with a step either side; markers only where points stand apart", () => {
  assert.deepEqual(units.STEP_INCRS.slice(0, 7), [1, 2, 5, 10, 20, 50, 100]);
  assert.ok(units.STEP_INCRS.every(Number.isInteger));
  assert.deepEqual(units.stepRange({ data: [[5]] }, 0, 100), [4, 6]);
  assert.deepEqual(units.stepRange({ data: [[1, 9]] }, 1, 9), [1, 9]);
  assert.deepEqual(units.stepRange({ data: [[3, 3]] }, 3, 3), [2, 4]);  // two points of one step
  globalThis.devicePixelRatio = 1;
  const chart = (n, width) => ({ data: [[...Array(n).keys()], [...Array(n).keys()]], bbox: { width } });
  assert.equal(units.showMarkers(chart(10, 120), 1, 0, 9), true);  // 120 px / 12 = room for 10
  assert.equal(units.showMarkers(chart(11, 120), 1, 0, 10), false);
  assert.equal(units.showMarkers({ data: [[1, 2, 3], [1, null, 3]], bbox: { width: 24 } }, 1, 0, 2), true);
  assert.equal(units.showMarkers({ data: [[1], [null]], bbox: { width: 240 } }, 1, 0, 0), false);
});

test("pipeline ranks: stage s on rank s mod P, layers from the split or an even one", () => {
  assert.equal(ring.pipelineOf({ pipeline_size: 1 }, 8), null);
  assert.equal(ring.pipelineOf(undefined, 8), null);
  assert.deepEqual(ring.pipelineOf({ pipeline_size: 2 }, 8), { size: 2, virtual: 1, ranks: [
    { pp: 0, stages: [0], layers: [[0, 4]], count: 4 }, { pp: 1, stages: [1], layers: [[4, 8]], count: 4 }] });
  assert.deepEqual(ring.pipelineOf({ pipeline_size: 2, pipeline_schedule: "interleaved_1f1b" }, 8), {
    size: 2, virtual: 2, ranks: [
      { pp: 0, stages: [0, 2], layers: [[0, 2], [4, 6]], count: 4 },
      { pp: 1, stages: [1, 3], layers: [[2, 4], [6, 8]], count: 4 }] });
  // zero_bubble is looped too (ScheduleInterleavedZeroBubble): two stages a rank, s mod P
  assert.deepEqual(ring.pipelineOf({ pipeline_size: 2, pipeline_schedule: "zero_bubble" }, 8).ranks.map((r) => r.stages),
    [[0, 2], [1, 3]]);
  assert.deepEqual(ring.pipelineOf({ pipeline_size: 3, pipeline_split: [1, 3, 2] }, 6).ranks.map((r) => r.layers),
    [[[0, 1]], [[1, 4]], [[4, 6]]]);
  assert.deepEqual(ring.pipelineOf({ pipeline_size: 2 }, 7).ranks.map((r) => [r.layers, r.count]),
    [[null, null], [null, null]]);
  assert.deepEqual([ring.shortNode("0123456789abcdef0123"), ring.shortNode("abcdefghijklmn"), ring.shortNode("node-a")],
    ["012345…0123", "abcdefghijklmn", "node-a"]);
});

test("a job's shape and its stage boundaries", () => {
  assert.equal(stages.shapeOf({ ring_size: 2, layout: "zigzag" }), "dp 1 × ring 2 × ulysses 1 × tensor 1 (zigzag)");
  assert.equal(stages.shapeOf({ pipeline_size: 2, data_parallel: 2, ring_size: 4, ulysses_size: 2, tensor_size: 3 }),
    "pp 2 (1f1b) × dp 2 × ring 4 × ulysses 2 × tensor 3");
  assert.equal(stages.shapeOf(), "dp 1 × ring ? × ulysses 1 × tensor 1");
  const job = { stages: [{ start_step: 0, name: "a" }, { start_step: 4, name: "b" }, { start_step: 8, name: "c" }] };
  assert.deepEqual(stages.stageMarks(job), [{ step: 4, label: "b" }, { step: 8, label: "c" }]);
  assert.deepEqual(stages.stageMarks({}), []);
});

test("the line a 422's field is written on: YAML block and flow, lists, comments, JSON", () => {
  const yaml = [
    "name: x", "model: {d_model: 32, n_heads: 4}", "data:", "  kind: passkey",
    "  seq_len: 16   # comment seq_len: 3", "parallel: {ring_size: 2}", "stages:", "  - steps: 2",
    "    data: {seq_len: 64}", "# train: {lr: 1}",
  ].join("\n");
  const line = (field, text = yaml) => submit.findFieldLine(text, field);
  assert.deepEqual(
    ["data.seq_len", "model.n_heads", "parallel.ring_size", "stages.0.data.seq_len", "train.lr", "", "name"].map((f) => line(f)),
    [4, 1, 5, 8, -1, -1, 0]);
  assert.equal(line("data.seq_len", '{"data": {"kind": "passkey",\n "seq_len": 16}}'), 1);
  assert.equal(line("parallel.ring_size", "parallel:\n  ring_size_x: 1\n  ring_size: 2\n"), 2);
});
