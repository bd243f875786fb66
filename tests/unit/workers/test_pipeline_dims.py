"""Pipeline parallel's shape and its spec rules: pp is the outermost dimension of the rank formula
and the world, and bad pipeline input is a 422 naming the field (`workers.config.rules`)."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from tests.support.trainutil import tiny_spec
from workers.parallel_dims import (
    ParallelDims,
    RankAssignment,
    WorkerLocation,
    stage_layers,
    stage_rank,
)


def _pp(**over: Any) -> dict[str, Any]:
    """A valid pipeline spec's sections (4 layers, untied, no check/evals), with overrides."""
    parallel = {"pipeline_size": 2, **over.pop("parallel", {})}
    train = {"microbatches": 2, "batch_size": 2, **over.pop("train", {})}
    model = {"n_layers": 4, **over.pop("model", {})}
    verify = over.pop("verify", {"enabled": False})
    return dict(parallel=parallel, train=train, model=model, verify=verify, **over)


def _error(**over: Any) -> tuple[tuple[Any, ...], str]:
    with pytest.raises(pydantic.ValidationError) as info:
        tiny_spec(**_pp(**over))
    (err,) = info.value.errors()
    return err["loc"], err["msg"]


def test_rank_formula_puts_pp_outermost() -> None:
    dims = ParallelDims(
        data_parallel=2, ring_size=2, ulysses_size=1, tensor_size=1, pipeline_size=3
    )
    assert dims.world_size == 12 and dims.stage_size == 4
    for rank in range(12):
        at = dims.coordinates(rank)
        # rank = pp_rank * stage_size + (dp_index * ring + ring_rank)
        assert rank == at.pp_rank * 4 + at.dp_index * 2 + at.ring_rank
    assert [dims.coordinates(r).pp_rank for r in range(12)] == [0] * 4 + [1] * 4 + [2] * 4
    assert "pipeline_size 3" in dims.describe()


def test_rings_stay_inside_a_stage() -> None:
    dims = ParallelDims(data_parallel=1, ring_size=2, pipeline_size=2)
    fake = [RankAssignment(r, r, f"n{r // 2}", "ip", 0, r, r % 2, 2, (), "cpu") for r in range(4)]
    assert [[a.rank for a in ring] for ring in dims.rings(fake)] == [[0, 1], [2, 3]]
    assert [dims.ring_index(r) for r in range(4)] == [0, 0, 1, 1]
    assert dims.node_crossings(fake) == 0  # stage 0 on n0, stage 1 on n1: only pp hops cross


def test_world_and_shape_of_a_spec() -> None:
    spec = tiny_spec(**_pp(parallel={"ring_size": 2, "data_parallel": 2}, train={"batch_size": 4}))
    assert spec.parallel.world_size == 8
    assert ParallelDims.of(spec.parallel).pipeline_size == 2
    assert ParallelDims.of(tiny_spec().parallel).world_size == 1  # default P = 1


def test_stage_layers_and_ranks() -> None:
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(6, 3, [1, 3, 2]) == [range(0, 1), range(1, 4), range(4, 6)]
    assert [stage_rank(s, 2) for s in range(4)] == [0, 1, 0, 1]  # interleaved: loop order
    with pytest.raises(ValueError):
        stage_layers(5, 2)


@pytest.mark.parametrize(
    ("over", "field", "words"),
    [
        ({"train": {"microbatches": 1}}, ("train", "microbatches"), ">= parallel.pipeline_size"),
        ({"train": {"batch_size": 3}}, ("train", "microbatches"), "equal microbatches"),
        ({"model": {"n_layers": 3}}, ("parallel", "pipeline_split"), "not divisible"),
        (
            {"parallel": {"pipeline_split": [1, 2]}},
            ("parallel", "pipeline_split"),
            "sums to 3",
        ),
        (
            {"parallel": {"pipeline_split": [1, 1, 2]}},
            ("parallel", "pipeline_split"),
            "has 3 entries",
        ),
        ({"model": {"n_layers": 1}}, ("parallel", "pipeline_size"), "too small"),
        (
            {"parallel": {"pipeline_split": "auto"}, "model": {"n_layers": 1}},
            ("parallel", "pipeline_size"),
            "too small",
        ),
        ({"parallel": {"pipeline_split": "even"}}, ("parallel", "pipeline_split"), "auto or a"),
        ({"parallel": {"pipeline_split": [0, 4]}}, ("parallel", "pipeline_split"), "auto or a"),
        (
            {"parallel": {"pipeline_schedule": "interleaved_1f1b"}, "model": {"n_layers": 3}},
            ("parallel", "pipeline_size"),
            "too small",
        ),
        ({"model": {"tie_embeddings": True}}, ("model", "tie_embeddings"), "tie_embeddings"),
        ({"eval": {"enabled": True}}, ("eval", "enabled"), "eval.enabled"),
    ],
)
def test_bad_pipeline_input_names_the_field(
    over: dict[str, Any], field: tuple[str, ...], words: str
) -> None:
    loc, msg = _error(**over)
    assert loc == field and words in msg, (loc, msg)


def test_microbatches_without_a_pipeline_are_refused() -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        tiny_spec(train={"microbatches": 2})
    assert info.value.errors()[0]["loc"] == ("train", "microbatches")


def test_valid_splits_pass() -> None:
    spec = tiny_spec(
        **_pp(
            parallel={"pipeline_size": 3, "pipeline_split": [1, 2, 1]},
            train={"microbatches": 3, "batch_size": 3},
        )
    )
    assert spec.parallel.pipeline_stages == 3
    # the per-job check runs under a pipeline (each stage's ranks check their own stage)
    assert tiny_spec(**_pp(verify={"enabled": True})).verify.enabled
    inter = tiny_spec(**_pp(parallel={"pipeline_schedule": "interleaved_1f1b"}))
    assert inter.parallel.pipeline_stages == 4
    # auto: any n_layers >= stages; the planner chooses, the trainer never sees it unresolved
    auto = tiny_spec(**_pp(parallel={"pipeline_split": "auto"}, model={"n_layers": 3}))
    assert auto.parallel.pipeline_split == "auto"
    with pytest.raises(ValueError, match="resolved by the control plane"):
        stage_layers(3, 2, auto.parallel.pipeline_split)


def test_placement_keeps_each_stage_on_one_node() -> None:
    """pp 2 x ring 2 on two nodes of two: each stage's ring on one node, only pp hops cross.
    Actors land interleaved over the nodes, as Ray may place bundles."""
    dims = ParallelDims(ring_size=2, pipeline_size=2)
    locations = [WorkerLocation(f"n{i % 2}", f"ip{i % 2}") for i in range(4)]
    assignments = sorted(dims.order_ranks(locations), key=lambda a: a.rank)
    stage_nodes = [
        {a.node_id for a in assignments if dims.coordinates(a.rank).pp_rank == s} for s in range(2)
    ]
    assert [len(nodes) for nodes in stage_nodes] == [1, 1] and stage_nodes[0] != stage_nodes[1]
    assert dims.node_crossings(assignments) == 0
