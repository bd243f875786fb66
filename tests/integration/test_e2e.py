"""End to end: real local Ray (session head from tests.support.ray_fixtures) + real server + real driver + tiny jobs.

A cancel on Ray (driver STOPPED, rank actors dead, placement group removed, cancel and stop idempotent) is checked
where the dashboard cancels a real Ray job (tests/integration/test_dashboard_ray.py), so it runs no job of its own
here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from api.cli import main
from api.client import Client
from service.ray_jobs import RayJobLauncher
from tests.support.api_harness import ALICE, running

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


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
def launcher(ray_head):
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
    """One job through the CLI (plan, then submit --follow), read back through the Python client:
    its events end SUCCEEDED, its placement, metrics and transitions are whole."""
    with e2e_server(tmp_path, launcher) as srv:
        monkeypatch.setenv("RINGTRAIN_URL", srv.url)
        monkeypatch.setenv("RINGTRAIN_TOKEN", ALICE)
        spec = tmp_path / "tiny.yaml"
        import yaml

        spec.write_text(yaml.safe_dump(tiny(4, "cli")))
        assert main(["plan", str(spec)]) == 0
        out = capsys.readouterr().out
        assert "placement" in out and "memory per rank" in out
        assert main(["submit", str(spec), "--follow"]) == 0
        out = capsys.readouterr().out
        assert "SUCCEEDED" in out and "final loss" in out

        c = Client(srv.url, ALICE)
        (job,) = c.list_jobs().jobs
        assert job.id in out  # the CLI names the job it submitted
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
