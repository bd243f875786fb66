"""REST API against a real uvicorn server, temporary SQLite, and a recording launcher; the tests play the
driver by POSTing real reports (the real protocol)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from service.launcher import DriverInfo, DriverStatus, NodeInfo
from tests.support.api_harness import BOB, TINY_SPEC, Driver, RecordingLauncher, running, wait_for


@pytest.fixture
def srv(tmp_path: Path):
    with running(tmp_path) as s:
        yield s


def submit(c, spec=TINY_SPEC, **kw):
    r = c.post("/v1/jobs", json={**spec, **kw})
    assert r.status_code == 201, r.text
    return r.json()


def job(c, jid):
    r = c.get(f"/v1/jobs/{jid}")
    assert r.status_code == 200, r.text
    return r.json()


def test_submit_run_succeed_metrics(srv):
    c = srv.client()
    j = submit(c)
    assert j["state"] == "QUEUED" and j["owner"] == "alice" and j["total_steps"] == 5
    assert srv.client().get(f"/v1/jobs/{j['id']}").json()["id"] == j["id"]
    d = Driver(srv, j["id"])
    req = srv.launcher.request_for(j["id"])
    assert req.control_url == srv.url and req.spec.name == "tiny" and len(req.ingest_token) > 20
    wait_for(lambda: job(c, j["id"])["state"] == "PLACING")
    placement = [{"rank": r, "node_id": "node-a", "device": "cpu"} for r in range(2)]
    assert d.state(
        "RUNNING",
        reason="2 ranks placed",
        placement=placement,
        metadata={"attention_backend": "cpu-flash"},
    ).json() == {"acked_seq": 1}
    assert d.metrics(range(5), ("loss", "lr")).json() == {"acked_seq": 11}
    assert d.post([d.item("log", line="hello from rank 0", source="rank-0")]).status_code == 200
    assert d.state("SUCCEEDED", reason="done").status_code == 200
    got = job(c, j["id"])
    assert got["state"] == "SUCCEEDED" and got["step"] == 4 and got["error"] is None
    assert got["placement"][1] == {
        "rank": 1,
        "node_id": "node-a",
        "device": "cpu",
        "node_ip": None,
        "ring": 0,
    }
    assert got["metadata"]["attention_backend"] == "cpu-flash"
    assert got["latest_metrics"]["loss"]["step"] == 4 and got["latest_metrics"]["loss"][
        "value"
    ] == pytest.approx(0.2)
    assert [t["to"] for t in got["transitions"]] == ["QUEUED", "PLACING", "RUNNING", "SUCCEEDED"]
    assert all(t["reason"] for t in got["transitions"])
    seqs = [t["seq"] for t in got["transitions"]]
    assert seqs == sorted(seqs)
    page = c.get(f"/v1/jobs/{j['id']}/metrics", params={"limit": 4}).json()
    assert len(page["points"]) == 4 and page["has_more"]
    rest = c.get(f"/v1/jobs/{j['id']}/metrics", params={"after": page["next_after"]}).json()
    pts = page["points"] + rest["points"]
    assert len(pts) == 10 and not rest["has_more"]
    assert [p["seq"] for p in pts] == sorted({p["seq"] for p in pts})
    assert (
        c.get(f"/v1/jobs/{j['id']}/metrics", params={"name": "lr"}).json()["points"][0]["name"]
        == "lr"
    )
    logs = c.get(f"/v1/jobs/{j['id']}/logs").json()
    assert (
        logs["lines"][0]["line"] == "hello from rank 0" and "ray driver log" in logs["driver_log"]
    )


def test_yaml_submit_and_bomb(srv):
    c = srv.client()
    text = "name: from-yaml\nmodel: {d_model: 32, n_layers: 1, n_heads: 2}\ndata: {kind: passkey, seq_len: 128}\n"
    r = c.post("/v1/jobs", content=text, headers={"Content-Type": "application/yaml"})
    assert r.status_code == 201 and r.json()["name"] == "from-yaml"
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\nc: [*b, *b, *b, *b, *b, *b]\n"
    r = c.post("/v1/jobs", content=bomb, headers={"Content-Type": "application/yaml"})
    assert r.status_code == 400 and "alias" in r.json()["error"]["message"]
    r = c.post("/v1/jobs", content="name: [unclosed", headers={"Content-Type": "application/yaml"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "malformed_yaml"


def test_validation_errors_name_the_field(srv):
    c = srv.client()
    cases = [
        ({**TINY_SPEC, "data": {"kind": "passkey", "seq_len": 130}}, "data.seq_len"),
        ({**TINY_SPEC, "model": {"d_model": "big"}}, "model.d_model"),
        ({**TINY_SPEC, "train": {"steps": 0}}, "train.steps"),
        ({**TINY_SPEC, "surprise": 1}, "surprise"),
        ({k: v for k, v in TINY_SPEC.items() if k != "name"}, "name"),
        (
            {**TINY_SPEC, "model": {"d_model": 32, "n_heads": 4, "n_kv_heads": 3}},
            "model.n_kv_heads",
        ),
    ]
    for spec, field in cases:
        r = c.post("/v1/jobs", json=spec)
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "validation_error" and err["field"] == field, err
        assert field in err["message"]
    r = c.get("/v1/jobs", params={"limit": 0})
    assert r.status_code == 422 and r.json()["error"]["field"] == "limit"
    r = c.get("/v1/jobs", params={"state": "NAPPING"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "state.0"


def test_malformed_and_oversized_bodies(srv):
    c = srv.client()
    r = c.post("/v1/jobs", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "malformed_json"
    r = c.post("/v1/jobs", content=b"[1, 2]", headers={"Content-Type": "application/json"})
    assert r.status_code == 422
    r = c.post(
        "/v1/jobs",
        content=b"[" * 100000 + b"]" * 100000,
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400
    r = c.post("/v1/jobs", content=b"\xff\xfe", headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    r = c.post(
        "/v1/jobs", content=b"name=x", headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    assert r.status_code == 415
    big = {**TINY_SPEC, "name": "x" * 100, "pad": "y" * (2 << 20)}
    r = c.post("/v1/jobs", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"

    def chunks():
        for _ in range(40):
            yield b" " * 65536

    r = c.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert c.get("/v1/jobs").json()["total"] == 0  # nothing partial was stored


def test_auth_and_owner_isolation(srv):
    alice, bob, anon = srv.client(), srv.client(BOB), srv.client(None)
    j = submit(alice)
    r = anon.get("/v1/jobs")
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    assert r.headers["www-authenticate"] == "Bearer"
    assert srv.client("not-a-real-token").get("/v1/jobs").status_code == 401
    for path in (f"/v1/jobs/{j['id']}", f"/v1/jobs/{j['id']}/metrics", f"/v1/jobs/{j['id']}/logs"):
        r = bob.get(path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path
    assert bob.post(f"/v1/jobs/{j['id']}/cancel").status_code == 404
    assert bob.get(f"/v1/jobs/{j['id']}/events").status_code == 404
    assert bob.get("/v1/jobs").json()["total"] == 0
    assert alice.get("/v1/jobs/jdoesnotexist").status_code == 404
    d = Driver(srv, j["id"])
    # the ingest token works only on the report route; user tokens never work there
    assert d.http.get(f"/v1/jobs/{j['id']}").status_code == 401
    assert d.http.get("/v1/jobs").status_code == 401
    r = alice.post(f"/v1/jobs/{j['id']}/report", json={"items": []})
    assert r.status_code == 401
    other = submit(alice)
    Driver(srv, other["id"])
    assert d.http.post(f"/v1/jobs/{other['id']}/report", json={"items": []}).status_code == 401
    for open_path in ("/healthz", "/readyz", "/metrics", "/", "/openapi.json"):
        assert anon.get(open_path).status_code == 200, open_path


def test_list_pagination_and_filter(srv):
    c = srv.client()
    ids = [submit(c, name=f"job-{i}")["id"] for i in range(7)]
    page = c.get("/v1/jobs", params={"limit": 3}).json()
    assert page["total"] == 7 and [j["id"] for j in page["jobs"]] == ids[::-1][:3]
    page2 = c.get("/v1/jobs", params={"limit": 3, "offset": 3}).json()
    assert [j["id"] for j in page2["jobs"]] == ids[::-1][3:6]
    c.post(f"/v1/jobs/{ids[0]}/cancel")
    wait_for(lambda: job(c, ids[0])["state"] == "CANCELLED")
    got = c.get("/v1/jobs", params={"state": "CANCELLED"}).json()
    assert [j["id"] for j in got["jobs"]] == [ids[0]]
    both = c.get(
        "/v1/jobs", params=[("state", "CANCELLED"), ("state", "PLACING"), ("state", "QUEUED")]
    ).json()
    assert both["total"] == 7


def test_cancel_running_is_idempotent(srv):
    c = srv.client()
    j = submit(c)
    d = Driver(srv, j["id"])
    d.state("RUNNING", reason="placed")
    r = c.post(f"/v1/jobs/{j['id']}/cancel")
    assert r.status_code == 202 and r.json()["cancel_requested"]
    assert c.post(f"/v1/jobs/{j['id']}/cancel").status_code == 202
    sid = job(c, j["id"])["submission_id"]
    assert srv.launcher.stops[:1] == [sid]
    # the driver stops without a final report: the reconciler sees Ray STOPPED → CANCELLED
    got = wait_for(lambda: (g := job(c, j["id"]))["state"] == "CANCELLED" and g)
    assert "cancel" in got["transitions"][-1]["reason"]
    assert c.post(f"/v1/jobs/{j['id']}/cancel").status_code == 202
    assert job(c, j["id"])["state"] == "CANCELLED"
    # a late report cannot revive a terminal job: refused, nothing applied
    late = d.state("RUNNING")
    assert (late.status_code, late.json()["error"]["code"]) == (409, "job_ended")
    assert job(c, j["id"])["state"] == "CANCELLED"


def test_report_idempotency_gap_and_supersede(srv):
    c = srv.client()
    j = submit(c)
    d = Driver(srv, j["id"])
    batch = [d.item("state", state="RUNNING", reason="go")] + [
        d.item("metric", step=s, name="loss", value=10.0 - s) for s in range(10)
    ]
    assert d.post(batch).json() == {"acked_seq": 11}
    assert d.post(batch).json() == {"acked_seq": 11}  # resent after a timeout: stored once
    pts = c.get(f"/v1/jobs/{j['id']}/metrics").json()["points"]
    assert len(pts) == 10
    # a gap: the driver lost seq 12
    d.seq += 1
    r = d.post([d.item("metric", step=10, name="loss", value=0.5)])
    assert (
        r.status_code == 409
        and r.json()["acked_seq"] == 11
        and r.json()["error"]["code"] == "sequence_gap"
    )
    d.seq = 11
    # retry from checkpoint at step 5: later points are superseded
    assert d.state("RETRYING", reason="rank 1 died", resume_step=5).json() == {"acked_seq": 12}
    assert d.state("RUNNING", reason="re-placed").status_code == 200
    assert (
        d.post(
            [d.item("metric", step=s, name="loss", value=100.0 + s) for s in range(6, 12)]
        ).status_code
        == 200
    )
    pts = c.get(f"/v1/jobs/{j['id']}/metrics").json()["points"]
    steps = [p["step"] for p in pts]
    assert steps == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]  # exactly one point per (step, name)
    assert pts[6]["value"] == 106.0
    seqs = [p["seq"] for p in pts]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    got = job(c, j["id"])
    assert (
        got["restarts"] == 1
        and got["step"] == 11
        and got["latest_metrics"]["loss"]["value"] == 111.0
    )
    retry = next(t for t in got["transitions"] if t["to"] == "RETRYING")
    assert retry["resume_step"] == 5 and retry["seq"] > max(seqs[:6])
    # an internal gap: the prefix applies, 409 names where to resume
    items = [d.item("metric", step=12, name="loss", value=1.0)]
    d.seq += 1
    items.append(d.item("metric", step=13, name="loss", value=1.0))
    r = d.post(items)
    assert r.status_code == 409 and r.json()["acked_seq"] == items[0]["seq"]
    # malformed report body → 422 naming the field; no 500
    r = d.http.post(f"/v1/jobs/{j['id']}/report", json={"items": [{"type": "metric", "seq": 0}]})
    assert r.status_code == 422 and r.json()["error"]["field"].startswith("items.0")


def test_driver_dies_without_report_fails(srv):
    c = srv.client()
    j = submit(
        c, max_restarts=0
    )  # with restarts left the driver is resubmitted instead (tests/integration/test_faults.py)
    d = Driver(srv, j["id"])
    d.state("RUNNING", reason="placed")
    sid = job(c, j["id"])["submission_id"]
    srv.launcher.statuses[sid] = DriverInfo(DriverStatus.FAILED, "exit code 137")
    got = wait_for(lambda: (g := job(c, j["id"]))["state"] == "FAILED" and g)
    assert "without reporting a final state" in got["error"] and "137" in got["error"]
    assert "no restarts left" in got["error"]


def test_submit_failures_retry_then_fail(tmp_path):
    launcher = RecordingLauncher(fail_submits=1)
    with running(tmp_path, launcher) as srv:
        c = srv.client()
        j = submit(c)
        wait_for(lambda: job(c, j["id"])["state"] == "PLACING", timeout=10)
    launcher = RecordingLauncher(fail_submits=100)
    with running(tmp_path / "b", launcher, submit_attempts=2) as srv:
        c = srv.client()
        j = submit(c)
        got = wait_for(lambda: (g := job(c, j["id"]))["state"] == "FAILED" and g, timeout=15)
        assert "could not submit" in got["error"] and "unreachable" in got["error"]


def test_cancel_during_submit_backoff_submits_nothing(tmp_path):
    """A job cancelled while its submission waits out a back-off is never handed to Ray."""
    launcher = RecordingLauncher(fail_submits=1)
    with running(tmp_path, launcher) as srv:
        c = srv.client()
        j = submit(c)
        store, controller = srv.app.state.ctx.store, srv.app.state.ctx.controller
        wait_for(lambda: store.jobs.get(j["id"]).submit_failures == 1)
        assert c.post(f"/v1/jobs/{j['id']}/cancel").json()["state"] == "CANCELLED"
        wait_for(
            lambda: j["id"] not in controller._submitting, timeout=15
        )  # the retry ran and gave up quietly
        assert launcher.submits == [] and job(c, j["id"])["state"] == "CANCELLED"


def test_series_snapshot(srv):
    """GET /series (the dashboard's first load): series by name then rank, NaN as null, M4 decimation keeps the
    first, last, minimum and maximum point, the log tail in order, all as of last_seq."""
    c = srv.client()
    j = submit(c)
    d = Driver(srv, j["id"])
    d.state("RUNNING", reason="placed")
    wave = [
        ((s * 37) % 11) - 5.0 for s in range(1, 41)
    ]  # min -5 and max 5 fall inside buckets, not at edges
    items = [
        d.item("metric", step=s, name="loss", value=v)
        for s, v in zip(range(1, 41), wave, strict=True)
    ]
    items[2]["value"] = float("nan")
    items += [
        d.item("metric", step=s, name="mem", rank=r, value=100.0 * r + s)
        for s in (1, 2)
        for r in (1, 0)
    ]
    items += [d.item("log", source="driver", line=f"line {i}") for i in range(3)]
    r = d.http.post(
        f"/v1/jobs/{j['id']}/report",
        content=json.dumps({"items": items}),
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 200, r.text
    full = c.get(f"/v1/jobs/{j['id']}/series", params={"max_points": 100, "logs": 2}).json()
    assert [(s["name"], s["rank"]) for s in full["series"]] == [
        ("loss", None),
        ("mem", 0),
        ("mem", 1),
    ]
    loss = full["series"][0]
    assert loss["count"] == 40 and not loss["downsampled"] and loss["step"] == list(range(1, 41))
    assert loss["value"][2] is None and loss["value"][3:] == wave[3:]
    assert full["series"][1]["value"] == [1.0, 2.0] and full["series"][2]["value"] == [101.0, 102.0]
    assert [line["line"] for line in full["logs"]] == ["line 1", "line 2"]
    stored = srv.app.state.ctx.store.metrics.events_after(j["id"], 0, 1000)
    assert full["last_seq"] == stored[-1].seq and full["job"]["id"] == j["id"]
    small = c.get(f"/v1/jobs/{j['id']}/series", params={"max_points": 16, "logs": 0}).json()
    dec = small["series"][0]
    assert (
        dec["downsampled"] and dec["count"] == 40 and len(dec["step"]) <= 16 and small["logs"] == []
    )
    assert dec["step"] == sorted(dec["step"]) and dec["step"][0] == 1 and dec["step"][-1] == 40
    kept = dict(zip(dec["step"], dec["value"], strict=True))
    assert all(kept[s] == loss["value"][s - 1] for s in kept)
    assert (
        min(v for v in kept.values() if v is not None) == -5.0
        and max(kept.values(), key=lambda v: v or -9) == 5.0
    )


def test_data_roots_and_cluster_limits(srv, tmp_path):
    c = srv.client()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello " * 100)
    text = {**TINY_SPEC, "data": {"kind": "text", "seq_len": 128, "path": str(corpus)}}
    assert c.post("/v1/jobs", json=text).status_code == 201
    outside = tmp_path.parent / f"{tmp_path.name}-outside.txt"
    outside.write_text("secret")
    link = tmp_path / "sneaky.txt"
    os.symlink(outside, link)
    for p in (str(outside), str(link), "/etc/passwd", str(tmp_path / ".." / "x")):
        r = c.post("/v1/jobs", json={**text, "data": {"kind": "text", "seq_len": 128, "path": p}})
        assert r.status_code == 422 and r.json()["error"]["field"] == "data.path", p
    r = c.post(
        "/v1/jobs",
        json={
            **TINY_SPEC,
            "parallel": {"ring_size": 32},
            "data": {"kind": "passkey", "seq_len": 1024},
        },
    )
    assert r.status_code == 422 and r.json()["error"]["field"] == "parallel.ring_size"
    assert "never be placed" in r.json()["error"]["message"]


def test_plan_and_cluster(tmp_path):
    nodes = [
        NodeInfo("n1", "10.0.0.1", True, 32, 32, 4, 4),
        NodeInfo("n2", "10.0.0.2", True, 32, 32, 4, 2),
    ]
    with running(tmp_path, RecordingLauncher(nodes=nodes)) as srv:
        c = srv.client()
        spec = {
            **TINY_SPEC,
            "parallel": {"ring_size": 6},
            "data": {"kind": "passkey", "seq_len": 1200},
        }
        p = c.post("/v1/plan", json=spec).json()
        assert p["valid"] and p["fits"] and p["accelerator"] == "gpu" and p["strategy"] == "PACK"
        assert [s["node_id"] for s in p["placement"]] == ["n1"] * 4 + ["n2"] * 2
        assert [s["device"] for s in p["placement"]][:5] == [
            "cuda:0",
            "cuda:1",
            "cuda:2",
            "cuda:3",
            "cuda:0",
        ]
        assert p["node_crossings"] == 2 and p["nodes_used"] == 2
        mem = p["memory"]
        assert mem["local_tokens"] == 200 and mem["bytes"]["adamw"] == 2 * mem["bytes"]["params"]
        assert "AdamW" in mem["formula"]
        small = c.post("/v1/plan", json={**TINY_SPEC, "parallel": {"ring_size": 2}}).json()
        assert small["strategy"] == "STRICT_PACK" and small["node_crossings"] == 0
        busy = c.post(
            "/v1/plan",
            json={
                **spec,
                "parallel": {"ring_size": 7},
                "data": {"kind": "passkey", "seq_len": 1400},
            },
        ).json()
        assert busy["fits"] and any("free" in w for w in busy["warnings"])
        huge = c.post(
            "/v1/plan",
            json={
                **spec,
                "parallel": {"ring_size": 16},
                "data": {"kind": "passkey", "seq_len": 1024},
            },
        ).json()
        assert not huge["valid"] and "never be placed" in huge["warnings"][0]
        assert (
            c.post(
                "/v1/plan", json={**spec, "data": {"kind": "passkey", "seq_len": 100}}
            ).status_code
            == 422
        )
        cl = c.get("/v1/cluster").json()
        assert cl["gpus_total"] == 8 and cl["gpus_free"] == 6 and len(cl["nodes"]) == 2
        # pipeline_split auto: plan shows the planner's split, submission stores it as a list
        pp = {
            **TINY_SPEC,
            "model": {"d_model": 32, "n_layers": 5, "n_heads": 2, "tie_embeddings": False},
            "parallel": {"ring_size": 1, "pipeline_size": 2, "pipeline_split": "auto"},
            "train": {"steps": 5, "batch_size": 2, "microbatches": 2},
            "verify": {"enabled": False},
            "eval": {"enabled": False},
        }
        planned = c.post("/v1/plan", json=pp).json()
        split = planned["spec"]["parallel"]["pipeline_split"]
        assert split == planned["memory"]["pipeline"]["split"] and sum(split) == 5
        job = c.post("/v1/jobs", json=pp)
        assert job.status_code == 201 and job.json()["spec"]["parallel"]["pipeline_split"] == split
        bad = c.post("/v1/plan", json={**pp, "parallel": {**pp["parallel"], "pipeline_split": "x"}})
        assert bad.status_code == 422
        assert bad.json()["error"]["field"] == "parallel.pipeline_split"


def test_health_metrics_and_openapi(srv):
    c = srv.client(None)
    health = wait_for(lambda: (h := c.get("/healthz").json())["ray"] != "unknown" and h)
    replica = srv.app.state.ctx.leadership.replica
    # SQLite: always leads
    assert health == {"status": "ok", "role": "leader", "replica": replica, "ray": "ok"}
    assert c.get("/readyz").json() == {"status": "ready", "store": "ok"}
    submit(srv.client())
    text = c.get("/metrics").text
    assert f'ringtrain_replica_leader{{replica="{replica}"}} 1.0' in text
    assert "ringtrain_leader_lease_age_seconds" in text and "ringtrain_leader_epoch" in text
    assert "ringtrain_ray_up 1.0" in text
    assert 'ringtrain_jobs{state="QUEUED"}' in text or 'ringtrain_jobs{state="PLACING"}' in text
    assert (
        "ringtrain_http_requests_total" in text
        and "ringtrain_http_request_duration_seconds" in text
    )
    spec = c.get("/openapi.json").json()
    body = spec["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", "application/yaml"}
    assert "JobSpec" in spec["components"]["schemas"]
    r = c.get("/nope")
    assert r.status_code == 404 and set(r.json()["error"]) == {
        "code",
        "message",
        "field",
        "details",
    }


def test_readyz_without_ray(tmp_path):
    class NoRay(RecordingLauncher):
        def cluster(self):
            raise ConnectionError("connection refused")

    with running(tmp_path, NoRay()) as srv:
        # ready (the Service keeps routing the CLI, the dashboard and the drivers' reports) while Ray is reported down
        r = srv.client(None).get("/readyz")
        assert r.status_code == 200, r.text
        assert r.json() == {"status": "ready", "store": "ok"}
        health = wait_for(
            lambda: (h := srv.client(None).get("/healthz").json())["ray"] != "unknown" and h
        )
        assert (
            health["ray"] == "unreachable"
            and health["ray_error"] == "ConnectionError: connection refused"
        )
        cl = srv.client().get("/v1/cluster")
        assert cl.status_code == 503 and cl.json()["error"]["code"] == "ray_unavailable"
        assert "connection refused" in cl.json()["error"]["message"]
        j = submit(srv.client())  # accepted while Ray is away: it waits QUEUED, saying why
        assert srv.client().get(f"/v1/jobs/{j['id']}").json()["state"] == "QUEUED"


def test_restart_reattaches_running_jobs(tmp_path):
    launcher = RecordingLauncher()
    with running(tmp_path, launcher) as srv:
        port = srv.settings.port
        c = srv.client()
        j = submit(c)
        d = Driver(srv, j["id"])
        d.state("RUNNING", reason="placed")
        d.metrics(range(3))
        token = d.token
    # the control plane is down; the driver keeps running; a new process on the same store and port
    with running(tmp_path, launcher, port=port) as srv2:
        c = srv2.client()
        assert job(c, j["id"])["state"] == "RUNNING"
        assert len(launcher.submits) == 1  # not resubmitted
        d.http = srv2.client(token)
        assert d.metrics(range(3, 5)).json() == {"acked_seq": 6}
        assert d.state("SUCCEEDED", reason="done").status_code == 200
        got = job(c, j["id"])
        assert got["state"] == "SUCCEEDED" and got["step"] == 4
        assert len(c.get(f"/v1/jobs/{j['id']}/metrics").json()["points"]) == 5


def test_store_unavailable_is_503(tmp_path):
    from sqlalchemy import create_engine
    from sqlalchemy.orm import sessionmaker

    with running(tmp_path) as srv:
        c = srv.client()
        j = submit(c)
        store = srv.app.state.ctx.store
        good = store.db.sessions
        store.db.sessions = sessionmaker(create_engine(f"sqlite:///{tmp_path}/missing-dir/x.db"))
        try:
            for r in (
                c.get("/v1/jobs"),
                c.get(f"/v1/jobs/{j['id']}"),
                c.post("/v1/jobs", json=TINY_SPEC),
            ):
                assert r.status_code == 503, r.text
                assert (
                    r.json()["error"]["code"] == "store_unavailable"
                    and r.headers["retry-after"] == "5"
                )
            assert srv.client(None).get("/readyz").status_code == 503
        finally:
            store.db.sessions = good
        assert c.get("/v1/jobs").json()["total"] == 1


def test_metric_catalog_route(srv):
    """GET /v1/metrics/catalog serves workers.metrics: read auth, the entries' exact values."""
    assert srv.client(None).get("/v1/metrics/catalog").status_code == 401
    r = srv.client().get("/v1/metrics/catalog")
    assert r.status_code == 200, r.text
    body = r.json()
    assert [g["id"] for g in body["groups"]] == [
        "training",
        "throughput",
        "memory",
        "validation",
        "eval",
        "verification",
    ]
    by_name = {m["name"]: m for m in body["metrics"]}
    assert by_name["loss"] == {
        "name": "loss",
        "key": "loss",
        "title": "Loss",
        "unit": "nats/token",
        "group": "training",
        "description": "cross-entropy of the step's global batch, the token mean over all ranks",
        "format": "fixed",
        "digits": 4,
        "per_rank": False,
        "view": "line",
        "fields": [],
        "regex": "^loss$",
        "grid": None,
        "profile": None,
        "column": True,
        "progress": True,
    }
    assert {n: m["per_rank"] for n, m in by_name.items() if m["per_rank"]} == {
        "mem_peak_bytes": True,
        "state_bytes": True,
    }
    cells = by_name["passkey_acc/len={len}/depth={depth}"]
    assert cells["key"] == "passkey" and cells["view"] == "grid"
    assert cells["fields"] == ["len", "depth"]
    assert cells["grid"] == {"rows": "len", "columns": "depth"}
    assert cells["regex"] == "^passkey_acc/len=([^/]+)/depth=([^/]+)$"
    # the metrics other parts emit soon are listed already (they have no data until then)
    assert by_name["val_loss"]["group"] == by_name["val_loss/pos={pos}"]["group"] == "validation"
    assert by_name["val_loss/pos={pos}"]["fields"] == ["pos"]
    assert by_name["val_loss/pos={pos}"]["profile"] == "pos"  # also charted against position
    assert by_name["verify_max_rel_err"]["view"] == "stat"
    assert [m["name"] for m in body["metrics"] if m["column"]] == ["loss", "tokens_per_s"]
    assert set(body["formats"]) >= {m["format"] for m in body["metrics"]}
    # in the OpenAPI document, with its schema
    spec = srv.client(None).get("/openapi.json").json()
    op = spec["paths"]["/v1/metrics/catalog"]["get"]
    assert op["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/MetricCatalog"
    }
    assert "401" in op["responses"]
