"""Placement preview: where a spec's ranks would land on a cluster snapshot, and its warnings.

Nothing is reserved. The preview applies the driver's own rules (`workers.parallel_dims`): the
accelerator `auto` resolves to, one bundle per rank and how many fit each node, STRICT_PACK when one
node's total resources hold the whole job (previewed on the one of those with the most free room),
else PACK (the nodes with the most room first); where the bundles land, ranks are ordered by
`order_ranks`, as the driver orders them, and the hops that cross a node boundary are counted along
each ring (`ParallelDims.node_crossings`, as the driver counts them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.launcher import ClusterInfo, NodeInfo
from service.planner.memory import memory_estimate
from workers.config import JobSpec, rope_coverage_warning, ulysses_heads_problem
from workers.parallel_dims import (
    STRICT_PACK,
    ParallelDims,
    WorkerLocation,
    bundles_per_node,
    choose_strategy,
    rank_bundle,
    resolve_accelerator,
)


@dataclass
class RankSlot:
    rank: int
    ring: int
    node_id: str
    device: str


@dataclass
class Plan:
    fits: bool
    accelerator: str
    strategy: str
    world_size: int
    bundle: dict[str, float]
    placement: list[RankSlot] = field(default_factory=list)
    node_crossings: int = 0
    nodes_used: int = 0
    memory: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    suggested_parallel: dict[str, int] | None = (
        None  # Ulysses × ring for this cluster's GPUs per node
    )


def node_resources(node: NodeInfo, *, free: bool) -> dict[str, float]:
    """A node's free or total resources in Ray's terms (what `bundles_per_node` reads)."""
    if free:
        return {"CPU": node.cpus_free, "GPU": node.gpus_free}
    return {"CPU": node.cpus_total, "GPU": node.gpus_total}


def preview_landing(
    world_size: int,
    bundle: dict[str, float],
    nodes: list[NodeInfo],
) -> tuple[str, list[str]]:
    """(strategy, node id of each bundle): where a job that fits the cluster likely lands."""
    totals = [node_resources(n, free=False) for n in nodes]
    strategy = choose_strategy(world_size, bundle, totals)
    free_room = sum(bundles_per_node(bundle, node_resources(n, free=True)) for n in nodes)
    use_free = free_room >= world_size  # else the job waits: preview it on the whole cluster
    candidates = nodes
    if strategy == STRICT_PACK:
        holds_all = [bundles_per_node(bundle, total) >= world_size for total in totals]
        candidates = [n for n, whole in zip(nodes, holds_all, strict=True) if whole]
    rooms = []
    for n in candidates:
        rooms.append((bundles_per_node(bundle, node_resources(n, free=use_free)), n.node_id))
    rooms.sort(key=lambda room: (-room[0], room[1]))
    if strategy == STRICT_PACK:
        return strategy, [rooms[0][1]] * world_size
    landing: list[str] = []
    for room, node_id in rooms:
        landing += [node_id] * min(room, world_size - len(landing))
        if len(landing) == world_size:
            break
    return strategy, landing


def suggest_split(spec: JobSpec, nodes: list[NodeInfo]) -> dict[str, int] | None:
    """Ulysses × ring for one replica's ring_size × ulysses_size ranks: the largest Ulysses group
    that fits inside a node (its all-to-all is latency-bound), divides the sequence group and suits
    the heads; the ring covers the rest across nodes. None when the model's heads are unknown."""
    m = spec.model
    if not m.shape_known:
        return None
    group = ParallelDims.of(spec.parallel).seq_group_size
    per_node = max((int(n.gpus_total) for n in nodes), default=0)
    best = 1
    for u in range(1, group + 1):
        if group % u == 0 and u <= per_node and ulysses_heads_problem(m, u) is None:
            best = u
    return {"ulysses_size": best, "ring_size": group // best}


def plan(spec: JobSpec, cluster: ClusterInfo) -> Plan:
    nodes = [n for n in cluster.nodes if n.alive]
    acc = resolve_accelerator(spec.resources.accelerator, [n.gpus_total for n in nodes])
    bundle = rank_bundle(gpu=acc == "gpu", cpus_per_worker=spec.resources.cpus_per_worker)
    dims = ParallelDims.of(spec.parallel)
    world, ulysses, tensor = dims.world_size, dims.ulysses_size, dims.tensor_size
    # capacity in placement bundles: one per rank, or one per tensor group (on one node)
    unit = dims.placement_bundle(gpu=acc == "gpu", cpus_per_worker=spec.resources.cpus_per_worker)
    units = dims.placement_units
    out = Plan(
        fits=False,
        accelerator=acc,
        strategy=STRICT_PACK,
        world_size=world,
        bundle=bundle,
        memory=memory_estimate(spec, acc),
    )
    total = tensor * sum(bundles_per_node(unit, node_resources(n, free=False)) for n in nodes)
    free = tensor * sum(bundles_per_node(unit, node_resources(n, free=True)) for n in nodes)
    need = "GPUs" if acc == "gpu" else f"bundles of {bundle['CPU']:g} CPU"
    if tensor > 1:
        need += f" in whole tensor groups of {tensor} per node"
    if warning := rope_coverage_warning(spec):
        out.warnings.append(warning)
    if not nodes:
        out.warnings.append("the cluster reports no alive nodes; placement cannot be previewed")
        return out
    if total < world:
        out.warnings.append(
            f"the job needs {world} {need} ({dims.describe()}) "
            f"but the whole cluster has {total}: it can never be placed"
        )
        return out
    if free < world:
        waits = "the job waits QUEUED, holding nothing, until they are"
        out.warnings.append(f"only {free} of the {world} {need} are free now: {waits}")
    out.strategy, landing = preview_landing(units, unit, nodes)
    # One actor per rank (tensor_size of them per bundle), GPU ids counted per node: then the
    # driver's own rank order.
    per_node: dict[str, int] = {}
    locations = []
    for node_id in (n for n in landing for _ in range(tensor)):
        device_index = per_node.get(node_id, 0)
        per_node[node_id] = device_index + 1
        locations.append(WorkerLocation(node_id, "", (str(device_index),) if acc == "gpu" else ()))
    assignments = dims.order_ranks(locations)
    out.fits = True
    out.nodes_used = len(per_node)
    for a in assignments:
        slot = RankSlot(rank=a.rank, ring=a.ring, node_id=a.node_id, device=a.device)
        out.placement.append(slot)
    out.node_crossings = dims.node_crossings(assignments)
    if acc == "gpu" and (split := suggest_split(spec, nodes)) is not None:
        out.suggested_parallel = split
        if split != {"ulysses_size": ulysses, "ring_size": spec.parallel.ring_size}:
            out.warnings.append(
                f"suggested for this cluster: ulysses_size {split['ulysses_size']} x ring_size "
                f"{split['ring_size']} (the all-to-all inside a node, the ring across nodes)"
            )
    if acc == "cpu" and spec.resources.accelerator == "auto" and world > 1:
        on_cpu = "ranks run on CPU with gloo (fine for demos, slow to train)"
        out.warnings.append(f"no GPUs in the cluster: {on_cpu}")
    mem = out.memory["total_bytes"]
    if acc == "gpu" and mem > 80 * 2**30:
        out.warnings.append(
            f"estimated {mem / 2**30:.1f} GiB per rank exceeds an 80 GiB GPU: raise ring_size or "
            "enable train.activation_checkpointing"
        )
    return out
