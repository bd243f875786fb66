"""Authentication and owner isolation over every operation in /openapi.json, on a real server.

The table is every operation × {no token, invalid tokens (wrong, near misses, wrong scheme), another owner's
token, a job's ingest token on user routes, a user token on the report route, the right token}. Expected:
401 without or with an invalid token, 404 (never 403) for another owner's job, open routes open, and no
response body that contains a token. The server's log output (our JSON log, uvicorn's error and access
logs, DEBUG level) is captured for the whole module and searched for every token at the end.
"""

from __future__ import annotations

import hmac
import inspect
import logging
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api import deps
from api.app import create_app
from api.routers import reports
from api.telemetry import JsonFormatter
from service import store as store_mod
from tests.support.api_harness import (
    ALICE,
    BOB,
    TINY_SPEC,
    Driver,
    RecordingLauncher,
    Server,
    make_settings,
    upgraded,
)

OPEN = {("GET", "/healthz"), ("GET", "/readyz")}
REPORT = ("POST", "/v1/jobs/{job_id}/report")
# credentials: name → how to build the Authorization header from the module's tokens
CREDS = [
    "none",
    "invalid",
    "alice-prefix",
    "alice-extended",
    "alice-upper",
    "basic-scheme",
    "empty-bearer",
    "other-owner",
    "ingest",
    "other-ingest",
    "owner",
]


def _operations() -> list[tuple[str, str]]:
    with tempfile.TemporaryDirectory() as d:
        schema = create_app(upgraded(make_settings(Path(d))), RecordingLauncher()).openapi()
    return sorted((m.upper(), p) for p, ops in schema["paths"].items() for m in ops)


OPERATIONS = _operations()


class Capture(logging.Handler):
    """Keeps every record, formatted the way the server writes it (plus the bare message and traceback)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.fmt = JsonFormatter()

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(("httpx", "httpcore")):
            return  # the test's own HTTP client, not the server
        self.lines.append(self.fmt.format(record))
        self.lines.append(record.getMessage())


LOGGERS = [
    "",
    "ringtrain",
    "uvicorn",
    "uvicorn.error",
    "uvicorn.access",
    "fastapi",
    "sse_starlette",
]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    cap = Capture()
    saved = {n: (logging.getLogger(n).level, logging.getLogger(n).propagate) for n in LOGGERS}
    for n in LOGGERS:
        logging.getLogger(n).addHandler(cap)
        logging.getLogger(n).setLevel(logging.DEBUG)
    tmp = tmp_path_factory.mktemp("auth")
    srv = Server(make_settings(tmp, log_level="DEBUG"), RecordingLauncher())
    srv.server.config.access_log = True  # uvicorn's access log too: it must not carry tokens either
    srv.start()
    try:
        with srv.client() as alice:
            jobs = {
                k: alice.post("/v1/jobs", json={**TINY_SPEC, "name": k}).json()["id"]
                for k in ("main", "other", "cancel")
            }
            dataset = alice.post("/v1/datasets", json=dataset_body(tmp, "main")).json()["id"]
            evaluation = alice.post("/v1/evals", json=eval_body(tmp)).json()["id"]
        drivers = {k: Driver(srv, j) for k, j in jobs.items()}
        drivers["main"].state("RUNNING", reason="placed")
        drivers["main"].metrics(range(3))
        tokens = {
            "alice": ALICE,
            "bob": BOB,
            "ingest": drivers["main"].token,
            "other-ingest": drivers["other"].token,
            "cancel-ingest": drivers["cancel"].token,
        }
        yield {
            "srv": srv,
            "jobs": jobs,
            "dataset": dataset,
            "eval": evaluation,
            "tmp": tmp,
            "drivers": drivers,
            "tokens": tokens,
            "capture": cap,
        }
    finally:
        srv.stop()
        for n in LOGGERS:
            logger = logging.getLogger(n)
            logger.removeHandler(cap)
            logger.setLevel(saved[n][0])


def dataset_body(tmp: Path, name: str) -> dict[str, str]:
    """A prepare request inside the data roots (the recording launcher has no cluster: it ends FAILED)."""
    return {"source": str(tmp / "corpus.jsonl"), "out": str(tmp / f"ds-{name}")}


def eval_body(tmp: Path) -> dict[str, Any]:
    """An evaluation of a model directory inside the data roots (it never ends here)."""
    return {"model": str(tmp / "model"), "lengths": [512], "samples": 1, "tasks": ["vt"]}


def header(cred: str, tokens: dict[str, str], op: tuple[str, str]) -> dict[str, str]:
    ingest = tokens["cancel-ingest"] if op[1].endswith("/cancel") else tokens["ingest"]
    value = {
        "none": None,
        "invalid": "Bearer not-a-real-token-0123456789",
        "alice-prefix": f"Bearer {ALICE[:-1]}",
        "alice-extended": f"Bearer {ALICE}x",
        "alice-upper": f"Bearer {ALICE.upper()}",
        "basic-scheme": f"Basic {ALICE}",
        "empty-bearer": "Bearer",
        "other-owner": f"Bearer {BOB}",
        "ingest": f"Bearer {ingest}",
        "other-ingest": f"Bearer {tokens['other-ingest']}",
        "owner": f"Bearer {ALICE}",
    }[cred]
    return {"Authorization": value} if value else {}


def expected(op: tuple[str, str], cred: str) -> int:
    """The status the table requires (2xx collapsed to 200)."""
    if op in OPEN:
        return 200
    if op == REPORT:
        return 200 if cred == "ingest" else 401
    if cred == "owner":
        return (
            404 if "/artifacts" in op[1] else 200
        )  # the owner is let in; a running job has no model yet
    if cred == "other-owner":  # another owner's job, dataset or eval does not exist for them
        return 404 if any(f"{{{k}_id}}" in op[1] for k in ("job", "dataset", "eval")) else 200
    return 401


def call(
    srv: Server, env: dict[str, Any], op: tuple[str, str], cred: str
) -> tuple[int, str, dict[str, str]]:
    """(status, body text, headers). The job is `cancel` for the cancel route so the others keep running."""
    method, path = op
    job = env["jobs"]["cancel" if path.endswith("/cancel") else "main"]
    url = path.replace("{job_id}", job).replace("{dataset_id}", env["dataset"])
    url = url.replace("{eval_id}", env["eval"])
    kw: dict[str, Any] = {}
    if op == REPORT:
        kw["json"] = {"items": []}
    elif op == ("POST", "/v1/datasets"):
        kw["json"] = dataset_body(env["tmp"], cred)
    elif op == ("POST", "/v1/evals"):
        kw["json"] = eval_body(env["tmp"])
    elif method == "POST" and "{job_id}" not in path:
        kw["json"] = {**TINY_SPEC, "name": f"auth-{cred}"}
    with (
        httpx.Client(base_url=srv.url, headers=header(cred, env["tokens"], op), timeout=10) as c,
        c.stream(method, url, **kw) as r,
    ):
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            return (
                r.status_code,
                "",
                dict(r.headers),
            )  # a live stream: the status is what counts here
        return r.status_code, r.read().decode(errors="replace"), dict(r.headers)


@pytest.mark.parametrize("cred", CREDS)
@pytest.mark.parametrize("op", OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_every_route_and_credential(env: dict[str, Any], op: tuple[str, str], cred: str) -> None:
    status, body, headers = call(env["srv"], env, op, cred)
    want = expected(op, cred)
    code = {401: '"code":"unauthorized"', 404: '"code":"not_found"'}.get(want, "")
    if cred == "owner" and want == 404:
        code = '"code":"no_artifacts"'  # past auth and ownership: the answer is about the model, not the caller
    leaked = [k for k, t in env["tokens"].items() if t in body]
    got = (
        200 if 200 <= status < 300 else status,
        code in body,
        headers.get("www-authenticate") == "Bearer" if want == 401 else True,
        leaked,
    )
    assert got == (want, True, True, []), body[:300]


def test_table_covers_every_operation(env: dict[str, Any]) -> None:
    """The live schema has exactly the operations the table ran, and only /healthz and /readyz are open."""
    schema = env["srv"].client(None).get("/openapi.json").json()
    live = sorted((m.upper(), p) for p, ops in schema["paths"].items() for m in ops)
    unsecured = {
        (m.upper(), p)
        for p, ops in schema["paths"].items()
        for m, o in ops.items()
        if not o.get("security")
    }
    assert (live, unsecured) == (OPERATIONS, OPEN)


@pytest.mark.parametrize("path", ["/", "/metrics", "/openapi.json", "/docs"])
def test_open_non_api_routes_stay_open(env: dict[str, Any], path: str) -> None:
    assert env["srv"].client(None).get(path).status_code == 200


def test_other_owner_sees_no_difference_from_missing(env: dict[str, Any]) -> None:
    """404 for another owner's job is byte-identical (but for the id) to a job that does not exist: no oracle."""
    srv, job = env["srv"], env["jobs"]["main"]
    missing = "j000000000000"
    bob = srv.client(BOB)
    pairs = []
    for suffix in ("", "/metrics", "/logs", "/events", "/series"):
        a, b = bob.get(f"/v1/jobs/{job}{suffix}"), bob.get(f"/v1/jobs/{missing}{suffix}")
        pairs.append(
            (
                suffix,
                a.status_code,
                a.text.replace(job, "ID"),
                b.status_code,
                b.text.replace(missing, "ID"),
            )
        )
    c1, c2 = bob.post(f"/v1/jobs/{job}/cancel"), bob.post(f"/v1/jobs/{missing}/cancel")
    pairs.append(
        (
            "/cancel",
            c1.status_code,
            c1.text.replace(job, "ID"),
            c2.status_code,
            c2.text.replace(missing, "ID"),
        )
    )
    assert all(p[1] == p[3] == 404 and p[2] == p[4] for p in pairs), pairs


def test_other_owners_stream_is_404_with_no_data(env: dict[str, Any]) -> None:
    """Bob's subscription to Alice's live job: 404 JSON, no SSE frame, no subscriber registered in the hub."""
    srv, job = env["srv"], env["jobs"]["main"]
    hub = srv.app.state.ctx.hub
    before = hub.subscribers(job)
    got = []
    for after in (None, "0"):
        headers = {"Accept": "text/event-stream", **({"Last-Event-ID": after} if after else {})}
        with (
            srv.client(BOB, timeout=5) as c,
            c.stream("GET", f"/v1/jobs/{job}/events", headers=headers) as r,
        ):
            body = r.read().decode()
            got.append((r.status_code, r.headers["content-type"], "data:" in body, "loss" in body))
    assert (got, hub.subscribers(job)) == ([(404, "application/json", False, False)] * 2, before)


def test_other_owner_cannot_cancel_or_list(env: dict[str, Any]) -> None:
    srv, job = env["srv"], env["jobs"]["main"]
    srv.client(BOB).post(f"/v1/jobs/{job}/cancel")
    state = srv.client().get(f"/v1/jobs/{job}").json()
    bob_jobs = [
        j["owner"] for j in srv.client(BOB).get("/v1/jobs", params={"limit": 500}).json()["jobs"]
    ]
    stops = [s for s in srv.launcher.stops if job in s]
    assert (state["cancel_requested"], state["state"], stops, set(bob_jobs) <= {"bob"}) == (
        False,
        "RUNNING",
        [],
        True,
    )


def test_ingest_token_is_bound_to_its_job(env: dict[str, Any]) -> None:
    """A driver's token cannot report into another job, nor act as a user anywhere."""
    srv, jobs, tokens = env["srv"], env["jobs"], env["tokens"]
    with srv.client(tokens["other-ingest"]) as c:
        cross = c.post(
            f"/v1/jobs/{jobs['main']}/report",
            json={
                "items": [
                    {"type": "state", "seq": 99, "state": "FAILED", "time": 1.0, "error": "forged"}
                ]
            },
        ).status_code
        own = c.post(f"/v1/jobs/{jobs['other']}/report", json={"items": []}).status_code
    state = srv.client().get(f"/v1/jobs/{jobs['main']}").json()["state"]
    assert (cross, own, state) == (401, 200, "RUNNING")


def test_comparisons_are_constant_time(
    env: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """User tokens and ingest tokens are compared with hmac.compare_digest, against every configured token
    (no early exit), and no other code path looks a presented token up (dict lookups leak timing)."""
    calls: list[tuple[Any, Any]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    tokens = {"t" * 20: "x", ALICE: "alice", "u" * 20: "y"}
    assert deps.owner_of(tokens, ALICE) == "alice"
    user_calls = len(calls)
    srv = env["srv"]
    status = (
        srv.client(env["tokens"]["ingest"])
        .post(f"/v1/jobs/{env['jobs']['main']}/report", json={"items": []})
        .status_code
    )
    srcs = {
        f: inspect.getsource(f)
        for f in (deps.current_owner, deps.owner_of, reports._check_ingest, store_mod.Tokens.check)
    }
    lookups = [
        (f.__qualname__, pat)
        for f, src in srcs.items()
        for pat in (
            r"tokens\.get\(",
            r"tokens\[",
            r"\bin (ctx\.)?tokens\b(?!\.items)",
            r"[=!]= *token\b",
            r"\btoken *[=!]=",
        )
        if re.search(pat, src)
    ]
    assert (user_calls, status, len(calls) > user_calls, lookups) == (3, 200, True, [])


def test_tokens_never_in_logs(env: dict[str, Any]) -> None:
    """Run the whole table once more (so this test stands alone), then search every captured log line."""
    srv = env["srv"]
    for op in OPERATIONS:
        for cred in CREDS:
            call(srv, env, op, cred)
    d = env["drivers"]["main"]
    d.state("FAILED", reason="rank 0 raised", error="RuntimeError: boom")  # error paths log too
    lines = env["capture"].lines
    secrets = {
        **env["tokens"],
        "invalid": "not-a-real-token-0123456789",
        "alice-prefix": ALICE[:-1],
    }
    leaks = [(name, line[:200]) for name, t in secrets.items() for line in lines if t in line]
    access = [ln for ln in lines if "/v1/jobs" in ln]
    assert (leaks, len(access) > len(OPERATIONS)) == ([], True)
