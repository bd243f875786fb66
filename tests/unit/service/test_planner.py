"""The planner without a server: parameter count from the real head layout, Ulysses × ring placement and the
split it suggests for a cluster's GPUs per node."""

from __future__ import annotations

from typing import Any

from service.launcher import ClusterInfo, NodeInfo
from service.planner import param_count, plan, suggest_split
from workers.config import JobSpec


def _spec(**parallel: Any) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "p",
            "model": {"d_model": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 2},
            "data": {"kind": "passkey", "seq_len": 1024},
            "parallel": {"ring_size": 8, **parallel},
            "resources": {"accelerator": "gpu"},
        }
    )


def _gpu_cluster(nodes: int, gpus: int) -> ClusterInfo:
    return ClusterInfo(
        nodes=[
            NodeInfo(f"n{i}", f"10.0.0.{i}", True, 32.0, 32.0, float(gpus), float(gpus))
            for i in range(nodes)
        ]
    )


def test_param_count_matches_the_built_model() -> None:
    from workers.models import build_model

    spec = _spec()
    model = build_model(spec.model, 0)
    assert param_count(spec) == sum(p.numel() for p in model.parameters())


def test_suggests_ulysses_inside_a_node_and_the_ring_across() -> None:
    spec = _spec()  # 8 ranks, 8 query / 2 kv heads
    nodes = _gpu_cluster(2, 4).nodes
    assert suggest_split(spec, nodes) == {
        "ulysses_size": 4,
        "ring_size": 2,
    }  # 4 = kv heads 2 × 2 repeats: allowed
    assert suggest_split(spec, _gpu_cluster(1, 8).nodes) == {"ulysses_size": 8, "ring_size": 1}
    assert suggest_split(spec, _gpu_cluster(8, 1).nodes) == {"ulysses_size": 1, "ring_size": 8}
    out = plan(spec, _gpu_cluster(2, 4))
    assert out.fits and out.suggested_parallel == {"ulysses_size": 4, "ring_size": 2}
    assert any("ulysses_size 4 x ring_size 2" in w for w in out.warnings)


def test_usp_placement_keeps_a_replica_together() -> None:
    spec = _spec(ring_size=2, ulysses_size=4)
    out = plan(spec, _gpu_cluster(2, 4))
    assert (
        out.fits
        and out.world_size == 8
        and out.suggested_parallel == {"ulysses_size": 4, "ring_size": 2}
    )
    assert not any("suggested" in w for w in out.warnings)  # already the suggested split
    assert [s.node_id for s in out.placement] == ["n0"] * 4 + [
        "n1"
    ] * 4  # each Ulysses group on one node
    # four rings of 2 (ranks u and u + 4), each n0 -> n1 and back: the all-to-all stays on a node,
    # every ring hop crosses (counting consecutive ranks said 2)
    assert out.node_crossings == 8


def test_tensor_groups_land_on_one_node_and_need_whole_pairs() -> None:
    spec = _spec(ring_size=4, tensor_size=2)  # 8 heads, 2 K/V heads: T = 2 splits both
    p = plan(spec, _gpu_cluster(nodes=2, gpus=4))
    assert p.fits and p.world_size == 8 and p.bundle == {"CPU": 1.0, "GPU": 1.0}
    by_rank = {s.rank: s for s in p.placement}
    for k in range(4):  # ranks 2k, 2k+1: one tensor group
        assert by_rank[2 * k].node_id == by_rank[2 * k + 1].node_id
    # three nodes of three GPUs: nine GPUs, but whole pairs make only six of the eight ranks
    odd = plan(spec, _gpu_cluster(nodes=3, gpus=3))
    assert not odd.fits
    assert any("whole tensor groups of 2 per node" in w and "has 6" in w for w in odd.warnings)


def test_memory_estimate_divides_what_tensor_parallelism_splits() -> None:
    from service.planner import block_param_count, local_block_param_count, memory_estimate

    one, two = _spec(ring_size=2), _spec(ring_size=2, tensor_size=2)
    m = one.model
    block = block_param_count(one)
    norms = 2 * m.d_model
    assert local_block_param_count(two) == (block - norms) // 2 + norms
    e1, e2 = memory_estimate(one, "gpu"), memory_estimate(two, "gpu")
    root = param_count(one) - m.n_layers * block
    # state: a tensor rank's share, sharded over the ring (2 ranks) -- the tensor ranks do not shard it
    assert e2["bytes"]["params"] == 4 * (m.n_layers * local_block_param_count(two) + root) // 2
    assert e1["bytes"]["params"] == 4 * param_count(one) // 2
    assert e2["local_tokens"] == e1["local_tokens"]  # a tensor group holds the same tokens
    # ring buffers by hand: 1024 tokens / ring 2 = 512 local tokens (batch 1); K and V of one K/V-head
    # chunk (head_dim 8), held and in flight, in bf16 (2 bytes), and their dK/dV in fp32 (4 bytes).
    # T = 1: 2 K/V heads on a ring of 2 run in 2 chunks of 1 head; T = 2: a rank's 1 head, 1 chunk.
    assert (m.head_dim, m.kv_heads, e1["local_tokens"], e1["local_batch"]) == (8, 2, 512, 1)
    assert e1["bytes"]["ring_buffers"] == 512 * (2 * (2 * 8) // 2) * 2 * (2 + 4) == 98304
    assert e2["bytes"]["ring_buffers"] == 512 * (2 * (1 * 8) // 1) * 2 * (2 + 4) == 98304
    # nothing travels on a ring of one
    assert memory_estimate(_spec(ring_size=1), "gpu")["bytes"]["ring_buffers"] == 0
    assert e2["bytes"]["activations"] < e1["bytes"]["activations"]
    assert e2["bytes"]["loss"] == e1["bytes"]["loss"]  # the vocabulary is not split
