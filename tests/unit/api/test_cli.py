"""The `ringtrain` CLI against a real server (recording launcher; the test plays the driver)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from api.cli import main
from tests.support.api_harness import ALICE, Driver, Server, running, wait_for

ROOT = Path(__file__).resolve().parents[3]
PASSKEY = str(ROOT / "examples" / "passkey.yaml")


@pytest.fixture
def srv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    with running(tmp_path) as s:
        monkeypatch.setenv("RINGTRAIN_URL", s.url)
        monkeypatch.setenv("RINGTRAIN_TOKEN", ALICE)
        yield s


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_submit_list_status_cancel_logs(srv, capsys):
    code, out, _ = run(capsys, "submit", PASSKEY)
    assert code == 0 and out.startswith("submitted j") and "passkey-demo" in out
    job_id = out.split()[1]
    code, out, _ = run(capsys, "submit", PASSKEY, "--json")
    assert code == 0 and json.loads(out)["state"] == "QUEUED"
    code, out, _ = run(capsys, "list")
    assert code == 0 and job_id in out and "passkey-demo" in out
    code, out, _ = run(capsys, "list", "--json")
    assert json.loads(out)["total"] == 2
    d = Driver(srv, job_id)
    d.state(
        "RUNNING",
        reason="2 ranks placed",
        placement=[{"rank": 0, "node_id": "node-a", "device": "cpu"}],
    )
    d.metrics(range(3))
    d.post([d.item("log", line="step 2 loss 0.33", source="rank-0")])
    code, out, _ = run(capsys, "status", job_id)
    assert (
        code == 0
        and "RUNNING" in out
        and "step 2/700" in out
        and "2 ranks placed" in out
        and "rank 0" in out
    )
    code, out, _ = run(capsys, "logs", job_id)
    assert "[rank-0] step 2 loss 0.33" in out and "Ray driver log" in out
    code, out, _ = run(capsys, "cancel", job_id)
    assert code == 0 and "cancel requested" in out
    wait_for(lambda: srv.client().get(f"/v1/jobs/{job_id}").json()["state"] == "CANCELLED")
    code, out, _ = run(capsys, "status", job_id, "--json")
    assert json.loads(out)["state"] == "CANCELLED"


def test_submit_follow(srv, capsys, tmp_path):
    def drive(job_id: str, final: str) -> None:
        d = Driver(srv, job_id)
        wait_for(lambda: srv.app.state.ctx.hub.subscribers(job_id) >= 1)
        d.state("RUNNING", reason="placed")
        for s in range(30):
            d.post(
                [
                    d.item("metric", step=s, name="loss", value=5.0 - s * 0.1),
                    d.item("metric", step=s, name="tokens_per_s", value=1234.0),
                ]
            )
        d.state(
            final,
            reason="done" if final == "SUCCEEDED" else "rank 0 raised",
            error=None if final == "SUCCEEDED" else "RuntimeError: out of patience",
        )

    for final, want in (("SUCCEEDED", 0), ("FAILED", 1)):
        before = {r.job_id for r in srv.launcher.submits}
        t = threading.Thread(
            target=lambda f=final, b=before: drive(
                wait_for(
                    lambda: next(
                        (r.job_id for r in srv.launcher.submits if r.job_id not in b), None
                    )
                ),
                f,
            )
        )
        t.start()
        code, out, _ = run(capsys, "submit", PASSKEY, "--follow")
        t.join(timeout=20)
        assert code == want, out
        assert f"{final}" in out and "final loss 2.1000" in out
        assert "tokens_per_s 1.23k" in out  # the catalog's progress metrics, in its formats
        if final == "FAILED":
            assert "out of patience" in out and "ringtrain logs" in out


def test_plan(srv, capsys):
    code, out, _ = run(capsys, "plan", PASSKEY)
    assert (
        code == 0
        and "OK" in out
        and "STRICT_PACK" in out
        and "rank 1" in out
        and "memory per rank" in out
    )
    assert "formula" in out
    code, out, _ = run(capsys, "plan", str(ROOT / "examples" / "passkey-128k-gpu.yaml"))
    assert code == 1 and "CANNOT RUN" in out and "never be placed" in out
    code, out, _ = run(capsys, "plan", PASSKEY, "--json")
    assert json.loads(out)["memory"]["param_count"] > 0


def test_errors_tell_what_to_do(srv, capsys, tmp_path, monkeypatch):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\ndata: {kind: passkey, seq_len: 510}\nparallel: {ring_size: 2}\n")
    code, _, err = run(capsys, "submit", str(bad))
    assert code == 1 and "data.seq_len" in err
    code, _, err = run(capsys, "status", "jnothere")
    assert code == 1 and "not found" in err and "ringtrain list" in err
    code, _, err = run(capsys, "list", "--token", "wrong-token-123")
    assert code == 1 and "invalid API token" in err and "RINGTRAIN_TOKEN" in err
    code, _, err = run(capsys, "list", "--url", "http://127.0.0.1:9")
    assert code == 3 and "cannot reach ringtrain" in err and "RINGTRAIN_URL" in err
    with pytest.raises(SystemExit):
        main(["submit", str(tmp_path / "missing.yaml")])


def test_console_script_help():
    t = time.time()
    r = subprocess.run(
        [sys.executable, "-m", "api.cli", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert r.returncode == 0
    for cmd in ("serve", "demo", "submit", "list", "status", "cancel", "logs", "plan"):
        assert cmd in r.stdout
    assert time.time() - t < 60


def test_status_list_and_follow_show_metrics_as_the_catalog_says(srv, capsys):
    """Units, formats, grid tables and list columns come from GET /v1/metrics/catalog."""
    code, out, _ = run(capsys, "submit", PASSKEY)
    job_id = out.split()[1]
    d = Driver(srv, job_id)
    d.state("RUNNING", reason="placed")
    cells = [
        d.item("metric", step=4, name=f"passkey_acc/len={n}/depth={dp}", value=v)
        for n, dp, v in ((1024, "0.50", 0.5), (128, "0.50", 1.0), (256, "0.00", 0.25))
    ]
    d.post(
        [
            d.item("metric", step=0, name="verify_max_rel_err", value=3.2e-7),
            d.item("metric", step=4, name="loss", value=2.1),
            d.item("metric", step=4, name="tokens_per_s", value=52_340.0),
            d.item("metric", step=4, name="step_time_s", value=0.31),
            d.item("metric", step=4, name="mem_peak_bytes", value=3 * 2**30, rank=0),
            d.item("metric", step=4, name="val_loss/pos=1024", value=2.0),
            d.item("metric", step=4, name="val_loss/pos=256", value=2.5),
            d.item("metric", step=4, name="not_in_catalog", value=1.5),
            *cells,
        ]
    )
    code, out, _ = run(capsys, "status", job_id)
    assert code == 0
    spec = yaml.safe_load(Path(PASSKEY).read_text())
    par = spec["parallel"]
    assert (
        f"  parallel  dp {par.get('data_parallel', 1)} x ring {par['ring_size']} x ulysses 1"
        f" x tensor 1 ({par['layout']}), seq_len {spec['data']['seq_len']}\n"
    ) in out
    knobs = spec.get("train", {})
    assert (
        f"  memory    activation_checkpointing {knobs.get('activation_checkpointing', 'none')}, "
        f"tiled_mlp {knobs.get('tiled_mlp', 'off')}, offload_activations false\n"
    ) in out
    metric_lines = out.split("  created")[1].split("\n", 1)[1].split("  history")[0].splitlines()
    assert metric_lines == [
        "  verified  not yet",  # one verify_* point is not a verification (verify_passed is missing)
        "  loss               2.1000 nats/token  (step 4)",
        "  tokens_per_s       52.34k             (step 4)",
        "  step_time_s        310 ms             (step 4)",
        "  val_loss/pos=256   2.5000 nats/token  (step 4)",
        "  val_loss/pos=1024  2.0000 nats/token  (step 4)",
        "  Retrieval accuracy by context length (rows) and needle depth (columns) (step 4)",
        "     len \\ depth    0.00    0.50",
        "             128       -    100%",
        "             256     25%       -",
        "            1024       -     50%",
        "  verify_max_rel_err 3.20e-07           (step 0)",
        "  not_in_catalog     1.5                (step 4)",
    ]
    code, out, _ = run(capsys, "list")
    head, row = out.splitlines()[:2]
    assert head.split() == ["ID", "STATE", "STEP", "LOSS", "TOKENS_PER_S", "NAME"]
    assert row.split()[3:5] == ["2.1000", "52.34k"]


def test_list_filters_by_verification(srv: Server, capsys: pytest.CaptureFixture[str]) -> None:
    """`ringtrain list --verification passed|failed`: only the jobs whose pre-training check had
    that outcome (a job that has not verified matches neither)."""
    jobs: dict[str, str] = {}
    c = srv.client()
    for name, passed in (("verified", True), ("diverged", False), ("unchecked", None)):
        code, out, _ = run(capsys, "submit", PASSKEY, "--json")
        assert code == 0
        jid = jobs[name] = json.loads(out)["id"]
        if passed is None:
            continue
        wait_for(lambda jid=jid: c.get(f"/v1/jobs/{jid}").json()["state"] == "PLACING")
        d = Driver(srv, jid)
        assert d.state("RUNNING", reason="placed").status_code == 200
        values = {"verify_max_rel_err": 6.1e-7 if passed else 0.47, "verify_tolerance": 1e-4,
                  "verify_passed": float(passed), "verify_tokens": 128.0}  # fmt: skip
        points = [d.item("metric", step=0, name=k, value=v) for k, v in values.items()]
        assert d.post(points).status_code == 200
        if not passed:
            error = "rank 0: VerificationFailed: verification failed before step 1: ..."
            failed = d.state("FAILED", reason=f"training failed: {error}", error=error)
            assert failed.status_code == 200

    def listed(*argv: str) -> list[str]:
        code, out, _ = run(capsys, "list", "--json", *argv)
        assert code == 0
        return [j["id"] for j in json.loads(out)["jobs"]]

    assert listed("--verification", "passed") == [jobs["verified"]]
    assert listed("--verification", "failed") == [jobs["diverged"]]
    assert listed("--verification", "failed", "--state", "FAILED") == [jobs["diverged"]]
    assert listed("--verification", "passed", "--state", "FAILED") == []
    assert sorted(listed()) == sorted(jobs.values())
    code, out, _ = run(capsys, "list", "--verification", "failed")  # the table
    assert code == 0 and jobs["diverged"] in out
    assert jobs["verified"] not in out and jobs["unchecked"] not in out
    code, out, _ = run(capsys, "list", "--verification", "passed", "--state", "FAILED")
    assert code == 0 and out.startswith("no jobs match")
    with pytest.raises(SystemExit) as e:  # argparse: only what the API accepts
        run(capsys, "list", "--verification", "maybe")
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_format_value_known_answers():
    from api.cli import format_value
    from api.routers.metrics import MetricInfo
    from workers.metrics import catalog_json

    info = {m["name"]: MetricInfo.model_validate(m) for m in catalog_json()["metrics"]}
    assert format_value(info["loss"], 2.1) == "2.1000"
    assert format_value(info["lr"], 3e-4) == "3.0e-04"
    assert format_value(info["grad_norm"], 0.123456) == "0.1235"
    assert format_value(info["tokens_per_s"], 999.0) == "999"
    assert format_value(info["tokens_per_s"], 1.5e9) == "1.5G"
    assert format_value(info["step_time_s"], 2.5) == "2.5 s"
    assert format_value(info["mem_peak_bytes"], 1536.0) == "1.5 KiB"
    assert format_value(info["mem_peak_bytes"], 100.0) == "100 B"
    assert format_value(info["passkey_acc"], 1 / 3) == "33.3%"
    assert format_value(info["passkey_acc"], 0.75) == "75%"
    assert format_value(None, 1234.5678) == "1235"
    assert format_value(info["loss"], None) == "nan"
