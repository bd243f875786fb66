"""Placement logic for one job: bundles, placement strategy and rank ordering. Pure Python, no Ray.

Why rank ordering is needed at all: Ray places placement-group bundles without keeping the bundles of one node
contiguous, so "rank = bundle index" makes a ring hop between nodes at arbitrary points. After the actors are up
we read where each one landed (node id, node IP, GPU ids) and assign ranks ourselves:

* actors are grouped by node (nodes in order of first appearance), GPU id ascending inside a node;
* every data-parallel replica's ring (rank = dp_index × ring_size + ring_rank) is filled with as few nodes as
  possible (best fit: whole nodes first, then the node whose remaining actors fit the gap exactly / split the
  smallest node that covers it), and its node segments are contiguous, so a ring spanning k ≥ 2 nodes crosses a
  node boundary exactly k times (0 times on one node);
* on each node, CUDA_VISIBLE_DEVICES is the sorted union of that node's GPU ids of this job, and an actor's device
  is `cuda:<index of its GPU in that list>` — the usual local-rank convention, so NCCL sees its peers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

STRICT_PACK = "STRICT_PACK"
PACK = "PACK"


@dataclass(frozen=True)
class WorkerLocation:
    """Where one actor (bundle i) landed, as reported by the actor itself."""

    node_id: str
    node_ip: str
    gpu_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class RankAssignment:
    rank: int
    actor_index: int  # index of the actor / bundle this rank runs on
    node_id: str
    node_ip: str
    ring: int  # data-parallel replica index
    ring_rank: int
    local_rank: int  # index among this job's actors on the same node (GPU id order)
    local_world_size: int
    visible_devices: tuple[str, ...]  # sorted union of the node's GPU ids ("" list on CPU)
    device: str  # "cuda:<k>" or "cpu"


def make_bundles(world_size: int, *, gpu: bool, cpus_per_worker: float) -> list[dict[str, float]]:
    """One bundle per rank."""
    bundle: dict[str, float] = {"GPU": 1.0, "CPU": float(cpus_per_worker)} if gpu else {"CPU": float(cpus_per_worker)}
    return [dict(bundle) for _ in range(world_size)]


def bundles_fit_on_node(n: int, bundle: Mapping[str, float], node_resources: Mapping[str, float]) -> bool:
    return all(node_resources.get(k, 0.0) + 1e-9 >= v * n for k, v in bundle.items() if v > 0)


def choose_strategy(world_size: int, bundle: Mapping[str, float], nodes_total: Sequence[Mapping[str, float]]) -> str:
    """STRICT_PACK when the whole group fits one node's total resources, else PACK (fewest nodes, best effort)."""
    if any(bundles_fit_on_node(world_size, bundle, node) for node in nodes_total):
        return STRICT_PACK
    return PACK


def capacity_shortfall(
    world_size: int, bundle: Mapping[str, float], nodes_total: Sequence[Mapping[str, float]]
) -> str | None:
    """A sentence saying why the group can never be placed on these nodes, or None if it can."""
    fits = 0
    for node in nodes_total:
        per_node = min((int(node.get(k, 0.0) // v) if v > 0 else world_size) for k, v in bundle.items())
        fits += max(per_node, 0)
    if fits >= world_size:
        return None
    want = ", ".join(f"{v:g} {k}" for k, v in bundle.items())
    return (
        f"the cluster can host at most {fits} of the {world_size} ranks ({want} each) across "
        f"{len(nodes_total)} node(s); waiting for more nodes"
    )


def _gpu_key(g: str) -> tuple[int, int | str]:
    return (0, int(g)) if str(g).isdigit() else (1, str(g))


def order_ranks(locations: Sequence[WorkerLocation], ring_size: int, data_parallel: int = 1) -> list[RankAssignment]:
    """Assign ranks to actors (index = bundle/actor order). Returns assignments indexed by rank."""
    world = ring_size * data_parallel
    if len(locations) != world:
        raise ValueError(
            f"expected {world} actors (ring_size {ring_size} × data_parallel {data_parallel}), got {len(locations)}"
        )
    # Group by node in order of first appearance; GPU id ascending (then bundle index) inside a node.
    nodes: dict[str, list[int]] = {}
    for i, loc in enumerate(locations):
        nodes.setdefault(loc.node_id, []).append(i)
    for idxs in nodes.values():
        idxs.sort(key=lambda i: (min((_gpu_key(g) for g in locations[i].gpu_ids), default=(2, 0)), i))
    node_order = list(nodes)
    remaining = {n: list(idxs) for n, idxs in nodes.items()}

    # Fill rings with as few nodes as possible (best fit decreasing); each ring is a list of (node, actors).
    rings: list[list[tuple[str, list[int]]]] = []
    for _ in range(data_parallel):
        need, segs = ring_size, []
        while need:
            avail = [n for n in node_order if remaining[n]]
            exact = [n for n in avail if len(remaining[n]) == need]
            cover = [n for n in avail if len(remaining[n]) > need]
            if exact:
                pick = exact[0]
            elif cover:
                pick = min(cover, key=lambda n: (len(remaining[n]), node_order.index(n)))
            else:
                pick = max(avail, key=lambda n: (len(remaining[n]), -node_order.index(n)))
            take = remaining[pick][:need]
            remaining[pick] = remaining[pick][need:]
            segs.append((pick, take))
            need -= len(take)
        rings.append(segs)

    # Keep a node shared by consecutive rings adjacent in global rank order: its segment goes last in the earlier
    # ring and first in the later one (a ring is a cycle, so segment order does not change its crossings).
    for d, segs in enumerate(rings):
        prev_nodes = {n for n, _ in rings[d - 1]} if d else set()
        next_nodes = {n for n, _ in rings[d + 1]} if d + 1 < len(rings) else set()
        segs.sort(key=lambda s: 0 if s[0] in prev_nodes else 2 if s[0] in next_nodes else 1)

    # Per-node local ranks and visible devices (GPU order, independent of ring order).
    local: dict[int, tuple[int, int]] = {}
    visible: dict[str, tuple[str, ...]] = {}
    for n, idxs in nodes.items():
        for k, i in enumerate(idxs):
            local[i] = (k, len(idxs))
        visible[n] = tuple(sorted({g for i in idxs for g in locations[i].gpu_ids}, key=_gpu_key))

    out: list[RankAssignment] = []
    for d, segs in enumerate(rings):
        ring_rank = 0
        for n, idxs in segs:
            for i in idxs:
                loc = locations[i]
                vis = visible[n]
                device = f"cuda:{vis.index(loc.gpu_ids[0])}" if loc.gpu_ids else "cpu"
                out.append(
                    RankAssignment(
                        rank=d * ring_size + ring_rank,
                        actor_index=i,
                        node_id=n,
                        node_ip=loc.node_ip,
                        ring=d,
                        ring_rank=ring_rank,
                        local_rank=local[i][0],
                        local_world_size=local[i][1],
                        visible_devices=vis,
                        device=device,
                    )
                )
                ring_rank += 1
    return out


def ring_crossings(assignments: Sequence[RankAssignment], ring_size: int) -> list[int]:
    """Per ring: how many neighbouring pairs (cyclic, r → r+1 mod W) sit on different nodes."""
    by_rank = sorted(assignments, key=lambda a: a.rank)
    out = []
    for d in range(len(by_rank) // ring_size):
        ring = by_rank[d * ring_size : (d + 1) * ring_size]
        out.append(
            sum(ring[i].node_id != ring[(i + 1) % ring_size].node_id for i in range(ring_size)) if ring_size > 1 else 0
        )
    return out


def node_crossings(assignments: Sequence[RankAssignment], ring_size: int) -> int:
    """Total ring hops that cross a node boundary, over all rings."""
    return sum(ring_crossings(assignments, ring_size))


def nodes_per_ring(assignments: Sequence[RankAssignment], ring_size: int) -> list[int]:
    by_rank = sorted(assignments, key=lambda a: a.rank)
    return [
        len({a.node_id for a in by_rank[d * ring_size : (d + 1) * ring_size]}) for d in range(len(by_rank) // ring_size)
    ]


def dist_backend(locations: Sequence[WorkerLocation]) -> str:
    """nccl only when every rank has a GPU."""
    return "nccl" if locations and all(loc.gpu_ids for loc in locations) else "gloo"
