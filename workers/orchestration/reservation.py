"""Reserving a job's ranks on Ray: one placement group, one rank actor per bundle, ranks ordered by
where they landed.

`reserve` returns a `RankGroup`; `init_group` joins its ranks into one torch.distributed group. Both
turn a dead actor or node into `RankLost` (the driver's recovery retries those) and check for
cancellation while they wait, so no wait is unbounded.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from workers.config import JobSpec
from workers.orchestration.actor import RankInfo, remote_rank_actor
from workers.orchestration.placement import capacity_shortfall, dist_backend
from workers.parallel_dims import (
    ParallelDims,
    RankAssignment,
    WorkerLocation,
    choose_strategy,
    rank_bundle,
    resolve_accelerator,
)
from workers.protocol import RankPlacement

ACTOR_NAMESPACE = "ringtrain"


class Cancelled(Exception):
    """SIGTERM / stop requested."""


class PlacementTimeout(Exception):
    """The placement group was not ready in time: not retried (the cluster is too small or busy)."""


class RankLost(Exception):
    """A rank actor or its node died: recoverable by re-reserving and resuming from the
    checkpoint."""


def lost_errors() -> tuple[type[BaseException], ...]:
    """Ray errors that mean "the process or node is gone", not "the code raised"."""
    from ray import exceptions as rx

    names = (
        "RayActorError",
        "ActorDiedError",
        "ActorUnavailableError",
        "NodeDiedError",
        "WorkerCrashedError",
        "ObjectLostError",
        "OwnerDiedError",
        "LocalRayletDiedError",
    )
    return tuple(getattr(rx, n) for n in names if hasattr(rx, n))


def short(e: BaseException, n: int = 600) -> str:
    text = str(e).strip().splitlines()
    head = text[0] if text else type(e).__name__
    return f"{type(e).__name__}: {head}"[:n]


@dataclass
class RankGroup:
    """One reservation: the placement group, its actors (bundle order) and the rank assignment."""

    pg: PlacementGroup | None
    actors: list[Any]
    locations: list[WorkerLocation] = field(default_factory=list)
    assignments: list[RankAssignment] = field(default_factory=list)  # by rank
    strategy: str = ""
    backend: str = "gloo"
    attention_backend: str = ""
    pids: list[int] = field(default_factory=list)

    def actor(self, rank: int) -> Any:
        return self.actors[self.assignments[rank].actor_index]

    def ranked_actors(self) -> list[Any]:
        return [self.actor(r) for r in range(len(self.assignments))]

    def placement(self) -> list[RankPlacement]:
        return [
            RankPlacement(
                rank=a.rank,
                node_id=a.node_id,
                node_ip=a.node_ip,
                device=a.device,
                ring=a.ring,
            )
            for a in self.assignments
        ]

    def teardown(self) -> None:
        """Kill actors and remove the placement group (idempotent, never raises)."""
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        self.actors = []
        if self.pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
            self.pg = None


def alive_node_resources() -> list[dict[str, float]]:
    """Each alive node's total resources, as Ray reports them."""
    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def wants_gpus(spec: JobSpec, nodes_total: Sequence[Mapping[str, float]]) -> bool:
    """True = one GPU per rank (`parallel_dims.resolve_accelerator`: the control plane's rule)."""
    node_gpus = [node.get("GPU", 0.0) for node in nodes_total]
    return resolve_accelerator(spec.resources.accelerator, node_gpus) == "gpu"


def ray_get(refs: list[Any], timeout_s: float, cancelled: Callable[[], bool]) -> list[Any]:
    """ray.get with a deadline, a cancel check, and lost-actor errors turned into RankLost."""
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        if cancelled():
            raise Cancelled()
        if time.monotonic() > deadline:
            raise RankLost(f"rank actors did not answer within {timeout_s:g}s")
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
    try:
        return list(ray.get(refs))
    except lost_errors() as e:
        raise RankLost(f"a rank actor died: {short(e)}") from e


def reserve(
    spec: JobSpec,
    *,
    name: str,
    timeout_s: float,
    gpu: bool | None = None,
    on_waiting: Callable[[str], None] = lambda reason: None,
    cancelled: Callable[[], bool] = lambda: False,
    actor_start_timeout_s: float = 300.0,
) -> RankGroup:
    """Reserve the placement group, start one actor per bundle, read their locations and order the
    ranks.

    `gpu`: one GPU per rank (None: decide from the spec and the cluster). `on_waiting(reason)` is
    called once before waiting for the group (the PLACING reason). Raises PlacementTimeout,
    Cancelled or RankLost; releases whatever it created when it raises.
    """
    dims = ParallelDims.of(spec.parallel)
    world, units, per_unit = dims.world_size, dims.placement_units, dims.tensor_size
    nodes_total = alive_node_resources()
    gpu = wants_gpus(spec, nodes_total) if gpu is None else gpu
    rank = rank_bundle(gpu=gpu, cpus_per_worker=spec.resources.cpus_per_worker)
    # one bundle per rank; with tensor parallelism one per tensor group, which Ray keeps on a node
    unit = dims.placement_bundle(gpu=gpu, cpus_per_worker=spec.resources.cpus_per_worker)
    bundles = [dict(unit) for _ in range(units)]
    strategy = choose_strategy(units, unit, nodes_total)
    shortfall = capacity_shortfall(units, unit, nodes_total, ranks_per_bundle=per_unit)
    want = ", ".join(f"{v:g} {k}" for k, v in unit.items())
    what = f"{units} tensor group(s) of {per_unit}" if per_unit > 1 else f"{world} rank(s)"
    reason = f"waiting for resources: {what} x ({want}), {strategy}"
    if shortfall:
        reason += f"; {shortfall}"
    pg = placement_group(bundles, strategy=strategy, name=name)
    group = RankGroup(pg=pg, actors=[], strategy=strategy)
    try:
        on_waiting(reason)
        deadline = time.monotonic() + timeout_s
        ready = pg.ready()
        while not ray.wait([ready], timeout=0.5)[0]:
            if cancelled():
                raise Cancelled()
            if time.monotonic() > deadline:
                raise PlacementTimeout(
                    f"could not place {what} x ({want}) within {timeout_s:g}s "
                    f"({strategy}): {shortfall or 'the cluster resources stayed busy'}"
                )
        group.actors = [
            remote_rank_actor(
                num_cpus=rank["CPU"],
                num_gpus=rank.get("GPU", 0.0),
                placement_group=pg,
                bundle_index=i // per_unit,  # a tensor group's actors share its bundle
                name=f"{name}-b{i}",
                namespace=ACTOR_NAMESPACE,
            )
            for i in range(world)
        ]
        infos: list[RankInfo] = ray_get(
            [a.info.remote() for a in group.actors], actor_start_timeout_s, cancelled
        )
        group.locations = [WorkerLocation(i.node_id, i.node_ip, i.gpu_ids) for i in infos]
        group.pids = [i.pid for i in infos]
        # Each replica's sequence group is a contiguous block of ranks, on as few nodes as possible.
        group.assignments = dims.order_ranks(group.locations)
        group.backend = dist_backend(group.locations)
        return group
    except BaseException:
        group.teardown()
        raise


def init_group(group: RankGroup, cancelled: Callable[[], bool], timeout_s: float = 300.0) -> None:
    """Rendezvous: rank 0 picks a free port on its node; every rank joins the default process
    group."""
    rank0 = group.assignments[0]
    port = ray_get([group.actor(0).free_port.remote()], 60, cancelled)[0]
    refs = [
        group.actor(a.rank).setup.remote(
            rank=a.rank,
            world_size=len(group.assignments),
            local_rank=a.local_rank,
            local_world_size=a.local_world_size,
            visible_devices=list(a.visible_devices),
            device=a.device,
            master_addr=rank0.node_ip,
            master_port=port,
            backend=group.backend,
            timeout_s=timeout_s,
        )
        for a in group.assignments
    ]
    ray_get(refs, timeout_s, cancelled)
    group.attention_backend = str(
        ray_get([group.actor(0).attention_backend.remote()], 60, cancelled)[0]
    )
