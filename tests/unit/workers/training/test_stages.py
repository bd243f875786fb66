"""A staged job trains as its stages say: stage 2 starts from stage 1's last weights and optimizer
state resharded onto its own ring, with its own length, RoPE base and learning-rate schedule, and
the curve equals the same stages on one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.dist import run_distributed
from tests.support.trainutil import loss_of, one_thread, series, tiny_spec, train
from workers.config import JobSpec
from workers.training.checkpoint import latest_step, read_weights
from workers.training.optim import lr_at

assert one_thread  # autouse fixture, imported to apply to this module


def _staged(ring1: int, ring2: int) -> JobSpec:
    return tiny_spec(
        data={"seq_len": 96},
        train={"steps": 4, "lr": 3e-3, "warmup_steps": 1},
        checkpoint={"every_steps": 2, "keep": 3},
        stages=[
            {"steps": 2, "name": "short", "parallel": {"ring_size": ring1}},
            {
                "steps": 2,
                "data": {"seq_len": 192},
                "model": {"rope_theta": 40000.0},
                "parallel": {"ring_size": ring2},
                "train": {"lr": 1e-3, "warmup_steps": 2},
            },
        ],
    )


def _at(points: list[dict], name: str) -> dict[int, float]:
    return {p["step"]: p["value"] for p in points if p["name"] == name and p.get("rank") is None}


@pytest.mark.multiprocess
def test_stages_on_rings_of_2_then_3_follow_the_one_process_curve(tmp_path: Path) -> None:
    one = _staged(1, 1)
    ref = run_distributed(train, 1, one.model_dump_json(), str(tmp_path / "one"), None)[0]
    # one process runs both stages in one call: the same number of ranks
    assert ref["result"]["final_step"] == 4
    loss = series(ref["points"], "loss")
    assert len(loss) == 4
    assert series(ref["points"], "stage") == [0, 0, 1, 1]
    first, second = (s.spec for s in one.stage_plan())
    # each stage's own schedule: warmup 1 then decay over 2 steps, then warmup 2 at its own lr
    want_lr = [lr_at(k, first.train) for k in range(2)] + [lr_at(k, second.train) for k in range(2)]
    assert series(ref["points"], "lr") == pytest.approx(want_lr, rel=1e-6)
    assert want_lr[2] == pytest.approx(1e-3 / 2)
    # stage 2's first step runs stage 1's last weights on stage 2's length and RoPE base
    end_of_1 = read_weights(tmp_path / "one", 2)
    assert loss[2] == pytest.approx(loss_of(end_of_1, second, 3), rel=1e-4)
    assert loss[2] != pytest.approx(loss_of(end_of_1, first, 3), rel=1e-3)

    ckpt = str(tmp_path / "ring")
    staged = _staged(2, 3).model_dump_json()
    a = run_distributed(train, 2, staged, ckpt, None)[0]
    # two ranks stop where the next stage needs three: the caller places it
    assert a["result"]["final_step"] == 2 and latest_step(ckpt) == 2
    b = run_distributed(train, 3, staged, ckpt, None)[0]
    assert b["result"]["final_step"] == 4
    got = {**_at(a["points"], "loss"), **_at(b["points"], "loss")}
    assert sorted(got) == [1, 2, 3, 4]
    for step in range(1, 5):
        assert got[step] == pytest.approx(loss[step - 1], rel=2e-5), step
    # the new shape is verified before its first step; stage 1's ring before step 1
    assert _at(a["points"], "verify_passed") == {0: 1.0}
    assert _at(b["points"], "verify_passed") == {2: 1.0}
    config = json.loads((Path(ckpt) / "model" / "config.json").read_text())
    theta = config.get("rope_parameters", config).get("rope_theta")  # transformers 5 nests it
    assert theta == 40000.0 and config["max_position_embeddings"] >= 192
