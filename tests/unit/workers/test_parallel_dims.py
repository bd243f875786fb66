"""The parallel shape and the shared placement rules (`workers.parallel_dims`), and that every
layer that used to keep its own copy of a rule (planner, admission, capacity, the driver's
reservation, the trainer's mesh) gives the same answer where the copies disagreed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, get_args

import pytest

from service.admission import Free, demand_of, uses_gpus
from service.capacity import with_accelerator_resolved as resolve_for_cluster
from service.launcher import ClusterInfo, NodeInfo
from service.planner import plan
from workers.attention import layouts
from workers.attention.ulysses import usp_group_ranks
from workers.config import JobSpec, Layout
from workers.orchestration.placement import capacity_shortfall
from workers.orchestration.reservation import wants_gpus
from workers.parallel_dims import (
    LAYOUTS,
    MAX_RING_HEAD_CHUNKS,
    PACK,
    STRICT_PACK,
    ParallelDims,
    TensorGroupSplit,
    WorkerLocation,
    bundles_per_node,
    choose_strategy,
    order_ranks,
    rank_bundle,
    resolve_accelerator,
    ring_head_chunks,
)
from workers.training.mesh import Mesh


def _spec(ring: int, *, ulysses: int = 1, dp: int = 1, **resources: Any) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "shape",
            "data": {"kind": "passkey", "seq_len": 96 * ring * ulysses},
            "parallel": {"ring_size": ring, "ulysses_size": ulysses, "data_parallel": dp},
            "train": {"batch_size": dp},
            "resources": {"accelerator": "auto", **resources},
        }
    )


def _ray_resources(cluster: ClusterInfo) -> list[dict[str, float]]:
    """The alive nodes as the driver reads them from `ray.nodes()` (total resources)."""
    return [{"CPU": n.cpus_total, "GPU": n.gpus_total} for n in cluster.nodes if n.alive]


def test_shape_degrees_group_divisor_and_words() -> None:
    dims = ParallelDims(data_parallel=2, ring_size=4, ulysses_size=2)
    assert (dims.world_size, dims.seq_group_size) == (16, 8)
    assert dims.describe() == "data_parallel 2 x ulysses_size 2 x ring_size 4"
    # zigzag cuts 2 x ring chunks; each ring shard splits again into ulysses pieces
    assert [dims.seq_divisor(layout) for layout in ("contiguous", "striped", "zigzag")] == [8, 8, 8]
    odd = ParallelDims(ring_size=2, ulysses_size=3)
    assert [odd.seq_divisor(layout) for layout in ("contiguous", "zigzag")] == [6, 12]
    assert ParallelDims(ring_size=4).seq_divisor("zigzag") == 8
    # the config's cross-field checks use this divisor
    assert ParallelDims(ring_size=2, ulysses_size=3).seq_divisor("zigzag") == 12
    with pytest.raises(ValueError, match="ring_size must be an integer >= 1"):
        ParallelDims(ring_size=0)
    with pytest.raises(ValueError, match="layout must be one of"):
        dims.seq_divisor("diagonal")
    spec = _spec(4, ulysses=2, dp=2)
    assert ParallelDims.of(spec.parallel) == dims and spec.world_size == 16


def test_a_layout_is_named_once() -> None:
    """The spec's `Layout`, the attention's sharding and the divisor all follow `LAYOUTS`."""
    assert sorted(get_args(Layout)) == sorted(LAYOUTS) and layouts.LAYOUTS is LAYOUTS
    for layout in LAYOUTS:
        assert layouts.seq_multiple(layout, 3) == ParallelDims(ring_size=3).seq_divisor(layout)
        assert len(layouts.shard_positions(6 * 4, layout, 1, 3)) == 8


def test_config_refuses_a_length_the_shape_cannot_split() -> None:
    model = {"d_model": 48, "n_heads": 6, "n_kv_heads": 3}
    base = {"name": "s", "model": model, "parallel": {"ring_size": 2, "ulysses_size": 3}}
    with pytest.raises(ValueError, match=r"divisible by 12 for the zigzag layout"):
        JobSpec.model_validate({**base, "data": {"kind": "passkey", "seq_len": 96 + 6}})
    fits = JobSpec.model_validate({**base, "data": {"kind": "passkey", "seq_len": 96 + 12}})
    assert fits.world_size == 6


def test_coordinates_match_the_ulysses_and_ring_groups() -> None:
    dims = ParallelDims(data_parallel=2, ring_size=2, ulysses_size=2)
    ulysses_groups, ring_groups = usp_group_ranks(dims.world_size, 2, 2)
    for rank in range(dims.world_size):
        where = dims.coordinates(rank)
        assert ulysses_groups[rank // 2][where.ulysses_rank] == rank
        ring = next(group for group in ring_groups if rank in group)
        assert ring.index(rank) == where.ring_rank
        assert where.dp_index == rank // 4
    five = dims.coordinates(5)
    assert (five.dp_index, five.ring_rank, five.ulysses_rank) == (1, 0, 1)
    mesh = Mesh(ParallelDims(data_parallel=2, ring_size=2, ulysses_size=2), rank=5)
    assert (mesh.dp_index, mesh.ring_rank, mesh.ulysses_rank) == (1, 0, 1)
    with pytest.raises(ValueError, match="outside a world of 8"):
        dims.coordinates(8)


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [
        # 4 GPUs, 8 ranks: the driver's old rule (GPUs >= world size) said CPU, the rest GPU
        ([NodeInfo("g", "10.0.0.1", True, 32, 32, 4, 4)], "gpu"),
        ([NodeInfo("c", "10.0.0.1", True, 32, 32, 0, 0)], "cpu"),
        ([NodeInfo("c", "", True, 32, 32, 0, 0), NodeInfo("dead", "", False, 8, 0, 8, 0)], "cpu"),
    ],
)
def test_every_layer_resolves_auto_the_same_way(nodes: list[NodeInfo], expected: str) -> None:
    spec = _spec(8)
    cluster = ClusterInfo(nodes=nodes)
    assert resolve_accelerator("auto", [n.gpus_total for n in nodes if n.alive]) == expected
    assert plan(spec, cluster).accelerator == expected
    assert resolve_for_cluster(spec, cluster).resources.accelerator == expected
    assert ("gpu" if uses_gpus(spec, cluster) else "cpu") == expected
    assert ("gpu" if wants_gpus(spec, _ray_resources(cluster)) else "cpu") == expected
    # a named accelerator is never re-decided
    assert resolve_accelerator("cpu", [8.0]) == "cpu" and resolve_accelerator("gpu", []) == "gpu"
    with pytest.raises(ValueError, match="accelerator must be"):
        resolve_accelerator("tpu", [])


def test_bundles_per_node_counts_in_rays_resource_unit() -> None:
    bundle = rank_bundle(gpu=False, cpus_per_worker=0.1)
    assert bundle == {"CPU": 0.1}
    assert 0.3 // 0.1 == 2.0  # float floor division: the planner's and admission's old count
    assert bundles_per_node(bundle, {"CPU": 0.3}) == 3
    assert bundles_per_node(rank_bundle(gpu=True, cpus_per_worker=4), {"CPU": 32, "GPU": 8}) == 8
    assert bundles_per_node(rank_bundle(gpu=True, cpus_per_worker=4), {"CPU": 10, "GPU": 8}) == 2
    assert bundles_per_node(rank_bundle(gpu=True, cpus_per_worker=1), {"CPU": 8}) == 0
    assert bundles_per_node(bundle, {"CPU": -1.0}) == 0  # a ledger may run below zero
    # the same three bundles everywhere: the planner, admission and the driver's placement check
    spec = _spec(3, cpus_per_worker=0.1)
    node = NodeInfo("n", "10.0.0.1", True, 0.3, 0.3, 0, 0)
    preview = plan(spec, ClusterInfo(nodes=[node]))
    assert preview.fits and preview.strategy == STRICT_PACK and preview.nodes_used == 1
    assert Free("n", 0.3, 0.0).holds(demand_of(spec, gpu=False)) == 3
    assert capacity_shortfall(3, bundle, [{"CPU": 0.3}]) is None
    assert choose_strategy(3, bundle, [{"CPU": 0.3}]) == STRICT_PACK


def test_the_preview_orders_ranks_as_the_driver_does() -> None:
    # GPUs per node 3, 3, 2; two sequence groups of 4. Filling ranks in node order would give
    # a a a b | b b c c; the driver's best fit puts the 2-GPU node's ranks between the groups.
    gpus = {"a": 3, "b": 3, "c": 2}
    nodes = [NodeInfo(name, "", True, 32, 32, count, count) for name, count in gpus.items()]
    spec = _spec(4, dp=2)
    preview = plan(spec, ClusterInfo(nodes=nodes))
    assert preview.strategy == PACK
    assert [s.node_id for s in preview.placement] == ["a", "a", "a", "c", "c", "b", "b", "b"]
    assert [s.ring for s in preview.placement] == [0] * 4 + [1] * 4
    assert preview.node_crossings == 4
    landing = [WorkerLocation(name, "", (str(k),)) for name in gpus for k in range(gpus[name])]
    driver = order_ranks(landing, replica_size=4, data_parallel=2)
    previewed = [(slot.node_id, slot.device) for slot in preview.placement]
    assert [(a.node_id, a.device) for a in driver] == previewed
    assert ParallelDims.of(spec.parallel).node_crossings(driver) == preview.node_crossings


def test_the_preview_asks_for_the_strategy_the_driver_asks_for() -> None:
    # One node holds all 8 GPUs but only 4 are free; another has 4 free. The driver asks Ray for
    # STRICT_PACK (a node's total holds the job): the job waits for the big node, as previewed.
    nodes = [NodeInfo("big", "", True, 64, 64, 8, 4), NodeInfo("small", "", True, 64, 64, 4, 4)]
    preview = plan(_spec(8), ClusterInfo(nodes=nodes))
    bundle = rank_bundle(gpu=True, cpus_per_worker=1)
    assert choose_strategy(8, bundle, [{"CPU": 64, "GPU": 8}, {"CPU": 64, "GPU": 4}]) == STRICT_PACK
    assert preview.fits and preview.strategy == STRICT_PACK
    assert [s.node_id for s in preview.placement] == ["big"] * 8 and preview.node_crossings == 0


def test_tensor_groups_are_innermost_and_the_mesh_agrees() -> None:
    """rank = ((dp x ring + ring_rank) x ulysses + ulysses_rank) x tensor + tp_rank, which is the
    row-major order of the trainer's (dp, ring, ulysses, tp) device mesh."""
    dims = ParallelDims(data_parallel=2, ring_size=2, ulysses_size=1, tensor_size=2)
    assert (dims.world_size, dims.replica_size, dims.seq_group_size) == (8, 4, 2)
    assert dims.describe().endswith("x tensor_size 2")
    grid = [
        (r // 4, r // 2 % 2, 0, r % 2) for r in range(8)
    ]  # torch.arange(8).reshape(2, 2, 1, 2) read back
    for rank, (dp, ring, ulysses, tp) in enumerate(grid):
        where = dims.coordinates(rank)
        assert (where.dp_index, where.ring_rank, where.ulysses_rank, where.tp_rank) == (
            dp,
            ring,
            ulysses,
            tp,
        )
    mesh = Mesh(ParallelDims(data_parallel=2, ring_size=2, tensor_size=2), rank=3)
    assert (mesh.dp_index, mesh.ring_rank, mesh.tp_rank) == (0, 1, 1)
    # a tensor group splits its ranks' shard again along the sequence (the residual stream between
    # the projections): ring 2 x tensor 2 needs 2 x lcm(2, 2) for zigzag and 2 x 2 for contiguous
    assert dims.seq_divisor("zigzag") == 4
    assert (
        dims.seq_divisor("contiguous") == 4 != ParallelDims(ring_size=2).seq_divisor("contiguous")
    )
    assert ParallelDims(ring_size=2, ulysses_size=2, tensor_size=2).seq_divisor("zigzag") == 8


def test_a_tensor_group_is_one_bundle_and_never_crosses_a_node() -> None:
    dims = ParallelDims(ring_size=3, tensor_size=2)
    assert dims.placement_units == 3
    assert dims.placement_bundle(gpu=True, cpus_per_worker=2) == {"CPU": 4.0, "GPU": 2.0}
    # admission counts the same bundles the driver reserves
    spec = JobSpec.model_validate(
        {
            "name": "tp",
            "data": {"kind": "passkey", "seq_len": 96},
            "parallel": {"ring_size": 3, "tensor_size": 2},
            "resources": {"accelerator": "gpu", "cpus_per_worker": 2},
        }
    )
    demand = demand_of(spec, gpu=True)
    assert (demand.bundles, demand.gpus, demand.cpus) == (3, 6.0, 12.0)
    assert Free("n", cpus=8, gpus=3).holds(demand) == 1  # 3 free GPUs hold one pair, not 1.5
    # Ray hands back actors in bundle order, scrambled across nodes: 2 on a, 4 on b
    nodes = ["b", "a", "b", "b", "a", "b"]
    locations = [
        WorkerLocation(n, n, (str(sum(m == n for m in nodes[:i])),)) for i, n in enumerate(nodes)
    ]
    ranks = dims.order_ranks(locations)
    for pair in range(3):  # ranks 2k and 2k+1 form a tensor group: one node, neighbouring GPUs
        a, b = ranks[2 * pair], ranks[2 * pair + 1]
        assert a.node_id == b.node_id
        assert int(b.device.removeprefix("cuda:")) == int(a.device.removeprefix("cuda:")) + 1
    with pytest.raises(TensorGroupSplit, match=r"node a holds 1 of this job.s ranks"):
        order_ranks(locations[:3] + [WorkerLocation("c", "c", ("0",))] * 3, 6, 1, 2)


def _two_per_node(nodes: int) -> list[WorkerLocation]:
    """Two GPUs on each of `nodes` nodes, as the actors report them."""
    return [WorkerLocation(f"n{i}", f"n{i}", (str(k),)) for i in range(nodes) for k in range(2)]


@pytest.mark.parametrize(
    ("shape", "rings", "crossings"),
    [
        # ring 2 x tensor 2, one tensor group per node: the rings 0<->2 and 1<->3 cross on every
        # hop, though the consecutive ranks 0, 1 and 2, 3 share a node
        ({"ring_size": 2, "tensor_size": 2}, [[0, 2], [1, 3]], [2, 2]),
        # ring 2 x ulysses 2, one Ulysses group per node: the same, stride 2 by Ulysses
        ({"ring_size": 2, "ulysses_size": 2}, [[0, 2], [1, 3]], [2, 2]),
        # ring 2 x ulysses 2 x tensor 2 on four nodes: stride U x T = 4, every ring crosses twice
        (
            {"ring_size": 2, "ulysses_size": 2, "tensor_size": 2},
            [[0, 4], [1, 5], [2, 6], [3, 7]],
            [2, 2, 2, 2],
        ),
        # ulysses 2 x tensor 2 on two nodes, no ring: rings of one rank never cross
        ({"ulysses_size": 2, "tensor_size": 2}, [[0], [1], [2], [3]], [0, 0, 0, 0]),
    ],
)
def test_crossings_follow_the_rings_not_consecutive_ranks(
    shape: dict[str, int], rings: list[list[int]], crossings: list[int]
) -> None:
    dims = ParallelDims(**shape)
    ranks = dims.order_ranks(_two_per_node(dims.world_size // 2))
    assert dims.ring_crossings(ranks) == crossings  # not along the replica's consecutive ranks
    assert [[a.rank for a in ring] for ring in dims.rings(ranks)] == rings
    for ring in dims.rings(ranks):
        assert [dims.coordinates(a.rank).ring_rank for a in ring] == list(range(dims.ring_size))
    assert dims.node_crossings(ranks) == sum(crossings)
    assert dims.nodes_per_ring(ranks) == [min(2, len(ring)) for ring in rings]
    # each rank carries its ring's index (what the placement reports and the dashboard draws)
    assert [[a.ring for a in ring] for ring in dims.rings(ranks)] == [
        [i] * len(ring) for i, ring in enumerate(rings)
    ]


_RING_2_TENSOR_2 = {
    "name": "tp-ring",
    "data": {"kind": "passkey", "seq_len": 96},
    "parallel": {"ring_size": 2, "tensor_size": 2},
    "resources": {"accelerator": "gpu"},
}


def test_the_preview_counts_ring_crossings_under_tensor_parallelism() -> None:
    """Ring 2 x tensor 2 on two 2-GPU nodes: the preview counts the 4 hops of the two rings (it
    used to group consecutive ranks by the sequence group, 2, and say 0)."""
    spec = JobSpec.model_validate(_RING_2_TENSOR_2)
    nodes = [NodeInfo(f"n{i}", "", True, 32, 32, 2, 2) for i in range(2)]
    preview = plan(spec, ClusterInfo(nodes=nodes))
    assert preview.fits and preview.nodes_used == 2
    assert [s.node_id for s in preview.placement] == ["n0", "n0", "n1", "n1"]
    assert [s.ring for s in preview.placement] == [0, 1, 0, 1]  # rings 0<->2 and 1<->3
    assert preview.node_crossings == 4


def test_the_driver_reports_ring_crossings_under_tensor_parallelism() -> None:
    """The same shape and landing: the driver's RUNNING report counts what the preview counts."""
    from workers.orchestration.driver import JobDriver
    from workers.orchestration.reservation import RankGroup

    spec = JobSpec.model_validate(_RING_2_TENSOR_2)
    locations = _two_per_node(2)
    assignments = ParallelDims.of(spec.parallel).order_ranks(locations)
    group = RankGroup(pg=None, actors=[], locations=locations, assignments=assignments)
    group.pids = [100 + a.actor_index for a in assignments]
    reports: list[dict[str, Any]] = []
    driver = SimpleNamespace(
        spec=spec,
        shape=None,  # not an elastic job running smaller
        running_spec=lambda step: spec,
        gpu=True,
        restarts=0,
        env=SimpleNamespace(attempt=0),
        reporter=SimpleNamespace(state=lambda state, reason, **kw: reports.append(kw)),
    )
    JobDriver._report_running(driver, group, 0)  # type: ignore[arg-type]
    (running,) = reports
    assert running["metadata"]["ring_node_crossings"] == 4
    assert running["metadata"]["max_nodes_per_ring"] == 2


def test_ring_head_chunks_divide_the_kv_heads() -> None:
    """Ring attention slices its K/V heads into `ring_head_chunks` equal chunks, so the count must divide
    them (else the last heads are never computed); the most such chunks up to the bound, one on a ring of
    one. The expected count comes from a search written here."""
    assert MAX_RING_HEAD_CHUNKS == 4
    for kv_heads in range(1, 33):
        for ring in range(1, 9):
            chunks = ring_head_chunks(kv_heads, ring)
            assert 1 <= chunks <= MAX_RING_HEAD_CHUNKS, (kv_heads, ring, chunks)
            assert kv_heads % chunks == 0, (kv_heads, ring, chunks)
            expected = 1
            if ring > 1:
                for c in range(1, 5):
                    if kv_heads % c == 0:
                        expected = c
            assert chunks == expected, (kv_heads, ring, chunks)
    # the counts that matter, by hand: 6 K/V heads run in 3 chunks (not 4), 5 (prime) in one
    assert [ring_head_chunks(h, 2) for h in (1, 2, 3, 4, 5, 6, 8, 12)] == [1, 2, 3, 4, 1, 3, 4, 4]
    assert ring_head_chunks(6, 1) == 1
