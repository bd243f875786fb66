"""Placement of one job on Ray: bundles, placement strategy and rank order. Pure Python, no Ray.

The rules themselves (one bundle per rank, bundles per node, STRICT_PACK or PACK, rank order, ring
crossings) live in `workers.parallel_dims`, which the control plane's planner and admission share;
import them from there. What is only the driver's is here: the bundle list Ray is given, the
sentence it reports while the group cannot be placed, and the process-group backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from workers.parallel_dims import WorkerLocation, bundles_per_node, rank_bundle

__all__ = ["capacity_shortfall", "dist_backend", "make_bundles"]


def make_bundles(world_size: int, *, gpu: bool, cpus_per_worker: float) -> list[dict[str, float]]:
    """One bundle per rank."""
    return [rank_bundle(gpu=gpu, cpus_per_worker=cpus_per_worker) for _ in range(world_size)]


def capacity_shortfall(
    bundles: int,
    bundle: Mapping[str, float],
    nodes_total: Sequence[Mapping[str, float]],
    *,
    ranks_per_bundle: int = 1,
) -> str | None:
    """A sentence saying why the group can never be placed on these nodes, or None if it can.
    `ranks_per_bundle` > 1: each bundle is a tensor group (its ranks must share a node)."""
    fits = sum(bundles_per_node(bundle, node) for node in nodes_total)
    if fits >= bundles:
        return None
    want = ", ".join(f"{v:g} {k}" for k, v in bundle.items())
    if ranks_per_bundle > 1:
        return (
            f"the cluster can host at most {fits} of the {bundles} tensor groups ({want} each, "
            f"on one node) across {len(nodes_total)} node(s); waiting for more nodes"
        )
    return (
        f"the cluster can host at most {fits} of the {bundles} ranks ({want} each) across "
        f"{len(nodes_total)} node(s); waiting for more nodes"
    )


def dist_backend(locations: Sequence[WorkerLocation]) -> str:
    """nccl only when every rank has a GPU."""
    return "nccl" if locations and all(loc.gpu_ids for loc in locations) else "gloo"
