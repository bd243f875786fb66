"""Bad input against a real server: every hostile or broken job spec gets a 4xx naming the problem, nothing is
reserved (no launcher call, no job row), and the server stays healthy.

Each table row is one request; its single assertion compares (status, error code, field, "message names the
problem", launcher calls, jobs listed, job rows in the store, /healthz status) with what it must be. Every
spec row runs on both routes that parse a spec: `POST /v1/jobs` and `POST /v1/plan`. The driver's report
route has its own table (a job must exist for it), and the CLI is run on a YAML bomb as a real process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from api.cli import main
from tests.support.api_harness import ALICE, TINY_SPEC, Driver, Server, running
from workers.config import load_spec

ROOT = Path(__file__).resolve().parents[3]
J = "application/json"
Y = "application/yaml"
BASE_YAML = "name: bad\nmodel: {d_model: 32, n_layers: 1, n_heads: 2}\ndata: {kind: passkey, seq_len: 128}\n"
BILLION_LAUGHS = (
    "".join(
        [f"l0: &l0 [{', '.join(['lol'] * 9)}]\n"]
        + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 10)]
    )
    + "name: boom\n"
)
MERGE_BOMB = "base: &b {d_model: 32, n_layers: 1, n_heads: 2}\nname: merge\nmodel: {<<: *b}\n"


@dataclass(frozen=True)
class Case:
    """One bad request: the body, its content type, and the (status, code, field, message needle) it must get."""

    id: str
    body: bytes | None
    ctype: str
    status: int
    code: str
    field: str | None
    needle: str


def spec(**over: Any) -> bytes:
    """TINY_SPEC with top-level sections replaced (JSON)."""
    return json.dumps({**TINY_SPEC, **over}).encode()


def raw(**sections: str) -> bytes:
    """TINY_SPEC with sections given as raw JSON text: for NaN/Infinity literals and integers beyond float."""
    parts = [f'"{k}": {json.dumps(v)}' for k, v in TINY_SPEC.items() if k not in sections]
    parts += [f'"{k}": {v}' for k, v in sections.items()]
    return ("{" + ", ".join(parts) + "}").encode()


def yml(extra: str) -> bytes:
    return (BASE_YAML + extra).encode()


def with_name(name: str) -> bytes:
    return spec(name=name)


def text_data(path: str, **kw: Any) -> bytes:
    return spec(data={"kind": "text", "seq_len": 128, "path": path, **kw})


DEEP = 10_000
MODEL = '{"d_model": 32, "n_layers": 1, "n_heads": 2}'

SPEC_CASES = [
    # ---- huge numbers ------------------------------------------------------------------------------
    Case(
        "steps-1e308",
        raw(train='{"steps": 1e308}'),
        J,
        422,
        "validation_error",
        "train.steps",
        "train.steps",
    ),
    Case(
        "steps-2^70",
        raw(train=f'{{"steps": {2**70}}}'),
        J,
        422,
        "validation_error",
        "train.steps",
        "less than",
    ),
    Case(
        "seed-2^70",
        raw(train=f'{{"seed": {2**70}}}'),
        J,
        422,
        "validation_error",
        "train.seed",
        "train.seed",
    ),
    Case(
        "lr-1e308", raw(train='{"lr": 1e308}'), J, 422, "validation_error", "train.lr", "train.lr"
    ),
    Case(
        "seq_len-2^70",
        raw(data=f'{{"kind": "passkey", "seq_len": {2**70}}}'),
        J,
        422,
        "validation_error",
        "data.seq_len",
        "data.seq_len",
    ),
    Case(
        "ffn_mult-1e308",
        raw(model='{"d_model": 32, "n_heads": 2, "ffn_mult": 1e308}'),
        J,
        422,
        "validation_error",
        "model.ffn_mult",
        "model.ffn_mult",
    ),
    Case(
        "context_lengths-2^70",
        raw(eval=f'{{"context_lengths": [{2**70}]}}'),
        J,
        422,
        "validation_error",
        "eval.context_lengths.0",
        "eval.context_lengths.0",
    ),
    Case(
        "cpus-1e-320",
        raw(resources='{"cpus_per_worker": 1e-320}'),
        J,
        422,
        "validation_error",
        "resources.cpus_per_worker",
        "0.0001",
    ),  # was a 500: the planner divided by it (OverflowError)
    Case(
        "json-int-5000-digits",
        raw(train='{"steps": ' + "9" * 5000 + "}"),
        J,
        400,
        "malformed_json",
        None,
        "4300 digits",
    ),
    Case(
        "yaml-int-5000-digits",
        yml("train: {steps: " + "9" * 5000 + "}\n"),
        Y,
        422,
        "validation_error",
        None,
        "4300 digits",
    ),
    Case(
        "yaml-steps-1e308",
        yml("train: {steps: 1.0e+308}\n"),
        Y,
        422,
        "validation_error",
        "train.steps",
        "train.steps",
    ),
    # ---- negative and zero sizes -------------------------------------------------------------------
    Case(
        "seq_len-0",
        spec(data={"kind": "passkey", "seq_len": 0}),
        J,
        422,
        "validation_error",
        "data.seq_len",
        "greater than",
    ),
    Case(
        "seq_len-neg",
        spec(data={"kind": "passkey", "seq_len": -128}),
        J,
        422,
        "validation_error",
        "data.seq_len",
        "data.seq_len",
    ),
    Case(
        "d_model-0",
        spec(model={"d_model": 0, "n_heads": 2}),
        J,
        422,
        "validation_error",
        "model.d_model",
        "model.d_model",
    ),
    Case(
        "n_layers-neg",
        spec(model={"d_model": 32, "n_heads": 2, "n_layers": -1}),
        J,
        422,
        "validation_error",
        "model.n_layers",
        "model.n_layers",
    ),
    Case(
        "n_heads-0",
        spec(model={"d_model": 32, "n_heads": 0}),
        J,
        422,
        "validation_error",
        "model.n_heads",
        "model.n_heads",
    ),
    Case(
        "batch_size-0",
        spec(train={"batch_size": 0}),
        J,
        422,
        "validation_error",
        "train.batch_size",
        "train.batch_size",
    ),
    Case(
        "steps-neg",
        spec(train={"steps": -5}),
        J,
        422,
        "validation_error",
        "train.steps",
        "train.steps",
    ),
    Case(
        "ring_size-0",
        spec(parallel={"ring_size": 0}),
        J,
        422,
        "validation_error",
        "parallel.ring_size",
        "parallel.ring_size",
    ),
    Case(
        "data_parallel-neg",
        spec(parallel={"ring_size": 2, "data_parallel": -2}),
        J,
        422,
        "validation_error",
        "parallel.data_parallel",
        "parallel.data_parallel",
    ),
    Case(
        "keep-0",
        spec(checkpoint={"keep": 0}),
        J,
        422,
        "validation_error",
        "checkpoint.keep",
        "checkpoint.keep",
    ),
    Case(
        "max_restarts-neg",
        spec(max_restarts=-1),
        J,
        422,
        "validation_error",
        "max_restarts",
        "max_restarts",
    ),
    Case(
        "cpus-0",
        spec(resources={"cpus_per_worker": 0}),
        J,
        422,
        "validation_error",
        "resources.cpus_per_worker",
        "resources.cpus_per_worker",
    ),
    Case(
        "eval-samples-0",
        spec(eval={"samples": 0}),
        J,
        422,
        "validation_error",
        "eval.samples",
        "eval.samples",
    ),
    # ---- NaN / inf: JSON literals and YAML .nan/.inf -------------------------------------------------
    Case("lr-NaN", raw(train='{"lr": NaN}'), J, 422, "validation_error", "train.lr", "finite"),
    Case(
        "lr-Infinity",
        raw(train='{"lr": Infinity}'),
        J,
        422,
        "validation_error",
        "train.lr",
        "finite",
    ),
    Case(
        "lr--Infinity",
        raw(train='{"lr": -Infinity}'),
        J,
        422,
        "validation_error",
        "train.lr",
        "finite",
    ),
    Case(
        "steps-NaN",
        raw(train='{"steps": NaN}'),
        J,
        422,
        "validation_error",
        "train.steps",
        "finite",
    ),
    Case(
        "depths-NaN",
        raw(eval='{"depths": [0.5, NaN]}'),
        J,
        422,
        "validation_error",
        "eval.depths.1",
        "finite",
    ),
    Case(
        "depth-Infinity",
        raw(data='{"kind": "passkey", "seq_len": 128, "depth": Infinity}'),
        J,
        422,
        "validation_error",
        "data.depth",
        "finite",
    ),
    Case(
        "ffn_mult--Infinity",
        raw(model='{"d_model": 32, "n_heads": 2, "ffn_mult": -Infinity}'),
        J,
        422,
        "validation_error",
        "model.ffn_mult",
        "finite",
    ),
    Case(
        "grad_clip-NaN",
        raw(train='{"grad_clip": NaN}'),
        J,
        422,
        "validation_error",
        "train.grad_clip",
        "finite",
    ),
    Case(
        "yaml-lr-.nan", yml("train: {lr: .nan}\n"), Y, 422, "validation_error", "train.lr", "finite"
    ),
    Case(
        "yaml-lr-.inf", yml("train: {lr: .inf}\n"), Y, 422, "validation_error", "train.lr", "finite"
    ),
    Case(
        "yaml-steps--.inf",
        yml("train: {steps: -.inf}\n"),
        Y,
        422,
        "validation_error",
        "train.steps",
        "finite",
    ),
    Case(
        "yaml-depth-.NaN",
        yml("eval: {depths: [.NaN]}\n"),
        Y,
        422,
        "validation_error",
        "eval.depths.0",
        "finite",
    ),
    # ---- wrong types -------------------------------------------------------------------------------
    Case("name-int", spec(name=123), J, 422, "validation_error", "name", "valid string"),
    Case("name-null", spec(name=None), J, 422, "validation_error", "name", "valid string"),
    Case("model-str", spec(model="big"), J, 422, "validation_error", "model", "model"),
    Case("data-list", spec(data=[]), J, 422, "validation_error", "data", "data"),
    Case("data-no-kind", spec(data={}), J, 422, "validation_error", "data", "kind"),
    Case("data-kind-int", spec(data={"kind": 5}), J, 422, "validation_error", "data", "kind"),
    Case(
        "layout-unknown",
        spec(parallel={"layout": "spiral"}),
        J,
        422,
        "validation_error",
        "parallel.layout",
        "zigzag",
    ),
    Case(
        "steps-fraction",
        spec(train={"steps": 5.5}),
        J,
        422,
        "validation_error",
        "train.steps",
        "fractional",
    ),
    Case(
        "steps-word",
        spec(train={"steps": "ten"}),
        J,
        422,
        "validation_error",
        "train.steps",
        "integer",
    ),
    Case(
        "steps-bool",
        spec(train={"steps": True}),
        J,
        422,
        "validation_error",
        "train.steps",
        "integer",
    ),
    Case(
        "steps-numeric-text",
        spec(train={"steps": "10"}),
        J,
        422,
        "validation_error",
        "train.steps",
        "integer",
    ),
    Case(
        "yaml-duplicate-key",
        yml("name: again\n"),
        Y,
        400,
        "malformed_yaml",
        None,
        "duplicate key 'name'",
    ),
    Case(
        "accelerator-tpu",
        spec(resources={"accelerator": "tpu"}),
        J,
        422,
        "validation_error",
        "resources.accelerator",
        "gpu",
    ),
    Case(
        "depths-str",
        spec(eval={"depths": "0.5"}),
        J,
        422,
        "validation_error",
        "eval.depths",
        "list",
    ),
    Case("top-string", b'"a job"', J, 422, "validation_error", None, "JSON object"),
    Case("top-null", b"null", J, 422, "validation_error", None, "JSON object"),
    Case("yaml-top-list", b"- 1\n- 2\n", Y, 422, "validation_error", None, "mapping"),
    Case("yaml-empty", b"", Y, 422, "validation_error", None, "mapping"),
    Case(
        "yaml-name-timestamp",
        b"name: 2020-01-01\n",
        Y,
        422,
        "validation_error",
        "name",
        "valid string",
    ),
    Case(
        "yaml-name-set", b"name: !!set {a, b}\n", Y, 422, "validation_error", "name", "valid string"
    ),
    Case("yaml-int-key", yml("1: 2\n"), Y, 422, "validation_error", "1", "Keys should be strings"),
    Case(
        "yaml-python-tag",
        b"name: !!python/object/apply:os.system ['true']\n",
        Y,
        400,
        "malformed_yaml",
        None,
        "constructor",
    ),
    Case("not-utf8", "name: x".encode("utf-16"), Y, 400, "malformed_body", None, "UTF-8"),
    Case(
        "form-encoded",
        b"name=x",
        "application/x-www-form-urlencoded",
        415,
        "unsupported_media_type",
        None,
        "application/json",
    ),
    # ---- deep nesting: the parser must not crash or recurse forever ------------------------------------
    Case("json-10k-arrays", b"[" * DEEP + b"]" * DEEP, J, 400, "malformed_json", None, "recursion"),
    Case(
        "json-10k-objects",
        ('{"a":' * DEEP + "1" + "}" * DEEP).encode(),
        J,
        400,
        "malformed_json",
        None,
        "recursion",
    ),
    Case(
        "json-10k-in-field",
        raw(junk="[" * DEEP + "]" * DEEP),
        J,
        400,
        "malformed_json",
        None,
        "recursion",
    ),
    Case(
        "json-900-in-model",
        raw(model='{"x": ' + "[" * 900 + "]" * 900 + "}"),
        J,
        422,
        "validation_error",
        "model.x",
        "Extra inputs",
    ),
    Case(
        "yaml-10k-flow-seq",
        yml("junk: " + "[" * DEEP + "]" * DEEP + "\n"),
        Y,
        400,
        "malformed_yaml",
        None,
        "recursion",
    ),
    Case(
        "yaml-10k-flow-map",
        yml("junk: " + "{a: " * DEEP + "1" + "}" * DEEP + "\n"),
        Y,
        400,
        "malformed_yaml",
        None,
        "recursion",
    ),
    # ---- 10 MB bodies --------------------------------------------------------------------------------
    Case("json-10MB", spec(pad="x" * (10 << 20)), J, 413, "payload_too_large", None, "byte limit"),
    Case(
        "yaml-10MB",
        yml("pad: " + "x" * (10 << 20) + "\n"),
        Y,
        413,
        "payload_too_large",
        None,
        "byte limit",
    ),
    Case(
        "chunked-10MB", None, J, 413, "payload_too_large", None, "byte limit"
    ),  # streamed, no Content-Length
    # ---- names: control characters rejected (printable unicode is accepted: see the test below) ------------
    Case("name-empty", with_name(""), J, 422, "validation_error", "name", "at least 1"),
    Case("name-blank", with_name("   "), J, 422, "validation_error", "name", "printable"),
    Case("name-NUL", with_name("a\x00b"), J, 422, "validation_error", "name", "printable"),
    Case("name-newline", with_name("a\nb"), J, 422, "validation_error", "name", "printable"),
    Case("name-ESC", with_name("\x1b[31mred"), J, 422, "validation_error", "name", "printable"),
    Case("name-DEL", with_name("a\x7fb"), J, 422, "validation_error", "name", "printable"),
    Case("name-C1-CSI", with_name("a\x9b31mb"), J, 422, "validation_error", "name", "printable"),
    Case(
        "name-bidi-override",
        with_name("job\u202eexe.txt"),
        J,
        422,
        "validation_error",
        "name",
        "printable",
    ),
    Case(
        "name-line-separator",
        with_name("a\u2028b"),
        J,
        422,
        "validation_error",
        "name",
        "printable",
    ),
    Case(
        "name-lone-surrogate", raw(name='"\\ud800"'), J, 422, "validation_error", "name", "unicode"
    ),
    Case("name-too-long", with_name("x" * 129), J, 422, "validation_error", "name", "at most 128"),
    # ---- YAML alias/anchor bombs ----------------------------------------------------------------------
    Case("yaml-billion-laughs", BILLION_LAUGHS.encode(), Y, 400, "malformed_yaml", None, "aliases"),
    Case("yaml-merge-key-alias", MERGE_BOMB.encode(), Y, 400, "malformed_yaml", None, "aliases"),
]

# data.path cases are built from the server's data root (see `data_root` below); "{root}" and "{out}" are
# replaced by the root and by a directory beside it (outside).
PATH_CASES = [
    ("dotdot-relative", "../../etc/passwd", "data.path", "outside the allowed data roots"),
    ("dotdot-from-root", "{root}/../../etc/passwd", "data.path", "outside the allowed data roots"),
    ("absolute", "/etc/passwd", "data.path", "outside the allowed data roots"),
    (
        "sibling-with-root-prefix",
        "{root}-evil/corpus.txt",
        "data.path",
        "outside the allowed data roots",
    ),
    ("symlink-file-out", "{root}/to-secret.txt", "data.path", "outside the allowed data roots"),
    (
        "symlink-dir-out",
        "{root}/to-outside/secret.txt",
        "data.path",
        "outside the allowed data roots",
    ),
    ("symlink-loop", "{root}/loop", "data.path", "cannot be resolved"),
    ("home", "~/.ssh/id_rsa", "data.path", "outside the allowed data roots"),
    (
        "unknown-user-home",
        "~no-such-user-xyz/corpus.txt",
        "data.path",
        "cannot be resolved",
    ),  # was a 500
    ("NUL-byte", "{root}/corpus.txt\x00.png", "data.path", "non-printable"),  # was a 500
    ("text_field-control", "{root}/corpus.txt", "data.text_field", "non-printable"),
]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("badinput")
    root = base / "root"
    outside = base / "outside"
    root.mkdir()
    outside.mkdir()
    (base / "root-evil").mkdir()
    (base / "root-evil" / "corpus.txt").write_text("not yours")
    (root / "corpus.txt").write_text("hello " * 100)
    (outside / "secret.txt").write_text("secret")
    os.symlink(outside / "secret.txt", root / "to-secret.txt")
    os.symlink(outside, root / "to-outside")
    os.symlink(root / "loop", root / "loop")
    return root


@pytest.fixture(scope="module")
def srv(data_root: Path) -> Iterator[Server]:
    with running(data_root.parent, data_roots=[str(data_root)]) as s:
        yield s


def outcome(srv: Server, r: Any) -> tuple:
    """What a refused request must leave behind, next to what it answered."""
    try:
        err = r.json()["error"]
    except (ValueError, KeyError):
        err = {"code": f"<not the error shape: {r.text[:200]!r}>", "field": None, "message": ""}
    with srv.client() as c:
        listed = c.get("/v1/jobs").json()["total"]
        health = c.get("/healthz").status_code
    stored = srv.app.state.ctx.store.jobs.page(None)[1]
    return (
        r.status_code,
        err["code"],
        err["field"],
        err["message"],
        len(srv.launcher.submits),
        listed,
        stored,
        health,
    )


def post(srv: Server, route: str, case: Case) -> Any:
    with srv.client(timeout=30) as c:
        if case.body is None:

            def chunks() -> Iterator[bytes]:
                for _ in range(160):
                    yield b" " * 65536

            return c.post(route, content=chunks(), headers={"Content-Type": case.ctype})
        return c.post(route, content=case.body, headers={"Content-Type": case.ctype})


@pytest.mark.parametrize("route", ["/v1/jobs", "/v1/plan"])
@pytest.mark.parametrize("case", SPEC_CASES, ids=[c.id for c in SPEC_CASES])
def test_bad_spec(srv: Server, route: str, case: Case) -> None:
    status, code, field, message, submits, listed, stored, health = outcome(
        srv, post(srv, route, case)
    )
    assert (status, code, field, case.needle in message, submits, listed, stored, health) == (
        case.status,
        case.code,
        case.field,
        True,
        0,
        0,
        0,
        200,
    ), message


@pytest.mark.parametrize("route", ["/v1/jobs", "/v1/plan"])
@pytest.mark.parametrize(
    ("name", "path", "field", "needle"), PATH_CASES, ids=[c[0] for c in PATH_CASES]
)
def test_data_path_outside_roots(
    srv: Server, data_root: Path, route: str, name: str, path: str, field: str, needle: str
) -> None:
    p = path.replace("{root}", str(data_root))
    body = text_data(p, text_field="te\x00xt") if field == "data.text_field" else text_data(p)
    status, code, got_field, message, submits, listed, stored, health = outcome(
        srv, post(srv, route, Case(name, body, J, 0, "", None, ""))
    )
    assert (status, code, got_field, needle in message, submits, listed, stored, health) == (
        422,
        "validation_error",
        field,
        True,
        0,
        0,
        0,
        200,
    ), message


@pytest.mark.parametrize("route", ["/v1/jobs", "/v1/plan"])
def test_a_held_out_dataset_outside_roots_is_refused(
    srv: Server, data_root: Path, route: str
) -> None:
    """`data.validation` as a path is read like `data.path`: inside the data roots or refused."""
    body = spec(
        data={"kind": "tokens", "seq_len": 128, "path": str(data_root), "validation": "/etc"}
    )
    status, code, got_field, message, submits, _listed, stored, health = outcome(
        srv, post(srv, route, Case("validation-out", body, J, 0, "", None, ""))
    )
    assert (status, code, got_field, submits, stored, health) == (
        422,
        "validation_error",
        "data.validation",
        0,
        0,
        200,
    ), message
    assert "outside the allowed data roots" in message


def test_printable_unicode_names_are_accepted(tmp_path: Path) -> None:
    """The other side of the name rule: any printable script, emoji included, is a valid name and round-trips."""
    names = ["训练-ジョブ", "🚀 long context", "naïve résumé", "العربية", "Ωμέγα-16k", "a b.c_d-e"]
    with running(tmp_path) as srv, srv.client() as c:
        got = [c.post("/v1/jobs", json={**TINY_SPEC, "name": n}).json().get("name") for n in names]
        listed = sorted(j["name"] for j in c.get("/v1/jobs").json()["jobs"])
    assert (got, listed) == (names, sorted(names))


# ---- the driver's report route ------------------------------------------------------------------------
REPORT_CASES = [
    # (id, items as raw JSON text with {seq} for the next sequence number, status, field)
    (
        "step-2^70",
        f'{{"type": "metric", "seq": {{seq}}, "step": {2**70}, "name": "loss", "value": 1, "time": 1}}',
        422,
        "items.0.metric.step",
    ),  # was a 500 (OverflowError in the SQLite driver)
    (
        "rank-2^70",
        f'{{"type": "metric", "seq": {{seq}}, "step": 1, "rank": {2**70}, "name": "l", "value": 1, "time": 1}}',
        422,
        "items.0.metric.rank",
    ),  # was a 500
    (
        "resume_step-2^70",
        f'{{"type": "state", "seq": {{seq}}, "state": "RETRYING", "time": 1, "resume_step": {2**70}}}',
        422,
        "items.0.state.resume_step",
    ),  # was a 500
    (
        "seq-2^70",
        f'{{"type": "log", "seq": {2**70}, "time": 1, "line": "x"}}',
        422,
        "items.0.log.seq",
    ),
    (
        "time-NaN",
        '{"type": "metric", "seq": {seq}, "step": 1, "name": "loss", "value": 1, "time": NaN}',
        422,
        "items.0.metric.time",
    ),  # was a 503 "store unavailable" (NOT NULL), so the driver retried forever
    (
        "time-Infinity",
        '{"type": "log", "seq": {seq}, "time": Infinity, "line": "x"}',
        422,
        "items.0.log.time",
    ),
    # ^ was stored, then every SSE stream of the job died on it (events are strict JSON)
    (
        "time-1e999",
        '{"type": "state", "seq": {seq}, "state": "RUNNING", "time": 1e999}',
        422,
        "items.0.state.time",
    ),
    (
        "placement-rank-2^70",
        f'{{"type": "state", "seq": {{seq}}, "state": "RUNNING", "time": 1, "placement": '
        f'[{{"rank": {2**70}, "node_id": "n", "device": "cpu"}}]}}',
        422,
        "items.0.state.placement.0.rank",
    ),
    (
        "step-negative",
        '{"type": "metric", "seq": {seq}, "step": -1, "name": "loss", "value": 1, "time": 1}',
        422,
        "items.0.metric.step",
    ),
    ("type-unknown", '{"type": "bogus", "seq": {seq}}', 422, "items.0"),
    ("deep-10k", "[" * DEEP + "]" * DEEP, 400, None),
]


def test_report_route_bad_input(tmp_path: Path) -> None:
    """Each bad batch is refused with a 4xx naming the item field; nothing is stored and streams keep working."""
    with running(tmp_path) as srv, srv.client() as c:
        job = c.post("/v1/jobs", json=TINY_SPEC).json()
        d = Driver(srv, job["id"])
        assert d.state("RUNNING", reason="placed").status_code == 200
        before = [e.seq for e in srv.app.state.ctx.store.metrics.events_after(job["id"], 0, 10000)]
        got, want = [], []
        for name, item, status, field in REPORT_CASES:
            text = item.replace("{seq}", str(d.seq + 1))
            body = text if name == "deep-10k" else '{"items": [' + text + "]}"
            r = d.http.post(
                f"/v1/jobs/{job['id']}/report", content=body, headers={"Content-Type": J}
            )
            err = r.json().get("error", {})
            got.append((name, r.status_code, err.get("field")))
            want.append((name, status, field))
        after = [e.seq for e in srv.app.state.ctx.store.metrics.events_after(job["id"], 0, 10000)]
        # the stream of the job still replays (a stored inf time used to break it), then a good batch applies
        with c.stream("GET", f"/v1/jobs/{job['id']}/events") as r:
            first = next(ln for ln in r.iter_lines() if ln.startswith("data:"))
        ok = d.metrics(range(3)).status_code
        health = c.get("/healthz").status_code
    assert (got, after, bool(first), ok, health) == (want, before, True, 200, 200)


# ---- the CLI ---------------------------------------------------------------------------------------------
def test_cli_submit_yaml_bomb_exits_fast(tmp_path: Path) -> None:
    """`ringtrain submit bomb.yaml` (a real process) exits non-zero with a message naming aliases,
    and nothing reaches the server. That it is fast is shown without a clock: the loader refuses
    before anything is expanded (`test_yaml_bomb_is_refused_before_it_expands`)."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BILLION_LAUGHS)
    with running(tmp_path) as srv:
        env = {
            **os.environ,
            "RINGTRAIN_URL": srv.url,
            "RINGTRAIN_TOKEN": ALICE,
            "PYTHONPATH": str(ROOT),
        }
        p = subprocess.run(
            [sys.executable, "-m", "api.cli", "submit", str(bomb)],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=60,
        )
        total = srv.client().get("/v1/jobs").json()["total"]
    assert (
        p.returncode,
        "aliases/anchors are not allowed" in p.stderr,
        total,
        len(srv.launcher.submits),
    ) == (1, True, 0, 0), p.stderr


def laughs(levels: int) -> str:
    """A billion-laughs document of `levels` levels of 9 aliases: 9**levels strings expanded."""
    rows = [f"l0: &l0 [{', '.join(['lol'] * 9)}]\n"]
    rows += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, levels + 1)]
    return "".join(rows) + "name: boom\n"


@pytest.mark.parametrize("levels", [4, 9, 40])
def test_yaml_bomb_is_refused_before_it_expands(levels: int) -> None:
    """The spec loader refuses at the first alias, so the work it does does not grow with the bomb:
    the peak memory of refusing 9**4, 9**9 or 9**40 strings is that of reading a few lines (bounded
    at 256 KiB; 9**4 expanded strings alone take more). Deterministic, unlike a wall-clock bound."""
    text = laughs(levels)
    tracemalloc.start()
    try:
        with pytest.raises(yaml.YAMLError, match="aliases/anchors are not allowed"):
            load_spec(text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 << 10, (levels, peak)


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        ("merge-bomb", MERGE_BOMB, "aliases/anchors are not allowed"),
        ("deep-yaml", "name: x\njunk: " + "[" * DEEP + "]" * DEEP + "\n", "recursion"),
        ("nan-lr", BASE_YAML + "train: {lr: .nan}\n", "train.lr"),
        ("huge-file", BASE_YAML + "pad: " + "x" * (10 << 20) + "\n", "byte limit"),
        ("control-char-name", 'name: "a\\x1bb"\n', "name"),
    ],
)
@pytest.mark.parametrize("command", ["submit", "plan"])
def test_cli_bad_specs(
    srv: Server,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    name: str,
    text: str,
    needle: str,
) -> None:
    f = tmp_path / f"{name}.yaml"
    f.write_text(text)
    monkeypatch.setenv("RINGTRAIN_URL", srv.url)
    monkeypatch.setenv("RINGTRAIN_TOKEN", ALICE)
    code = main([command, str(f)])
    err = capsys.readouterr().err
    _, _, _, _, submits, listed, stored, health = outcome(srv, srv.client().get("/healthz"))
    assert (code, err.startswith("error: "), needle in err, submits, listed, stored, health) == (
        1,
        True,
        True,
        0,
        0,
        0,
        200,
    ), err
