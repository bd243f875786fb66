"""REST evaluations on a real Ray head: POST /v1/evals runs `python -m workers.evals` on a ring of two
(torchrun inside a Ray job) over a tiny checkpoint the test writes, and the row's result is the
report the same evaluation gives in this process on one rank."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from service.local_ray import RayHead
from service.ray_jobs import RayJobLauncher
from tests.support.api_harness import running, wait_for
from tests.support.hf_fixtures import write_checkpoint
from workers.evals.run import evaluate
from workers.evals.scoring import effective_length

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
TASK = "niah_single_noise"


def test_an_eval_on_the_cluster_reports_what_the_evaluation_prints(
    ray_head: RayHead, tmp_path: Path
) -> None:
    launcher = RayJobLauncher(
        ray_head.jobs_url,
        auth_token=ray_head.auth_token,
        python=sys.executable,
        extra_env={"PYTHONPATH": str(ROOT)},
    )
    model = write_checkpoint(tmp_path / "model", "llama", max_position_embeddings=2048)
    body = {
        "model": str(model),
        "lengths": [512],
        "samples": 1,
        "ring_size": 2,
        "seed": 1,
        "tasks": [TASK],
    }
    t0 = time.perf_counter()
    with running(tmp_path, launcher, data_roots=[str(tmp_path)]) as srv, srv.client() as c:
        r = c.post("/v1/evals", json=body)
        assert r.status_code == 201, r.text
        ev = r.json()
        assert ev["state"] in ("QUEUED", "RUNNING") and ev["result"] is None, ev
        # the reference, on one rank in this process, while the cluster runs the ring of two
        report, _ = evaluate(model, [512], 1, tasks=[TASK], seed=1)
        final = wait_for(
            lambda: (
                (e := c.get(f"/v1/evals/{ev['id']}").json())["state"] in ("SUCCEEDED", "FAILED")
                and e
            ),
            timeout=120,
            interval=0.5,
        )
        listed = c.get("/v1/evals").json()
    print(f"eval on the cluster: {time.perf_counter() - t0:.1f} s")
    assert final["state"] == "SUCCEEDED" and final["error"] is None, final
    assert final["result"] == report
    assert final["progress"] == {"samples_done": 1, "samples_total": 1}  # rank 0 reports
    result = final["result"]
    assert set(result["tasks"]) == {TASK} and set(result["by_length"]) == {"512"}
    assert 0.0 <= result["by_length"]["512"] <= 1.0
    assert result["by_length"]["512"] == result["tasks"][TASK]["512"]  # the mean of one task
    assert result["effective_length"] == effective_length(result["by_length"], 0.856)
    assert [e["id"] for e in listed] == [ev["id"]] and listed[0]["result"] == report
