"""Rank ordering: pure unit tests with fake GPU ids, and a real 3-node simulated Ray cluster (uneven CPUs)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from workers.orchestration.placement import capacity_shortfall, dist_backend, make_bundles
from workers.parallel_dims import (
    PACK,
    STRICT_PACK,
    ParallelDims,
    RankAssignment,
    WorkerLocation,
    choose_strategy,
    order_ranks,
)

ROOT = Path(__file__).resolve().parents[4]


def _contiguous_per_node(assignments: list[RankAssignment]) -> bool:
    by_rank = sorted(assignments, key=lambda a: a.rank)
    seen: set[str] = set()
    prev = None
    for a in by_rank:
        if a.node_id != prev:
            if a.node_id in seen:
                return False
            seen.add(a.node_id)
            prev = a.node_id
    return True


def _locs(spec: list[tuple[str, list[int]]]) -> list[WorkerLocation]:
    return [
        WorkerLocation(node, f"10.0.0.{ord(node[-1]) % 250}", tuple(str(g) for g in gpus))
        for node, gpus in spec
    ]


def test_bundles_and_strategy() -> None:
    assert make_bundles(2, gpu=False, cpus_per_worker=1) == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert make_bundles(1, gpu=True, cpus_per_worker=4) == [{"GPU": 1.0, "CPU": 4.0}]
    nodes = [{"CPU": 16.0, "GPU": 8.0}, {"CPU": 16.0, "GPU": 8.0}]
    assert choose_strategy(8, {"GPU": 1, "CPU": 2}, nodes) == STRICT_PACK
    assert choose_strategy(16, {"GPU": 1, "CPU": 1}, nodes) == PACK
    assert choose_strategy(8, {"GPU": 1, "CPU": 4}, nodes) == PACK  # CPUs do not fit one node
    assert capacity_shortfall(16, {"GPU": 1, "CPU": 1}, nodes) is None
    msg = capacity_shortfall(17, {"GPU": 1, "CPU": 1}, nodes)
    assert msg is not None and "at most 16 of the 17" in msg


def test_interleaved_bundles_are_grouped_by_node_gpu_ascending() -> None:
    # Ray handed out bundles interleaved across two 4-GPU nodes, GPU ids shuffled.
    locs = _locs(
        [
            ("nA", [3]),
            ("nB", [1]),
            ("nA", [0]),
            ("nB", [0]),
            ("nA", [2]),
            ("nB", [3]),
            ("nA", [1]),
            ("nB", [2]),
        ]
    )
    out = order_ranks(locs, replica_size=8)
    assert [a.rank for a in out] == list(range(8))
    assert [(a.node_id, a.device) for a in out] == [("nA", f"cuda:{i}") for i in range(4)] + [
        ("nB", f"cuda:{i}") for i in range(4)
    ]
    assert all(a.visible_devices == ("0", "1", "2", "3") for a in out)
    assert [a.local_rank for a in out] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert ParallelDims(ring_size=8).ring_crossings(out) == [2]  # nA → nB and back round the ring
    # Each actor keeps its own GPU: device index into the visible list is its GPU id.
    for a in out:
        assert a.visible_devices[int(a.device.split(":")[1])] == locs[a.actor_index].gpu_ids[0]
    assert dist_backend(locs) == "nccl"


def test_data_parallel_rings_use_fewest_nodes() -> None:
    # Uneven nodes: 2 + 4 + 2 GPUs, 2 rings of 4. The 4-GPU node hosts a whole ring.
    locs = _locs(
        [
            ("n1", [0]),
            ("n2", [0]),
            ("n3", [0]),
            ("n2", [1]),
            ("n1", [1]),
            ("n2", [2]),
            ("n3", [1]),
            ("n2", [3]),
        ]
    )
    out = order_ranks(locs, replica_size=4, data_parallel=2)
    two_rings = ParallelDims(data_parallel=2, ring_size=4)
    assert two_rings.nodes_per_ring(out) == [1, 2]
    assert two_rings.ring_crossings(out) == [0, 2]
    assert {a.node_id for a in out if a.replica == 0} == {"n2"}
    assert [a.rank for a in out if a.replica == 1] == [4, 5, 6, 7]
    assert _contiguous_per_node(out)
    # Devices follow GPU order inside each node regardless of ring.
    n2 = sorted((a for a in out if a.node_id == "n2"), key=lambda a: a.rank)
    assert [a.device for a in n2] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]


def test_split_node_stays_contiguous_across_rings() -> None:
    # 3 + 3 + 2 GPUs, two rings of 4: one node must be split; its ranks stay adjacent (end of ring 0, start of 1).
    locs = _locs(
        [
            ("a", [0]),
            ("a", [1]),
            ("a", [2]),
            ("b", [0]),
            ("b", [1]),
            ("b", [2]),
            ("c", [0]),
            ("c", [1]),
        ]
    )
    out = order_ranks(locs, replica_size=4, data_parallel=2)
    two_rings = ParallelDims(data_parallel=2, ring_size=4)
    assert two_rings.nodes_per_ring(out) == [2, 2]
    assert two_rings.node_crossings(out) == 4
    assert _contiguous_per_node(out)


def test_best_fit_avoids_three_node_ring() -> None:
    # 3 + 1 + 3 + 1: rings {3,1} and {3,1}, never a ring over three nodes.
    locs = _locs(
        [
            ("a", [0]),
            ("a", [1]),
            ("a", [2]),
            ("b", [0]),
            ("c", [0]),
            ("c", [1]),
            ("c", [2]),
            ("d", [0]),
        ]
    )
    out = order_ranks(locs, replica_size=4, data_parallel=2)
    assert ParallelDims(data_parallel=2, ring_size=4).nodes_per_ring(out) == [2, 2]


def test_cpu_only_and_single_node() -> None:
    locs = _locs([("n", []), ("n", []), ("n", [])])
    out = order_ranks(locs, replica_size=3)
    assert [a.device for a in out] == ["cpu"] * 3
    assert [a.actor_index for a in out] == [0, 1, 2]
    assert ParallelDims(ring_size=3).ring_crossings(out) == [0]
    assert dist_backend(locs) == "gloo"
    assert (
        dist_backend(locs[:1] + _locs([("n", [0])])) == "gloo"
    )  # nccl only if every rank has a GPU
    with pytest.raises(ValueError, match="expected 4 actors"):
        order_ranks(locs, replica_size=4)


# ---------------------------------------------------------------------------------------------------------------
# A real multi-node placement: ray.cluster_utils.Cluster, 3 nodes with 1, 2 and 1 CPUs, in a subprocess so this
# process never holds Ray state, with its own RAY_TMPDIR, explicit ports and token auth. Uneven nodes, a ring
# over all three and two rings of which one fits a node: 8 rank actors in all (each a Ray worker process of
# its own; 1, 3 and 2 CPUs with rings of 6 and 3 needed 12 to show the same).

_SCENARIO = r"""
import json, sys
from service.local_ray import free_ports
from ray.cluster_utils import Cluster
import ray
from workers.config import JobSpec
from workers.orchestration.reservation import reserve
from workers.parallel_dims import ParallelDims

def node_args(cpus, head=False):
    gcs, agent, metrics, rt_env, client = free_ports(5)
    args = dict(num_cpus=cpus, include_dashboard=False, dashboard_agent_listen_port=agent, metrics_export_port=metrics,
                runtime_env_agent_port=rt_env)
    if head:
        args.update(gcs_server_port=gcs, ray_client_server_port=client)
    return args

cluster = Cluster(initialize_head=True, head_node_args=node_args(1, head=True))
try:
    cluster.add_node(**node_args(2))
    cluster.add_node(**node_args(1))
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="ringtrain-test", logging_level="WARNING")
    out = {"nodes": len([n for n in ray.nodes() if n["Alive"]])}
    base = {"name": "p", "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
            "data": {"kind": "passkey", "seq_len": 96, "key_digits": 2}}
    for key, ring, dp in (("ring4", 4, 1), ("dp2", 2, 2)):
        spec = JobSpec.model_validate({**base, "parallel": {"ring_size": ring, "data_parallel": dp},
                                       "train": {"batch_size": dp}})
        reasons = []
        g = reserve(spec, name=f"test-{key}", timeout_s=120, on_waiting=reasons.append)
        actor_nodes = ray.get([a.info.remote() for a in g.actors])
        out[key] = {
            "strategy": g.strategy, "reason": reasons[0],
            "placement": [p.model_dump() for p in g.placement()],
            "actor_node": [actor_nodes[a.actor_index].node_id for a in g.assignments],
            "crossings": ParallelDims.of(spec.parallel).ring_crossings(g.assignments),
            "nodes_per_group": ParallelDims.of(spec.parallel).nodes_per_ring(g.assignments),
        }
        g.teardown()
    print("RESULT " + json.dumps(out))
finally:
    ray.shutdown()
    cluster.shutdown()
"""


@pytest.mark.ray
@pytest.mark.slow
def test_rank_ordering_on_three_simulated_nodes() -> None:
    tmp = tempfile.mkdtemp(prefix="rt-cl-", dir="/tmp")
    env = {
        **os.environ,
        "RAY_TMPDIR": tmp,  # Cluster writes its address file under here, not /tmp/ray: nobody auto-detects it
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": str(ROOT),
    }
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-c", _SCENARIO],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    try:
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
        res = json.loads(lines[-1][len("RESULT ") :])
    finally:
        from service.local_ray import _kill_processes_mentioning

        _kill_processes_mentioning(tmp)
    assert res["nodes"] == 3

    r4 = res["ring4"]
    assert r4["strategy"] == "PACK"  # no node has 4 CPUs
    assert "4 rank(s) x (1 CPU)" in r4["reason"]
    placement = r4["placement"]
    assert [p["rank"] for p in placement] == list(range(4))
    # Reported placement is where each rank's actor really runs.
    assert [p["node_id"] for p in placement] == r4["actor_node"]
    counts: dict[str, int] = {}
    for p in placement:
        counts[p["node_id"]] = counts.get(p["node_id"], 0) + 1
    assert sorted(counts.values()) == [1, 1, 2]
    # Ranks on one node are contiguous; the ring crosses node boundaries exactly once per node used.
    seq = [p["node_id"] for p in placement]
    assert len([i for i in range(4) if seq[i] != seq[i - 1]]) == 3
    assert r4["crossings"] == [3] and r4["nodes_per_group"] == [3]
    assert all(p["device"] == "cpu" and p["ring"] == 0 for p in placement)

    dp2 = res["dp2"]
    # Two rings of 2 on nodes of 1, 2, 1 CPUs: one ring fits the 2-CPU node, the other spans the other two.
    assert dp2["nodes_per_group"] == [1, 2]
    assert dp2["crossings"] == [0, 2]
    assert [p["ring"] for p in dp2["placement"]] == [0, 0, 1, 1]
