"""`init_from`: a job starts from another run's checkpoint on its own shape. `full` continues the
source's loss curve step for step on another ring size; `weights` starts step 1 from exactly the
source's weights, also with a longer sequence and another RoPE base (a context extension)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.dist import run_distributed
from tests.support.trainutil import loss_of, one_thread, series, tiny_spec, train
from workers.config import JobSpec
from workers.training.checkpoint import read_weights

assert one_thread  # autouse fixture, imported to apply to this module


def _spec(**over: object) -> JobSpec:
    base = {
        "data": {"seq_len": 128},
        "train": {"steps": 8, "lr": 3e-3, "warmup_steps": 2},
        "checkpoint": {"every_steps": 4, "keep": 3},
    }
    return tiny_spec(**{**base, **over})


@pytest.mark.multiprocess
def test_full_continues_the_curve_on_another_ring_and_weights_start_from_the_weights(
    tmp_path: Path,
) -> None:
    src = tmp_path / "a"
    a = _spec()
    whole = run_distributed(train, 1, a.model_dump_json(), str(src), None)[0]
    curve = series(whole["points"], "loss")
    assert len(curve) == 8 and curve[7] < curve[0]

    full = _spec(
        parallel={"ring_size": 2},
        init_from={"checkpoint": str(src), "step": 4, "state": "full"},
    )
    got = run_distributed(train, 2, full.model_dump_json(), str(tmp_path / "b"), None)[0]
    losses = {p["step"]: p["value"] for p in got["points"] if p["name"] == "loss"}
    assert sorted(losses) == [5, 6, 7, 8]  # the step count continues; nothing is re-run
    for step in range(5, 9):
        assert losses[step] == pytest.approx(curve[step - 1], rel=2e-5), step

    longer = _spec(
        data={"seq_len": 256},
        model={"rope_theta": 40000.0},
        parallel={"ring_size": 2},
        train={"steps": 2, "lr": 3e-3, "warmup_steps": 0},
        init_from={"checkpoint": str(src), "step": 8, "state": "weights"},
    )
    assert longer.model.rope_theta != a.model.rope_theta and longer.model.d_model == a.model.d_model
    got = run_distributed(train, 2, longer.model_dump_json(), str(tmp_path / "c"), None)[0]
    first = next(p["value"] for p in got["points"] if p["name"] == "loss" and p["step"] == 1)
    expected = loss_of(read_weights(src, 8), longer, 1)
    assert first == pytest.approx(expected, rel=1e-4)
    assert first != pytest.approx(curve[0], rel=1e-2)  # not the scratch model's loss
    lr = next(p["value"] for p in got["points"] if p["name"] == "lr" and p["step"] == 1)
    assert lr == pytest.approx(3e-3)  # its own schedule (no warmup here), not the source's
