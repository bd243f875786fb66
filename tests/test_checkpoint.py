"""Checkpoints: atomic step directories, retention, and bit-exact resume in fresh processes."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.dist import run_distributed
from tests.trainutil import final_weights, one_thread, series, tiny_spec, train
from workers.models import build_model
from workers.training.checkpoint import latest_step, list_steps, load_checkpoint, save_checkpoint, step_dir
from workers.training.trainer import run_training

assert one_thread  # autouse fixture, imported to apply to this module


def _model(seed: int) -> torch.nn.Module:
    return build_model(tiny_spec().model, seed)


def test_save_load_keep_and_atomicity(tmp_path):
    model = _model(1)
    torch.manual_seed(123)
    for step in (5, 10, 15, 20):
        save_checkpoint(tmp_path, step, model, {"extra": {"loss": float(step)}}, keep=2)
    assert list_steps(tmp_path) == [15, 20] and latest_step(tmp_path) == 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000015", "step-000020"]  # no temp dirs left

    # A crash mid-write leaves a hidden temp dir, or a step dir without its files: neither is picked up.
    (tmp_path / ".tmp-step-000030").mkdir()
    (tmp_path / ".tmp-step-000030" / "model.safetensors").write_bytes(b"partial")
    (step_dir(tmp_path, 40)).mkdir()
    assert latest_step(tmp_path) == 20
    assert latest_step(tmp_path / "missing") is None

    expected_rng = torch.rand(3)  # what the generator produces right after the checkpoint's RNG state
    other = _model(2)
    assert not torch.equal(other.tok_emb.weight, model.tok_emb.weight)
    state = load_checkpoint(tmp_path, 20, other)
    assert state["step"] == 20 and state["extra"]["loss"] == 20.0
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # save_checkpoint(…, 20) ran after torch.rand was seeded and before expected_rng was drawn
    assert torch.equal(torch.rand(3), expected_rng)

    # Re-saving an existing step replaces it whole.
    save_checkpoint(tmp_path, 20, other, {"extra": {"loss": -1.0}}, keep=2)
    assert load_checkpoint(tmp_path, 20, model)["extra"]["loss"] == -1.0


def test_stop_event_checkpoints_and_resumes(tmp_path):
    spec = tiny_spec(data={"seq_len": 128})
    stop = threading.Event()
    stop.set()  # set before the first step: the run finishes that step, checkpoints, returns
    points = []
    result = run_training(spec, checkpoint_dir=tmp_path, emit=points.append, stop=stop)
    assert result.final_step == 1 and result.resumed_from is None and latest_step(tmp_path) == 1
    assert [p.step for p in points if p.name == "loss"] == [1]
    again = run_training(spec, checkpoint_dir=tmp_path, emit=points.append, max_steps=3)
    assert again.resumed_from == 1 and again.final_step == 3
    assert [p.step for p in points if p.name == "loss"] == [1, 2, 3]
    assert again.attention_backend


def _straight_then_first_half(rank: int, world: int, spec: str, root: str, k: int) -> tuple[dict, dict]:
    """One spawn for two runs: all 2K steps into root/a, then K steps into root/b."""
    return train(rank, world, spec, f"{root}/a", None), train(rank, world, spec, f"{root}/b", k)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_resume_is_bit_exact_in_new_processes(tmp_path):
    """2K steps straight vs K steps, new processes, K more: identical bits (ring of 3, striped)."""
    k = 3
    spec = tiny_spec(
        parallel={"ring_size": 3, "layout": "striped"},
        checkpoint={"every_steps": 2, "keep": 3},
        train={"steps": 2 * k, "warmup_steps": 2},
    ).model_dump_json()
    straight, first = zip(*run_distributed(_straight_then_first_half, 3, spec, str(tmp_path), k), strict=True)
    second = run_distributed(train, 3, spec, str(tmp_path / "b"), None)  # fresh processes resume at K

    assert first[0]["result"]["final_step"] == k and first[0]["result"]["resumed_from"] is None
    assert second[0]["result"]["resumed_from"] == k and second[0]["result"]["final_step"] == 2 * k
    assert list_steps(tmp_path / "b") == [k, 4, 6]  # periodic 2, 4, 6 + end-of-run save at K; keep = 3
    full = series(straight[0]["points"], "loss")
    resumed = series(first[0]["points"], "loss") + series(second[0]["points"], "loss")
    assert len(full) == 2 * k and full[-1] < full[0]
    assert resumed == full  # exact float equality, step by step
    assert series(second[0]["points"], "lr") == series(straight[0]["points"], "lr")[k:]
    a, b = final_weights(tmp_path / "a"), final_weights(tmp_path / "b")
    for name in a:
        assert torch.equal(a[name], b[name]), name
