"""A job with stages through the real server: each stage's `ring_size: auto` fitted on its own and
stored as that stage's overrides, the job's JSON lists its stages, `ringtrain status` prints them,
and a stage that can never be placed or changes what cannot change is a 422 at its field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from api.cli import main
from service import capacity
from service.launcher import ClusterInfo, NodeInfo
from service.planner import GIB
from tests.support.api_harness import ALICE, RecordingLauncher, running
from workers.config import JobSpec

NODES = [
    NodeInfo(f"n{i}", f"10.0.0.{i}", True, 8, 8, 0, 0, memory_bytes=12 * GIB) for i in range(2)
]
SPEC: dict[str, Any] = {
    "name": "extend",
    "model": {"d_model": 256, "n_layers": 4, "n_heads": 8},
    "data": {"kind": "passkey", "seq_len": 4096},
    "parallel": {"ring_size": "auto"},
    "stages": [
        {"steps": 4, "name": "4k"},
        {"steps": 2, "name": "256k", "data": {"seq_len": 262144}, "model": {"rope_theta": 5e5}},
    ],
}


def test_each_stage_is_fitted_stored_and_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with running(tmp_path, RecordingLauncher(nodes=NODES)) as srv:
        c = srv.client()
        r = c.post("/v1/jobs", json=SPEC)
        assert r.status_code == 201, r.text
        job = r.json()
        stored = JobSpec.model_validate(job["spec"])
        assert stored.train.steps == 6 and not stored.parallel.ring_auto
        # what the planner chooses for each stage alone, against 12 GiB / 8 CPUs per bundle
        cluster = ClusterInfo(nodes=NODES)
        want = [
            capacity.fit_spec(s.spec, cluster)[0] for s in JobSpec.model_validate(SPEC).stage_plan()
        ]
        got = [s.spec for s in stored.stage_plan()]
        for w, g in zip(want, got, strict=True):
            assert g.parallel.ring_size == w.parallel.ring_size
            assert g.train.knobs == w.train.knobs
        assert (got[0].parallel.ring_size, got[0].train.knobs) != (
            got[1].parallel.ring_size,
            got[1].train.knobs,
        )
        assert [
            (s["index"], s["name"], s["start_step"], s["end_step"], s["seq_len"])
            for s in job["stages"]
        ] == [
            (0, "4k", 0, 4, 4096),
            (1, "256k", 4, 6, 262144),
        ]
        assert [s["state"] for s in job["stages"]] == ["QUEUED", "pending"] and job["stage"] == 0
        assert job["stages"][1]["world_size"] == got[1].parallel.world_size
        assert job["stages"][1]["parallel"]["ring_size"] == got[1].parallel.ring_size

        monkeypatch.setenv("RINGTRAIN_URL", srv.url)
        monkeypatch.setenv("RINGTRAIN_TOKEN", ALICE)
        assert main(["status", job["id"]]) == 0
        out = capsys.readouterr().out
        assert "stages    2, now 1: 4k" in out
        assert "256k" in out and "steps 5-6" in out and "seq_len 262144" in out


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"steps": 2, "parallel": {"ring_size": 64}}, "stages.1.parallel.ring_size", "CPU"),
    (
        {"steps": 2, "model": {"n_layers": 8}},
        "stages.1.model.n_layers",
        "cannot change between stages",
    ),
    ({"steps": 0}, "stages.1.steps", ""),
    (
        {"steps": 2, "data": {"seq_len": 1002}, "parallel": {"ring_size": 2}},
        "stages.1.data.seq_len",
        "divisible",
    ),
]


def test_a_bad_stage_is_a_422_at_its_field_and_nothing_is_created(tmp_path: Path) -> None:
    with running(tmp_path, RecordingLauncher(nodes=NODES)) as srv:
        c = srv.client()
        for stage, field, words in BAD:
            spec = {**SPEC, "parallel": {"ring_size": 1}, "stages": [{"steps": 3}, stage]}
            r = c.post("/v1/jobs", json=spec)
            assert r.status_code == 422, r.text
            err = r.json()["error"]
            assert err["field"] == field and words in err["message"], err
        assert c.get("/v1/jobs").json()["total"] == 0


@pytest.mark.parametrize(
    ("step", "state", "want", "current"),
    [
        (0, "RUNNING", ["RUNNING", "pending", "pending"], 0),
        (3, "RUNNING", ["RUNNING", "pending", "pending"], 0),
        (4, "PLACING", ["done", "PLACING", "pending"], 1),  # stage 1's last step done: stage 2 next
        (7, "FAILED", ["done", "done", "FAILED"], 2),
        (9, "SUCCEEDED", ["done", "done", "done"], 2),
    ],
)
def test_stage_states_follow_the_jobs_step(
    step: int, state: str, want: list[str], current: int
) -> None:
    from api.schemas import JobOut

    spec = JobSpec.model_validate(
        {**SPEC, "parallel": {"ring_size": 1}, "stages": [{"steps": 4}, {"steps": 3}, {"steps": 2}]}
    )
    row = {
        "id": "j1",
        "name": "extend",
        "owner": "alice",
        "state": state,
        "spec": spec.model_dump(mode="json"),
        "created_at": 0.0,
        "updated_at": 0.0,
        "step": step,
        "total_steps": 9,
        "placement": None,
        "error": None,
        "restarts": 0,
        "cancel_requested": False,
        "submission_id": None,
    }
    out = JobOut.model_validate(row)
    assert out.stages is not None and [s.state for s in out.stages] == want and out.stage == current
    assert [(s.start_step, s.end_step) for s in out.stages] == [(0, 4), (4, 7), (7, 9)]
