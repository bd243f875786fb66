"""The control plane refuses elastic jobs that could never shrink (service.elastic), on the
planner's memory estimate and the launcher's kind of cluster."""

from __future__ import annotations

from service.elastic import elastic_refusal
from service.launcher import ClusterInfo, NodeInfo
from service.planner import memory_estimate
from workers.config import JobSpec
from workers.config.elastic import resized
from workers.parallel_dims import ParallelDims


def spec(min_world: int | None = None) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "e",
            "model": {"d_model": 64, "n_layers": 2, "n_heads": 4},
            "data": {"kind": "passkey", "seq_len": 4096, "key_digits": 3},
            "parallel": {"ring_size": 4},
            "train": {"steps": 4},
            "elastic": {"enabled": True, "min_world_size": min_world},
        }
    )


def cpu_cluster(bytes_per_cpu: float) -> ClusterInfo:
    node = NodeInfo("n", "10.0.0.1", True, 8, 8, 0, 0, memory_bytes=8 * bytes_per_cpu)
    return ClusterInfo(nodes=[node])


def test_the_smallest_shape_must_fit_a_rank_s_memory() -> None:
    s = spec()
    one = int(memory_estimate(resized(s, ParallelDims(1, 1)))["total_bytes"])
    two = int(memory_estimate(resized(s, ParallelDims(1, 2)))["total_bytes"])
    assert two < one  # a longer shard per rank costs more
    assert elastic_refusal(s, cpu_cluster(one * 1.01)) is None
    field, message = elastic_refusal(s, cpu_cluster((one + two) / 2)) or ("", "")
    assert field == "elastic.min_world_size" and "ring_size 1" in message, message
    # a floor of 2 ranks: the ring of 2 is the smallest, and it fits
    assert elastic_refusal(spec(min_world=2), cpu_cluster((one + two) / 2)) is None
    assert elastic_refusal(s, ClusterInfo()) is None  # no nodes known: decided at run time


def test_a_job_with_no_smaller_shape_is_refused() -> None:
    field, message = elastic_refusal(spec(min_world=4), cpu_cluster(1e12)) or ("", "")
    assert field == "elastic.min_world_size" and "could never shrink" in message


def test_kueue_mode_has_nothing_to_shrink_onto() -> None:
    field, message = elastic_refusal(spec(), ClusterInfo(per_job_clusters=True)) or ("", "")
    assert field == "elastic.enabled" and "Kueue" in message


def test_elastic_off_is_never_refused() -> None:
    off = spec().model_copy(
        update={"elastic": spec().elastic.model_copy(update={"enabled": False})}
    )
    assert elastic_refusal(off, ClusterInfo(per_job_clusters=True)) is None
    assert elastic_refusal(off, cpu_cluster(1.0)) is None
