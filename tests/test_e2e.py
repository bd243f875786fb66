"""End to end: real local Ray (session head from tests.ray_fixtures) + real server + real driver + tiny jobs."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from api.cli import main
from api.client import Client
from service.ray_jobs import RayJobLauncher
from tests.api_harness import ALICE, running, wait_for
from tests.ray_fixtures import ray_head  # noqa: F401  (session fixture)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent


def tiny(steps: int, name: str = "e2e") -> dict:
    return {
        "name": name,
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
        "data": {"kind": "passkey", "seq_len": 128},
        "parallel": {"ring_size": 2},
        "train": {"steps": steps, "lr": 1e-3},
        "checkpoint": {"every_steps": 0},
        "eval": {"enabled": False},
        "resources": {"accelerator": "cpu", "cpus_per_worker": 1},
        "max_restarts": 0,
    }


@pytest.fixture
def launcher(ray_head):  # noqa: F811
    return RayJobLauncher(ray_head.jobs_url, auth_token=ray_head.auth_token, python=sys.executable)


def e2e_server(tmp_path: Path, launcher, **over):
    return running(
        tmp_path,
        launcher,
        reconcile_interval_s=1.0,
        reconcile_grace_s=10.0,
        scheduler_interval_s=0.2,
        cancel_grace_s=60.0,
        placement_timeout_s=120.0,
        **over,
    )


def test_submit_succeeds_with_metrics_and_cli(tmp_path, launcher, capsys, monkeypatch):
    with e2e_server(tmp_path, launcher) as srv:
        c = Client(srv.url, ALICE)
        job = c.submit(tiny(4))
        end = [e for e in c.events(job.id, read_timeout=120)][-1]
        got = c.get_job(job.id)
        assert end.data["state"] == "SUCCEEDED", (got.error, c.logs(job.id).driver_log)
        assert got.step == got.total_steps == 4
        assert len(got.placement) == 2 and {p.rank for p in got.placement} == {0, 1}
        names = {p.name for p in c.iter_metrics(job.id)}
        assert {"loss", "tokens_per_s"} <= names
        losses = [p for p in c.iter_metrics(job.id, names=["loss"])]
        steps = [p.step for p in losses]
        assert len(steps) == 4 and steps == sorted(set(steps)) and steps[-1] == 4
        states = [t.to_state.value for t in got.transitions]
        assert states[0] == "QUEUED" and states[-1] == "SUCCEEDED" and "RUNNING" in states
        # the CLI against the same server: plan, then submit --follow
        monkeypatch.setenv("RINGTRAIN_URL", srv.url)
        monkeypatch.setenv("RINGTRAIN_TOKEN", ALICE)
        spec = tmp_path / "tiny.yaml"
        import yaml

        spec.write_text(yaml.safe_dump(tiny(3, "cli")))
        assert main(["plan", str(spec)]) == 0
        out = capsys.readouterr().out
        assert "placement" in out and "memory per rank" in out
        assert main(["submit", str(spec), "--follow"]) == 0
        out = capsys.readouterr().out
        assert "SUCCEEDED" in out and "final loss" in out


def test_cancel_running_job(tmp_path, launcher):
    with e2e_server(tmp_path, launcher) as srv:
        c = Client(srv.url, ALICE)
        job = c.submit(tiny(100000, "long"))
        wait_for(lambda: c.get_job(job.id).state.value == "RUNNING", timeout=120, interval=0.5)
        t = time.time()
        c.cancel(job.id)
        c.cancel(job.id)
        got = c.wait(job.id, timeout=90, poll_s=0.5)
        assert got.state.value == "CANCELLED", got.error
        assert time.time() - t < 90
        info = launcher.status(got.submission_id)
        wait_for(lambda: launcher.status(got.submission_id).status.finished, timeout=60, interval=1)
        assert info is not None


def test_control_plane_restart_reattaches(tmp_path, launcher):
    with e2e_server(tmp_path, launcher) as srv:
        port = srv.settings.port
        c = Client(srv.url, ALICE)
        job = c.submit(tiny(40, "restart"))
        wait_for(lambda: c.get_job(job.id).step >= 1, timeout=120, interval=0.5)
    time.sleep(3)  # the control plane is down; the driver buffers its reports and retries
    with e2e_server(tmp_path, launcher, port=port) as srv:
        c = Client(srv.url, ALICE)
        got = c.wait(job.id, timeout=240, poll_s=1)
        assert got.state.value in ("SUCCEEDED", "FAILED")
        if got.state.value == "FAILED":  # allowed only with a reason a person can act on
            assert got.error
        else:
            steps = [p.step for p in c.iter_metrics(job.id, names=["loss"])]
            assert len(steps) == 40 and steps == sorted(set(steps))  # nothing lost, nothing doubled across the restart
