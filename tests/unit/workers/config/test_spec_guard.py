"""Job spec rules (workers/config/spec.py, sections.py, rules.py, stages.py) at their boundaries:
each rule refuses just past its limit, at the field it names, and accepts the limit itself. The
fast tier had the common cases; these are the edges a one-character slip moves."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from tests.support.trainutil import tiny_spec
from workers.config import JobSpec
from workers.config.rules import pipeline_problem, tensor_heads_problem, ulysses_heads_problem
from workers.config.sections import (
    EvalConfig,
    ParallelConfig,
    TokensData,
    TrainConfig,
)
from workers.config.stages import StageConfig, stage_at, with_overrides


def refused(where: str, **over: Any) -> str:
    """The message of the one error `tiny_spec(**over)` raises, which must be at `where`."""
    with pytest.raises(ValidationError) as e:
        tiny_spec(**over)
    errors = e.value.errors()
    assert [".".join(str(p) for p in err["loc"]) for err in errors] == [where], errors
    return str(errors[0]["msg"])


# -- rules.py, directly --------------------------------------------------------------------------
def _model(heads: int, kv: int, ffn: int = 64) -> Any:
    return SimpleNamespace(n_heads=heads, kv_heads=kv, ffn_hidden=ffn)


def test_tensor_split_needs_every_head_kind_and_the_mlp_divisible() -> None:
    assert tensor_heads_problem(_model(8, 4, 64), 4) is None
    assert "model.n_kv_heads (2)" in str(tensor_heads_problem(_model(8, 2, 64), 4))
    assert "the MLP's hidden size (100)" in str(tensor_heads_problem(_model(8, 8, 100), 8))


def test_ulysses_splits_each_tensor_ranks_heads() -> None:
    # 12 heads over tensor 2: 6 per tensor rank, which ulysses 4 does not divide
    why = ulysses_heads_problem(_model(12, 6), 4, tensor_size=2)
    assert str(why).startswith("model.n_heads (6 per tensor rank (tensor_size 2))")
    assert ulysses_heads_problem(_model(8, 2), 4) is None  # kv 2 divides ulysses 4: repeated
    assert ulysses_heads_problem(_model(8, 8), 4) is None
    assert "must divide one another" in str(ulysses_heads_problem(_model(6, 3), 2))


def _pp(size: int, m: int, batch: int, layers: int, schedule: str = "1f1b", **kw: Any) -> Any:
    parallel = ParallelConfig(pipeline_size=size, pipeline_schedule=schedule, **kw)
    return SimpleNamespace(
        parallel=parallel,
        train=TrainConfig(microbatches=m, batch_size=batch),
        model=SimpleNamespace(kind="native", n_layers=layers, tie_embeddings=False),
        eval=SimpleNamespace(enabled=False),
    )


def test_pipeline_rules_at_their_limits() -> None:
    assert pipeline_problem(_pp(2, 2, 2, 4)) is None  # as many microbatches as stages
    assert pipeline_problem(_pp(2, 1, 2, 4))[0] == "train.microbatches"  # type: ignore[index]
    # 4 rows over 2 replicas x 4 microbatches do not split evenly
    assert pipeline_problem(_pp(2, 4, 4, 4, data_parallel=2))[0] == "train.microbatches"  # type: ignore[index]
    assert pipeline_problem(_pp(2, 3, 3, 4, "interleaved_1f1b")) is None  # rounds of 1
    # interleaved on 2 ranks: 4 stages; 3 layers cannot fill them, 6 do not split evenly
    too_small = pipeline_problem(_pp(2, 2, 2, 3, "interleaved_1f1b"))
    assert too_small is not None and too_small[0] == "parallel.pipeline_size"
    uneven = pipeline_problem(_pp(2, 2, 2, 6, "interleaved_1f1b"))
    assert uneven is not None and uneven[0] == "parallel.pipeline_split"
    short = pipeline_problem(_pp(2, 2, 2, 4, pipeline_split=[1, 2]))
    assert short is not None and "sums to 3, not model.n_layers (4)" in short[2]
    assert pipeline_problem(_pp(2, 2, 2, 3, pipeline_split=[1, 2])) is None


# -- sections.py ---------------------------------------------------------------------------------
def test_section_fields_at_their_limits() -> None:
    assert TokensData(path="/d", validation=0.5).validation == 0.5
    with pytest.raises(ValidationError, match=r"between 0 and 0\.5"):
        TokensData(path="/d", validation=0.51)
    assert EvalConfig(depths=[0.0, 1.0]).depths == [0.0, 1.0]
    assert TrainConfig(activation_checkpointing=True).activation_checkpointing == "full"
    with pytest.raises(ValidationError, match="tiled_mlp must be off, auto or a tile count"):
        TrainConfig(tiled_mlp=True)
    with pytest.raises(ValidationError, match="printable and not blank"):
        StageConfig(name="   ", steps=1)


def test_virtual_stages_of_each_schedule() -> None:
    def stages(size: int, schedule: str) -> tuple[int, int]:
        p = ParallelConfig(pipeline_size=size, pipeline_schedule=schedule)
        return p.virtual_stages, p.pipeline_stages

    assert stages(2, "1f1b") == (1, 2)
    assert stages(2, "interleaved_1f1b") == (2, 4)
    assert stages(3, "zero_bubble") == (2, 6)
    assert stages(1, "interleaved_1f1b") == (2, 1)  # no pipeline: one stage


# -- spec.py -------------------------------------------------------------------------------------
def test_job_rules_at_their_limits() -> None:
    assert tiny_spec(train={"warmup_steps": 6}).train.warmup_steps == 6  # = steps
    assert "warmup_steps must be <= train.steps" in refused(
        "train.warmup_steps", train={"warmup_steps": 7}
    )
    # ring 2, zigzag: every length must divide into 4 chunks
    assert "divisible by 4" in refused(
        "eval.context_lengths.0", parallel={"ring_size": 2}, eval={"context_lengths": [130]}
    )
    ruler = tiny_spec(eval={"suites": ["ruler"], "context_lengths": [2048]})
    assert ruler.eval_suites() == ["ruler"]
    assert "at least 2048" in refused(
        "eval.context_lengths.0", eval={"suites": ["ruler"], "context_lengths": [2046]}
    )


def test_val_suite_needs_held_out_documents() -> None:
    assert "passkey data has none" in refused("eval.suites.0", eval={"suites": ["val"]})
    tokens = tiny_spec(data={"kind": "tokens", "path": "/d", "seq_len": 192})
    assert tokens.eval_suites() == ["val"]
    assert tiny_spec(eval={"suites": ["passkey", "passkey"]}).eval_suites() == ["passkey"]
    with_val = tiny_spec(
        data={"kind": "tokens", "path": "/d", "seq_len": 192}, eval={"suites": ["val"]}
    )
    assert with_val.eval_suites() == ["val"]


def test_passkey_lengths_hold_the_key() -> None:
    # 5 digits need 16 x 5 = 80 tokens
    refused("data.seq_len", data={"seq_len": 64, "key_digits": 5})
    assert tiny_spec(data={"seq_len": 80, "key_digits": 5}).data.seq_len == 80
    curriculum = {"seq_len": 192, "key_digits": 5}
    refused(
        "data.curriculum.0.seq_len",
        data={**curriculum, "curriculum": [{"steps": 1, "seq_len": 256}]},
    )
    refused(
        "data.curriculum.0.seq_len",
        data={**curriculum, "curriculum": [{"steps": 1, "seq_len": 64}]},
    )
    ok = tiny_spec(data={**curriculum, "curriculum": [{"steps": 1, "seq_len": 80}]})
    assert ok.data.curriculum[0].seq_len == 80


def test_the_world_including_pipeline_and_tensor_ranks_is_bounded() -> None:
    where = refused(
        "parallel.pipeline_size",
        parallel={"data_parallel": 2048, "tensor_size": 2, "pipeline_size": 2},
        train={"batch_size": 2048, "microbatches": 2},
    )
    assert "<= 4096" in where


# -- stages --------------------------------------------------------------------------------------
def _staged(*stages: dict[str, Any], **over: Any) -> JobSpec:
    spec = tiny_spec(**over)
    data = spec.model_dump(mode="json")
    data["stages"] = list(stages)
    data["train"].pop("steps")
    return JobSpec.model_validate(data)


def test_train_steps_with_stages_is_their_sum() -> None:
    spec = _staged({"steps": 3}, {"steps": 4})
    assert spec.train.steps == 7
    plan = spec.stage_plan()
    assert [(s.name, s.start_step, s.end_step, s.spec.train.steps) for s in plan] == [
        ("stage 1", 0, 3, 3),
        ("stage 2", 3, 7, 4),
    ]
    data = tiny_spec().model_dump(mode="json")
    data["stages"] = [{"steps": 3}, {"steps": 4}]
    data["train"]["steps"] = 5
    with pytest.raises(ValidationError, match=r"equal the stages' steps summed \(7\)"):
        JobSpec.model_validate(data)


def test_a_checkpoint_at_a_stages_last_step_starts_the_next() -> None:
    plan = _staged({"steps": 3}, {"steps": 4}).stage_plan()
    assert [stage_at(plan, step).index for step in (0, 2, 3, 6, 7, 99)] == [0, 0, 1, 1, 1, 1]


def test_the_largest_stage_is_by_ranks_first_and_the_world_is_its() -> None:
    spec = _staged(
        {"steps": 2, "parallel": {"ring_size": 2}, "data": {"seq_len": 128}},
        {"steps": 2, "data": {"seq_len": 256}},
    )
    assert spec.largest_stage().index == 0 and spec.world_size == 2


def test_a_stage_of_another_data_kind_replaces_the_data_section() -> None:
    spec = _staged(
        {"steps": 2},
        {"steps": 2, "data": {"kind": "tokens", "path": "/d", "seq_len": 256}},
    )
    second = spec.stage_plan()[1].spec.data
    assert second.kind == "tokens" and second.seq_len == 256


def test_only_the_first_stage_starts_from_init_from() -> None:
    spec = _staged({"steps": 2}, {"steps": 2}, init_from={"job": "base-job"})
    assert [s.spec.init_from is not None for s in spec.stage_plan()] == [True, False]


def test_ring_auto_is_resolved_once_every_stage_has_its_own() -> None:
    spec = _staged({"steps": 2}, {"steps": 2}, parallel={"ring_size": "auto"})
    assert spec.parallel.ring_auto
    half = with_overrides(spec, {0: {"parallel": {"ring_size": 2}}})
    assert half.parallel.ring_auto  # stage 2 still picks its own
    both = with_overrides(half, {1: {"parallel": {"ring_size": 1}}})
    assert not both.parallel.ring_auto and both.parallel.ring_size == 1
    assert [s.spec.parallel.ring_size for s in both.stage_plan()] == [2, 1]
