"""The control plane's half of elastic jobs: refuse at submission what could never shrink.

`workers.config.elastic` lists the shapes a job may run on and the driver picks among them at run
time (`workers.orchestration.elastic`). Here, before anything is stored: the smallest of those
shapes must fit a device's memory by the planner's estimate (a smaller world holds more of the
sequence, the batch and the state per rank), and the job must run on a shared Ray cluster (in
Kueue mode each job gets a RayCluster sized for its own world, whose lost pods KubeRay replaces:
there is nothing smaller to shrink onto).
"""

from __future__ import annotations

from service.launcher import ClusterInfo
from service.planner import GIB, device_memory, memory_estimate
from workers.config import JobSpec, never_shrinks, resized, shapes


def elastic_refusal(spec: JobSpec, cluster: ClusterInfo | None) -> tuple[str, str] | None:
    """(field, message) when `spec.elastic` cannot work on this cluster; None when it can (or is
    off). Memory is judged only where the devices report it."""
    if not spec.elastic.enabled:
        return None
    if cluster is not None and cluster.per_job_clusters:
        return (
            "elastic.enabled",
            "elastic jobs need a shared Ray cluster: in Kueue mode each job gets a RayCluster "
            "sized for its world and KubeRay replaces a lost pod, so there is no smaller shape "
            "to continue on; turn elastic off",
        )
    if (never := never_shrinks(spec)) is not None:
        return never[0], never[2]
    smallest = shapes(spec)[-1]
    if cluster is None or not any(n.alive for n in cluster.nodes):
        return None
    budget, _ = device_memory(spec, cluster)
    if budget is None:
        return None
    need = int(memory_estimate(resized(spec, smallest))["total_bytes"])
    if need > budget:
        return (
            "elastic.min_world_size",
            f"the smallest shape the job may shrink to ({smallest.describe()}, "
            f"{smallest.world_size} rank(s)) needs about {need / GIB:.2f} GiB per rank, more "
            f"than a device holds ({budget / GIB:.2f} GiB): raise elastic.min_world_size",
        )
    return None
