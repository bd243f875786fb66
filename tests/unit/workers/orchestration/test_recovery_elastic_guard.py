"""Two small decisions of the driver, on known answers: the resume plan replays the global series
(rank None) from rank 0's journal only, and the resources an elastic shrink counts are Ray's free
ones plus what the job's own group holds, added node by node."""

from __future__ import annotations

import time
from pathlib import Path

from workers.config import JobSpec
from workers.orchestration.elastic import add, choose_shape
from workers.orchestration.recovery import Delivered, plan_resume
from workers.parallel_dims import ParallelDims
from workers.protocol import MetricPoint
from workers.training.checkpoint import step_dir
from workers.training.journal import MetricJournal


def test_a_global_point_is_replayed_once_from_rank_0s_journal(tmp_path: Path) -> None:
    """Rank 1's journal holding a global point (a copy of rank 0's) must not replay it twice."""
    journals = [MetricJournal(tmp_path, r, 0) for r in range(2)]
    for s in (1, 2):
        for j in journals:
            j.append(MetricPoint(step=s, name="loss", value=s + 0.25, time=time.time()))
        journals[1].append(
            MetricPoint(step=s, name="mem_peak_bytes", value=7.0, rank=1, time=time.time())
        )
    for j in journals:
        j.close()
    d = step_dir(tmp_path, 2)
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"x")
    (d / "state.pt").write_bytes(b"x")
    plan = plan_resume(tmp_path, Delivered(2))
    assert plan.step == 2
    keys = [(p.step, p.name, p.rank) for p in plan.replay]
    assert keys == [
        (1, "loss", None),
        (1, "mem_peak_bytes", 1),
        (2, "loss", None),
        (2, "mem_peak_bytes", 1),
    ]


def test_held_resources_add_to_the_free_ones_node_by_node() -> None:
    free = {"w1": {"CPU": 1.0, "memory": 4.0}, "w2": {"CPU": 0.0}}
    held = {"w1": {"CPU": 2.0}, "w2": {"CPU": 2.0, "GPU": 1.0}, "gone": {"CPU": 8.0}}
    assert add(free, held) == {"w1": {"CPU": 3.0, "memory": 4.0}, "w2": {"CPU": 2.0, "GPU": 1.0}}
    assert free == {"w1": {"CPU": 1.0, "memory": 4.0}, "w2": {"CPU": 0.0}}  # not modified


def test_the_largest_shape_that_the_free_plus_held_bundles_fit() -> None:
    """Ring 4 with 1 CPU a rank: 3 free CPUs alone place ring 2; with the group's own 2 back, ring 4
    (5 bundles on two nodes, 4 needed); a lone free CPU places ring 1."""
    spec = JobSpec.model_validate(
        {
            "name": "elastic",
            "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
            "data": {"kind": "passkey", "seq_len": 256, "key_digits": 3},
            "parallel": {"ring_size": 4},
            "resources": {"accelerator": "cpu", "cpus_per_worker": 1},
            "elastic": {"enabled": True},
        }
    )
    free = {"w1": {"CPU": 2.0}, "w2": {"CPU": 1.0}}
    assert choose_shape(spec, free, gpu=False) == ParallelDims(ring_size=2)
    assert choose_shape(spec, add(free, {"w2": {"CPU": 2.0}}), gpu=False) == ParallelDims(
        ring_size=4
    )
    assert choose_shape(spec, {"w1": {"CPU": 1.0}}, gpu=False) == ParallelDims(ring_size=1)
    assert choose_shape(spec, {"w1": {"CPU": 0.5}}, gpu=False) is None
