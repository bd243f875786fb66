"""The driver's half of elastic jobs: which of a job's shapes can be placed now.

`workers.config.elastic.shapes` lists the shapes a job may run on (its own first); the control
plane checked at submission that the smallest fits a device's memory. Here the driver counts
placement bundles against the resources Ray reports free on each alive node, plus what the job's
own group holds (released before the next group is reserved), and takes the largest shape whose
bundles fit. Bundles are counted per node (a bundle never spans nodes), so the count is what Ray
could place; another job may still take the capacity first, in which case the reservation waits
as any reservation does.
"""

from __future__ import annotations

from collections.abc import Mapping

from workers.config import JobSpec
from workers.config.elastic import shapes
from workers.parallel_dims import ParallelDims, bundles_per_node

NodeResources = Mapping[str, Mapping[str, float]]  # node id -> resource -> amount


def placeable(spec: JobSpec, dims: ParallelDims, free: NodeResources, *, gpu: bool) -> bool:
    """Whether `dims`'s bundles fit into `free`, node by node."""
    bundle = dims.placement_bundle(gpu=gpu, cpus_per_worker=spec.resources.cpus_per_worker)
    units = sum(bundles_per_node(bundle, node) for node in free.values())
    return units >= dims.placement_units


def choose_shape(spec: JobSpec, free: NodeResources, *, gpu: bool) -> ParallelDims | None:
    """The largest of the job's shapes that fits `free` now; None when none at or above
    `elastic.min_world_size` does (the job then waits for its own shape, as a non-elastic job)."""
    for dims in shapes(spec):
        if placeable(spec, dims, free, gpu=gpu):
            return dims
    return None


def add(free: NodeResources, held: NodeResources) -> dict[str, dict[str, float]]:
    """`free` plus `held` (what a group the driver is about to release holds), per node."""
    out = {node: dict(res) for node, res in free.items()}
    for node, res in held.items():
        if node not in out:
            continue  # a node that is gone gives nothing back
        for k, v in res.items():
            out[node][k] = out[node].get(k, 0.0) + v
    return out
