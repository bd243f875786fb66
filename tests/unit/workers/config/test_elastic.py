"""Elastic jobs' shapes (workers.config.elastic), the driver's choice among them
(workers.orchestration.elastic) and the spec's refusals. No Ray: free resources are written here."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from workers.config import JobSpec
from workers.config.elastic import never_shrinks, resized, shapes
from workers.orchestration.elastic import add, choose_shape, placeable
from workers.parallel_dims import ParallelDims


def spec(**over: Any) -> JobSpec:
    base: dict[str, Any] = {
        "name": "elastic",
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2},
        "data": {"kind": "passkey", "seq_len": 192, "key_digits": 2},
        "parallel": {"ring_size": 4, "data_parallel": 2},
        "train": {"steps": 4, "batch_size": 2},
        "elastic": {"enabled": True},
    }
    for k, v in over.items():
        base[k] = {**base[k], **v} if isinstance(v, dict) and k in base else v
    return JobSpec.model_validate(base)


def degrees(found: list[ParallelDims]) -> list[tuple[int, int]]:
    return [(d.data_parallel, d.ring_size) for d in found]


def test_shapes_shrink_data_parallelism_before_the_ring() -> None:
    # seq 192 with zigzag: rings of 4 (8 chunks of 24), 3 (6 of 32), 2 and 1
    assert degrees(shapes(spec())) == [
        (2, 4),
        (2, 3),  # 6 ranks
        (1, 4),  # 4 ranks: the longer ring first
        (2, 2),
        (1, 3),
        (1, 2),
        (2, 1),
        (1, 1),
    ]


def test_shapes_keep_the_specs_own_rules_and_the_floor() -> None:
    # a batch of 4 on data_parallel 4: 3 ranks of data parallelism would split it unevenly
    batch = spec(train={"batch_size": 4}, parallel={"data_parallel": 4, "ring_size": 1})
    assert degrees(shapes(batch)) == [(4, 1), (2, 1), (1, 1)]
    # seq 160: 8 zigzag chunks of 20 for a ring of 4, none for a ring of 3 (6 does not divide it)
    seq = spec(data={"seq_len": 160})
    assert degrees(shapes(seq)) == [(2, 4), (1, 4), (2, 2), (1, 2), (2, 1), (1, 1)]
    floor = spec(elastic={"enabled": True, "min_world_size": 4})
    assert degrees(shapes(floor)) == [(2, 4), (2, 3), (1, 4), (2, 2)]
    ulysses = spec(
        parallel={"ring_size": 2, "data_parallel": 2, "ulysses_size": 2}, data={"seq_len": 256}
    )
    assert [(d.data_parallel, d.ring_size, d.ulysses_size) for d in shapes(ulysses)] == [
        (2, 2, 2),
        (1, 2, 2),
        (2, 1, 2),
        (1, 1, 2),
    ]


def test_resized_changes_only_the_degrees() -> None:
    s = spec()
    small = resized(s, ParallelDims(1, 2))
    assert (small.parallel.data_parallel, small.parallel.ring_size) == (1, 2)
    assert small.model_dump(exclude={"parallel"}) == s.model_dump(exclude={"parallel"})
    assert small.parallel.layout == s.parallel.layout


def nodes(*cpus: float) -> dict[str, dict[str, float]]:
    return {f"n{i}": {"CPU": c, "memory": 1e9} for i, c in enumerate(cpus)}


def test_the_driver_takes_the_largest_shape_that_fits_node_by_node() -> None:
    s = spec()  # 8 ranks of 1 CPU
    assert choose_shape(s, nodes(8), gpu=False) == ParallelDims(2, 4)
    assert choose_shape(s, nodes(4, 3), gpu=False) == ParallelDims(2, 3)  # 6 of 7
    assert choose_shape(s, nodes(3, 2), gpu=False) == ParallelDims(1, 4)  # 4 of 5
    # 2 + 1.5 + 0.5 CPUs hold 3 bundles of 1 CPU: a bundle never spans nodes
    assert choose_shape(s, nodes(2, 1.5, 0.5), gpu=False) == ParallelDims(1, 3)
    assert choose_shape(s, {}, gpu=False) is None
    floor = spec(elastic={"enabled": True, "min_world_size": 4})
    assert choose_shape(floor, nodes(3), gpu=False) is None  # waits: nothing at or above 4
    gpus = {"n0": {"CPU": 16.0, "GPU": 3.0}}
    assert choose_shape(s, gpus, gpu=True) == ParallelDims(1, 3)
    assert placeable(s, ParallelDims(1, 3), gpus, gpu=True)
    assert not placeable(s, ParallelDims(2, 2), gpus, gpu=True)


def test_growing_counts_what_the_job_holds_on_nodes_still_alive() -> None:
    free = nodes(2, 0)
    held = {"n1": {"CPU": 2.0}, "gone": {"CPU": 4.0}}
    assert add(free, held) == {"n0": {"CPU": 2.0, "memory": 1e9}, "n1": {"CPU": 2.0, "memory": 1e9}}
    assert free["n1"]["CPU"] == 0  # not modified


@pytest.mark.parametrize(
    ("over", "field", "words"),
    [
        ({"elastic": {"enabled": True, "min_world_size": 9}}, "elastic.min_world_size", "larger"),
        (
            {"stages": [{"steps": 2}, {"steps": 2, "data": {"seq_len": 384}}], "train": {}},
            "elastic.enabled",
            "stages",
        ),
    ],
)
def test_elastic_specs_that_cannot_work_are_refused_naming_the_field(
    over: dict[str, Any], field: str, words: str
) -> None:
    base = spec().model_dump(mode="json")
    base["train"].pop("steps") if "stages" in over else None
    for k, v in over.items():
        base[k] = {**base[k], **v} if isinstance(v, dict) and k in base else v
    with pytest.raises(ValidationError) as e:
        JobSpec.model_validate(base)
    err = e.value.errors()[0]
    assert ".".join(map(str, err["loc"])) == field and words in err["msg"], err


def test_a_job_that_could_never_shrink_is_named_but_stays_a_valid_spec() -> None:
    one = spec(parallel={"ring_size": 1, "data_parallel": 1})  # valid: e.g. resized to its floor
    assert degrees(shapes(one)) == [(1, 1)]
    field, _, message = never_shrinks(one) or ("", None, "")
    assert field == "elastic.enabled" and "could never shrink" in message
    floor = spec(elastic={"enabled": True, "min_world_size": 8})
    assert (never_shrinks(floor) or ("",))[0] == "elastic.min_world_size"
    assert never_shrinks(spec()) is None
    assert never_shrinks(spec(elastic={"enabled": False}, parallel={"ring_size": 1})) is None


def test_an_elastic_job_reports_its_ranks_every_step_and_others_do_not() -> None:
    """`world_size`: one rank-less point per step of an elastic job (the shape over time), none
    for a job without elastic (its exactly-once counts stay as they were)."""
    from workers.training.trainer import run_training

    for enabled, want in ((True, [1, 1, 1]), (False, [])):
        job = resized(spec(elastic={"enabled": enabled}, train={"steps": 3}), ParallelDims(1, 1))
        points: list[Any] = []
        run_training(job, checkpoint_dir=None, emit=points.append)
        sizes = [(p.step, p.rank, p.value) for p in points if p.name == "world_size"]
        assert [v for _, _, v in sizes] == want and all(r is None for _, r, _ in sizes)
        assert [s for s, _, _ in sizes] == list(range(1, len(want) + 1))
