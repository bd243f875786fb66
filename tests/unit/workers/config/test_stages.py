"""Stages in a job spec: steps numbered across the job, each stage's effective spec, and bad
stages refused at `stages.<i>.<field>`."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from workers.config import JobSpec


def _spec(stages: list[dict[str, Any]], **over: Any) -> JobSpec:
    base: dict[str, Any] = {
        "name": "ext",
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2},
        "data": {"kind": "passkey", "seq_len": 128, "key_digits": 3},
        "train": {"lr": 1e-3, "warmup_steps": 1, "batch_size": 2},
        "stages": stages,
    }
    return JobSpec.model_validate({**base, **over})


def _error(stages: list[dict[str, Any]], **over: Any) -> tuple[tuple[Any, ...], str]:
    with pytest.raises(ValidationError) as e:
        _spec(stages, **over)
    err = e.value.errors()[0]
    return err["loc"], err["msg"]


def test_steps_are_numbered_across_the_job_and_each_stage_runs_its_own_spec() -> None:
    spec = _spec(
        [
            {"steps": 12, "name": "8k"},
            {
                "steps": 5,
                "data": {"seq_len": 384},
                "model": {"rope_theta": 40000.0},
                "parallel": {"ring_size": 3},
                "train": {"lr": 5e-4, "warmup_steps": 2},
            },
            {"steps": 7, "parallel": {"ring_size": 2, "data_parallel": 2}},
        ]
    )
    stages = spec.stage_plan()
    assert [(s.index, s.name, s.start_step, s.end_step) for s in stages] == [
        (0, "8k", 0, 12),
        (1, "stage 2", 12, 17),
        (2, "stage 3", 17, 24),
    ]
    assert spec.train.steps == 24  # the sum, filled in
    first, second, third = (s.spec for s in stages)
    assert (first.data.seq_len, first.parallel.ring_size, first.model.rope_theta) == (128, 1, 10000)
    assert (second.data.seq_len, second.parallel.ring_size, second.model.rope_theta) == (
        384,
        3,
        40000.0,
    )
    # each stage's schedule is its own: its length, its warmup and learning rate
    assert (first.train.steps, first.train.lr, first.train.warmup_steps) == (12, 1e-3, 1)
    assert (second.train.steps, second.train.lr, second.train.warmup_steps) == (5, 5e-4, 2)
    # an override holds for its stage only; the next starts again from the job's sections
    assert (third.data.seq_len, third.model.rope_theta, third.train.lr) == (128, 10000, 1e-3)
    assert (third.parallel.ring_size, third.parallel.data_parallel) == (2, 2)
    assert all(s.spec.stages is None for s in stages)
    assert spec.world_size == 4  # the largest stage's
    assert spec.largest_stage().index == 2
    assert [spec.stage_at(k).index for k in (0, 11, 12, 16, 17, 23, 24)] == [0, 0, 1, 1, 2, 2, 2]
    again = JobSpec.model_validate_json(spec.model_dump_json())
    assert again == spec and again.stage_plan()[1].spec == second


def test_a_job_without_stages_is_one_stage_of_its_own_spec() -> None:
    spec = JobSpec.model_validate({"name": "plain", "train": {"steps": 9}})
    (only,) = spec.stage_plan()
    assert (only.start_step, only.end_step, only.spec) == (0, 9, spec)


def test_train_steps_is_the_sum_of_the_stages_or_refused() -> None:
    assert _spec([{"steps": 3}, {"steps": 4}], train={"steps": 7}).train.steps == 7
    loc, msg = _error([{"steps": 3}, {"steps": 4}], train={"steps": 8})
    assert loc == ("train", "steps") and "(7)" in msg


@pytest.mark.parametrize(
    ("stages", "loc", "says"),
    [
        ([{"steps": 0}], ("stages", 0, "steps"), "greater than or equal to 1"),
        (
            [{"steps": 2}, {"steps": 2, "model": {"n_layers": 3}}],
            ("stages", 1, "model", "n_layers"),
            "cannot change",
        ),
        (
            [{"steps": 2, "model": {"vocab_size": 512}}],
            ("stages", 0, "model", "vocab_size"),
            "cannot change",
        ),
        ([{"steps": 2, "train": {"steps": 3}}], ("stages", 0, "train", "steps"), "own `steps`"),
        ([{"steps": 2, "train": {"seed": 3}}], ("stages", 0, "train", "seed"), "the job's"),
        # the stage's own shape is checked by every rule of a job: 200 is not divisible by 2 x 3
        (
            [{"steps": 2}, {"steps": 2, "data": {"seq_len": 200}, "parallel": {"ring_size": 3}}],
            ("stages", 1, "data", "seq_len"),
            "divisible by 6",
        ),
        (
            [{"steps": 2, "train": {"warmup_steps": 5}}],
            ("stages", 0, "train", "warmup_steps"),
            "<= train.steps",
        ),
        (
            [{"steps": 2, "data": {"seq_len": 192}, "parallel": {"tensor_size": 3}}],
            ("stages", 0, "parallel", "tensor_size"),
            "heads",
        ),
        ([{"steps": 2, "rope": 1}], ("stages", 0, "rope"), "Extra inputs"),
        ([], ("stages",), "at least 1"),
    ],
)
def test_a_bad_stage_is_refused_at_its_field(
    stages: list[dict[str, Any]], loc: tuple[Any, ...], says: str
) -> None:
    got_loc, msg = _error(stages)
    assert got_loc == loc and says in msg, (got_loc, msg)
