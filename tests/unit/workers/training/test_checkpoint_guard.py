"""A resume on one process continues exactly: same losses, same weights, and the LR schedule picks up at
the saved step (hand-computed values), not at step 0.

The bit-exact resume tests in test_checkpoint.py spawn processes and are in the slow tier; this one
runs in-process in seconds so that the fast tier sees a resume that drops the scheduler, optimizer or
model state.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.trainutil import final_weights, one_thread, tiny_spec
from workers.protocol import MetricPoint
from workers.training.checkpoint import list_steps
from workers.training.trainer import run_training

assert one_thread  # autouse fixture, imported to apply to this module

# tiny_spec's schedule: lr 3e-3, warmup 2, 6 steps, min_lr_ratio 0.1 (the default).
# warmup (k + 1) / 2, then 0.1 + 0.45 (1 + cos(pi (k - 2) / 4)); cos(pi/4) = 0.70710678
LR = [1.5e-3, 3e-3, 3e-3, 3e-3 * (0.1 + 0.45 * 1.70710678)]


def _series(points: list[MetricPoint], name: str) -> list[tuple[int, float]]:
    return [(p.step, p.value) for p in points if p.name == name]


def test_resume_continues_the_loss_the_weights_and_the_lr_schedule(tmp_path: Path) -> None:
    spec = tiny_spec(data={"seq_len": 128}, train={"batch_size": 1})
    spec = spec.model_copy(update={"verify": spec.verify.model_copy(update={"enabled": False})})
    straight: list[MetricPoint] = []
    run_training(spec, checkpoint_dir=tmp_path / "a", emit=straight.append, max_steps=4)

    split: list[MetricPoint] = []
    first = run_training(spec, checkpoint_dir=tmp_path / "b", emit=split.append, max_steps=2)
    assert first.final_step == 2 and list_steps(tmp_path / "b") == [2]
    again = run_training(spec, checkpoint_dir=tmp_path / "b", emit=split.append, max_steps=4)
    assert again.resumed_from == 2 and again.final_step == 4

    assert [v for _, v in _series(split, "lr")] == pytest.approx(LR, rel=1e-6)
    assert [v for _, v in _series(straight, "lr")] == pytest.approx(LR, rel=1e-6)
    assert _series(split, "loss") == _series(straight, "loss")  # bit-exact on one process
    a, b = final_weights(tmp_path / "a"), final_weights(tmp_path / "b")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
