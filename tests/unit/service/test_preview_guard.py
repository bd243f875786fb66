"""Placement preview (service/planner/preview.py) on GPU clusters, against placements worked out by
hand from the driver's rules: PACK fills the node with the most room first and stops at the world
size, GPU ids count per node, ring hops that cross a node are counted, and the suggested Ulysses x
ring split takes the largest Ulysses group that fits the biggest node and divides the heads."""

from __future__ import annotations

import pytest

from service.launcher import ClusterInfo, NodeInfo
from service.planner import plan
from workers.config import JobSpec


def gpu_job(ring: int, seq_len: int) -> JobSpec:
    """8 heads (and 8 K/V heads): Ulysses groups of 1, 2, 4 or 8 suit them, 3 does not."""
    return JobSpec.model_validate(
        {
            "name": "preview",
            "model": {"d_model": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 8},
            "data": {"kind": "passkey", "seq_len": seq_len},
            "parallel": {"ring_size": ring},
            "train": {"steps": 2},
            "resources": {"accelerator": "gpu"},
        }
    )


def gpus(node_id: str, total: int, free: int | None = None) -> NodeInfo:
    f = total if free is None else free
    return NodeInfo(node_id, "", True, 32, 32, total, f)


def test_pack_fills_the_first_node_and_stops_at_the_world_size() -> None:
    """6 ranks on two 4-GPU nodes: no node holds all (PACK); a takes 4, b the remaining 2 (not 4).
    The ring 0..5 crosses a->b at 3->4 and b->a at 5->0: 2 crossings. Split: the sequence group of
    6 by the largest divisor <= 4 GPUs per node that divides 8 heads: 2 x 3."""
    p = plan(gpu_job(6, 1536), ClusterInfo([gpus("a", 4), gpus("b", 4)]))
    assert p.fits and p.strategy == "PACK" and p.world_size == 6
    assert [(s.rank, s.node_id, s.device) for s in p.placement] == [
        (0, "a", "cuda:0"),
        (1, "a", "cuda:1"),
        (2, "a", "cuda:2"),
        (3, "a", "cuda:3"),
        (4, "b", "cuda:0"),
        (5, "b", "cuda:1"),
    ]
    assert (p.nodes_used, p.node_crossings) == (2, 2)
    assert p.suggested_parallel == {"ulysses_size": 2, "ring_size": 3}


def test_the_split_is_sized_by_the_largest_node() -> None:
    """An 8-GPU node and a 2-GPU node: 8 ranks fit the big one whole (STRICT_PACK, no crossing),
    and the suggested Ulysses group is all 8 of them (8 <= 8 GPUs, divides 8 heads), ring 1."""
    p = plan(gpu_job(8, 1024), ClusterInfo([gpus("a", 8), gpus("b", 2)]))
    assert p.fits and p.strategy == "STRICT_PACK"
    assert [s.node_id for s in p.placement] == ["a"] * 8
    assert [s.device for s in p.placement] == [f"cuda:{i}" for i in range(8)]
    assert (p.nodes_used, p.node_crossings) == (1, 0)
    assert p.suggested_parallel == {"ulysses_size": 8, "ring_size": 1}
    assert any("ulysses_size 8 x ring_size 1" in w for w in p.warnings)


def test_a_dead_node_holds_nothing() -> None:
    """A dead 8-GPU node is not counted: 8 ranks on the live 4 + 4 GPUs, PACK over both."""
    dead = NodeInfo("z", "", False, 32, 32, 8, 8)
    p = plan(gpu_job(8, 1024), ClusterInfo([dead, gpus("a", 4), gpus("b", 4)]))
    assert p.fits and p.strategy == "PACK"
    assert [s.node_id for s in p.placement] == ["a"] * 4 + ["b"] * 4
    assert p.suggested_parallel == {"ulysses_size": 4, "ring_size": 2}


def test_busy_gpus_are_not_free_room() -> None:
    """a has 4 GPUs all busy, b 2 of 4 free: a 2-rank job lands on b now (a would hold it only
    later), with no wait warning; with 1 GPU free in all it waits, previewed on the whole cluster."""
    p = plan(gpu_job(2, 1024), ClusterInfo([gpus("a", 4, 0), gpus("b", 4, 2)]))
    assert [s.node_id for s in p.placement] == ["b", "b"]
    assert not any("free now" in w for w in p.warnings), p.warnings
    p = plan(gpu_job(2, 1024), ClusterInfo([gpus("a", 4, 0), gpus("b", 4, 1)]))
    assert [s.node_id for s in p.placement] == ["a", "a"]
    assert any(w.startswith("only 1 of the 2 GPUs are free now") for w in p.warnings), p.warnings


def cpu_job(accelerator: str) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "preview",
            "model": {"d_model": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 8},
            "data": {"kind": "passkey", "seq_len": 1024},
            "parallel": {"ring_size": 2},
            "train": {"steps": 2},
            "resources": {"accelerator": accelerator},
        }
    )


def test_the_cpu_fallback_is_warned_only_when_auto_chose_it() -> None:
    cluster = ClusterInfo([NodeInfo("c", "", True, 8, 8, 0, 0)])
    auto = plan(cpu_job("auto"), cluster)
    assert auto.accelerator == "cpu" and any("no GPUs in the cluster" in w for w in auto.warnings)
    asked = plan(cpu_job("cpu"), cluster)
    assert asked.accelerator == "cpu" and not any("no GPUs" in w for w in asked.warnings)


@pytest.mark.parametrize(("total_bytes", "warned"), [(81e9, False), (80 * 2**30 + 1, True)])
def test_the_per_rank_memory_warning_is_over_80_gib(
    monkeypatch: pytest.MonkeyPatch, total_bytes: float, warned: bool
) -> None:
    """80 GiB is 85.9e9 bytes: an estimate of 81e9 bytes fits an 80 GiB GPU, one byte past
    80 GiB does not."""
    monkeypatch.setattr(
        "service.planner.preview.memory_estimate", lambda spec, acc: {"total_bytes": total_bytes}
    )
    p = plan(gpu_job(2, 1024), ClusterInfo([gpus("a", 4)]))
    assert any("exceeds an 80 GiB GPU" in w for w in p.warnings) == warned, p.warnings
