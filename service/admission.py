"""Admission: which queued jobs start now, and why the others wait. Pure functions over plain data
(unit-tested).

Why in the control plane and not in Ray: a queued job must hold nothing (no placement group, no
driver), survive a control-plane restart (the queue is the store's QUEUED rows) and obey per-owner
quotas that Ray does not know about. The scheduler (`service.controller`) calls `decide` on every
pass with the queued jobs, the jobs already admitted, the cluster's free capacity per node and the
quotas; it submits the drivers of `Decision.start` and stores each waiting job's `queue_position`
and reason.

The rules, in order:
1. Queue order: higher `priority` first, then submission time (then id, so the order is total).
2. Quotas (`RINGTRAIN_QUOTAS`): a job whose owner would go over `max_running_jobs`, `max_cpus` or
   `max_gpus` with it is skipped — it keeps its place but blocks nobody else.
3. Capacity: a job starts when its ranks fit the free capacity now, node by node (one bundle per
   rank or per tensor group, counted per node by `workers.parallel_dims.bundles_per_node`, as the
   driver reserves them): the lower of Ray's free figure and ringtrain's own ledger (`free_nodes`),
   so neither Ray's reporting lag nor a job admitted a moment ago over-commits the cluster; each
   admission in a pass takes its share.
4. No starvation: a job that cannot fit lets later (smaller) jobs start past it — until it has
   waited `reserve_after_s`. From then on it *reserves*: nothing behind it starts until it has
   started, so capacity freed by finishing jobs accumulates for it. (Priority stays strict: a job of
   higher priority is ahead of it, not behind.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from service.launcher import ClusterInfo, NodeInfo
from workers.config import JobSpec
from workers.parallel_dims import ParallelDims, bundles_per_node, resolve_accelerator


class Quota(BaseModel):
    """One owner's limits on jobs admitted at once (PLACING, RUNNING, RETRYING); unset =
    unlimited."""

    model_config = ConfigDict(extra="forbid")

    max_running_jobs: int | None = Field(None, ge=0)
    max_cpus: float | None = Field(None, ge=0)
    max_gpus: float | None = Field(None, ge=0)


class NodeShape(BaseModel):
    """A node the cluster's autoscaler may add (`RINGTRAIN_AUTOSCALER_NODES`): a worker group's pod
    resources and its `maxReplicas`. Counted as free capacity so that a job waiting for it is
    admitted: its driver's pending placement group is the demand Ray's autoscaler acts on (a queued
    job holds nothing, so it would never be seen)."""

    model_config = ConfigDict(extra="forbid")

    cpus: float = Field(gt=0)
    gpus: float = Field(0.0, ge=0)
    max_nodes: int = Field(ge=0)
    group: str = Field("", description="the worker group's name, for messages that name the limit")


def with_autoscaler(cluster: ClusterInfo, shapes: Sequence[NodeShape]) -> ClusterInfo:
    """The cluster plus, per shape, the nodes of that shape the autoscaler may still add (idle, not
    alive yet)."""
    extra = []
    for i, shape in enumerate(shapes):
        have = sum(
            1
            for n in cluster.nodes
            if n.alive and (n.cpus_total, n.gpus_total) == (shape.cpus, shape.gpus)
        )
        for k in range(max(0, shape.max_nodes - have)):
            extra.append(
                NodeInfo(
                    f"autoscaler-{i}-{k}", "", True, shape.cpus, shape.cpus, shape.gpus, shape.gpus
                )
            )
    return dataclasses.replace(cluster, nodes=[*cluster.nodes, *extra]) if extra else cluster


@dataclass(frozen=True)
class Demand:
    """What a job reserves: `bundles` bundles of `cpus_per_bundle` CPUs (+ `gpus_per_bundle` GPUs),
    one per rank."""

    bundles: int
    cpus_per_bundle: float
    gpus_per_bundle: float = 0.0

    @property
    def bundle(self) -> dict[str, float]:
        """One rank's resources, in Ray's terms."""
        bundle = {"CPU": self.cpus_per_bundle}
        if self.gpus_per_bundle:
            bundle["GPU"] = self.gpus_per_bundle
        return bundle

    @property
    def cpus(self) -> float:
        return self.bundles * self.cpus_per_bundle

    @property
    def gpus(self) -> float:
        return self.bundles * self.gpus_per_bundle

    def describe(self) -> str:
        unit = f"{self.cpus_per_bundle:g} CPU" + (
            f" + {self.gpus_per_bundle:g} GPU" if self.gpus_per_bundle else ""
        )
        return f"{self.bundles} x ({unit})"


def uses_gpus(spec: JobSpec, cluster: ClusterInfo) -> bool:
    """Whether the job runs on GPUs here (`resolve_accelerator`: the planner's, the driver's)."""
    node_gpus = [n.gpus_total for n in cluster.nodes if n.alive]
    return resolve_accelerator(spec.resources.accelerator, node_gpus) == "gpu"


def demand_of(spec: JobSpec, gpu: bool) -> Demand:
    """The job's placement bundles: one per rank, or one per tensor group (kept on one node); for
    a job with stages, its largest stage's (one stage holds its group at a time)."""
    spec = spec.largest_stage().spec
    dims = ParallelDims.of(spec.parallel)
    bundle = dims.placement_bundle(gpu=gpu, cpus_per_worker=spec.resources.cpus_per_worker)
    return Demand(dims.placement_units, bundle["CPU"], bundle.get("GPU", 0.0))


@dataclass
class Free:
    """Free capacity of one node (mutable: admitting a job takes its bundles out)."""

    node_id: str
    cpus: float
    gpus: float

    def holds(self, d: Demand) -> int:
        """How many of the job's bundles fit on this node."""
        return bundles_per_node(d.bundle, {"CPU": self.cpus, "GPU": self.gpus})


def fits(d: Demand, nodes: Sequence[Free]) -> bool:
    return sum(n.holds(d) for n in nodes) >= d.bundles


def take(d: Demand, nodes: list[Free]) -> None:
    """Charge the job's bundles to the nodes with the most room first (Ray's PACK fills few nodes);
    partially when the job does not fit (its placement is pending somewhere: whatever is left is
    still spoken for)."""
    left = d.bundles
    for n in sorted(nodes, key=lambda n: (-n.holds(d), n.node_id)):
        k = min(n.holds(d), left)
        n.cpus -= k * d.cpus_per_bundle
        n.gpus -= k * d.gpus_per_bundle
        left -= k
        if left == 0:
            return


def free_nodes(
    cluster: ClusterInfo,
    placed: Sequence[tuple[str, Demand, int]] = (),
    pending: Sequence[Demand] = (),
) -> list[Free]:
    """Free capacity per alive node: the lower of two views. Ray's own figure (which sees every user
    of the cluster, but lags a placement group by a second or two) and ringtrain's ledger: the
    node's total less the bundles of jobs known to run there (`placed`: node id, demand, ranks
    there) and less admitted jobs not placed yet (`pending`, charged where they most likely land).
    Charging pending jobs to the ledger only, never to Ray's figure, counts a job whose placement
    group Ray already shows once, not twice."""
    claimed: dict[str, list[float]] = {}
    for node_id, d, ranks in placed:
        c = claimed.setdefault(node_id, [0.0, 0.0])
        c[0] += ranks * d.cpus_per_bundle
        c[1] += ranks * d.gpus_per_bundle
    alive = [n for n in cluster.nodes if n.alive]
    ledger = []
    for n in alive:
        used = claimed.get(n.node_id, [0.0, 0.0])
        ledger.append(Free(n.node_id, n.cpus_total - used[0], n.gpus_total - used[1]))
    for d in pending:
        take(d, ledger)
    return [
        Free(n.node_id, min(n.cpus_free, o.cpus), min(n.gpus_free, o.gpus))
        for n, o in zip(alive, ledger, strict=True)
    ]


def total_nodes(cluster: ClusterInfo) -> list[Free]:
    return [Free(n.node_id, n.cpus_total, n.gpus_total) for n in cluster.nodes if n.alive]


@dataclass(frozen=True)
class Queued:
    job_id: str
    owner: str
    priority: int
    created_at: float
    demand: Demand


@dataclass(frozen=True)
class Admitted:
    """A job that holds (or is about to hold) capacity: its owner's usage counts against the
    quota."""

    job_id: str
    owner: str
    demand: Demand


@dataclass
class Decision:
    start: list[str] = field(default_factory=list)
    waiting: dict[str, tuple[int, str]] = field(
        default_factory=dict
    )  # job id → (queue position, why it waits)
    too_big: set[str] = field(default_factory=set)  # waiting jobs the whole cluster cannot hold now


def order(queued: Sequence[Queued]) -> list[Queued]:
    return sorted(queued, key=lambda q: (-q.priority, q.created_at, q.job_id))


def quota_block(
    owner: str, d: Demand, usage: tuple[int, float, float], quota: Quota | None
) -> str | None:
    """Why starting one more job of `owner` would break its quota (None: it would not)."""
    if quota is None:
        return None
    jobs, cpus, gpus = usage
    if quota.max_running_jobs is not None and jobs + 1 > quota.max_running_jobs:
        return f"owner {owner!r} is at its quota of {quota.max_running_jobs} running job(s)"
    if quota.max_cpus is not None and cpus + d.cpus > quota.max_cpus + 1e-9:
        return (
            f"owner {owner!r} would use {cpus + d.cpus:g} CPUs, "
            f"over its quota of {quota.max_cpus:g} ({cpus:g} used)"
        )
    if quota.max_gpus is not None and gpus + d.gpus > quota.max_gpus + 1e-9:
        return (
            f"owner {owner!r} would use {gpus + d.gpus:g} GPUs, "
            f"over its quota of {quota.max_gpus:g} ({gpus:g} used)"
        )
    return None


def never_within_quota(owner: str, d: Demand, quota: Quota | None) -> str | None:
    """Why the job alone is over its owner's quota: it could never start (refused at submission)."""
    return quota_block(owner, d, (0, 0.0, 0.0), quota)


def decide(
    queued: Sequence[Queued],
    admitted: Sequence[Admitted],
    free: list[Free] | None,
    total: Sequence[Free],
    quotas: Mapping[str, Quota],
    now: float,
    reserve_after_s: float,
) -> Decision:
    """Which queued jobs start now (in order) and, for the rest, their 1-based queue position and
    the reason.

    `free` is the free capacity per node after charging admitted jobs whose placement Ray may not
    show yet; it is consumed as jobs are admitted; None when every job brings its own cluster (Kueue
    mode: the queue system in front of the cluster holds the quota, so only `total` and the owners'
    quotas hold a job here). `total` is every alive node's whole capacity: a job larger than that
    (the cluster shrank after it was accepted) waits in `Decision.too_big`, never reserving."""
    usage: dict[str, tuple[int, float, float]] = {}
    for a in admitted:
        j, c, g = usage.get(a.owner, (0, 0.0, 0.0))
        usage[a.owner] = (j + 1, c + a.demand.cpus, g + a.demand.gpus)
    out = Decision()
    reserving: Queued | None = None
    position = 0
    for q in order(queued):
        why = None
        if not fits(q.demand, total):
            room = sum(n.holds(q.demand) for n in total)
            why = (
                f"the whole cluster now has room for {room} of its {q.demand.describe()} "
                "(nodes lost?)"
            )
            out.too_big.add(q.job_id)
        if why is None:
            why = quota_block(
                q.owner, q.demand, usage.get(q.owner, (0, 0.0, 0.0)), quotas.get(q.owner)
            )
        if why is None and reserving is not None:
            why = (
                f"behind job {reserving.job_id}, which has waited over {reserve_after_s:g}s "
                "and reserves the capacity that frees up"
            )
        if why is None and free is not None and not fits(q.demand, free):
            room = sum(n.holds(q.demand) for n in free)
            why = f"waiting for capacity: needs {q.demand.describe()}, room for {room} now"
            if now - q.created_at >= reserve_after_s:
                reserving = q
                why += f"; waited over {reserve_after_s:g}s, so jobs behind it wait for it"
        if why is None:
            out.start.append(q.job_id)
            if free is not None:
                take(q.demand, free)
            j, c, g = usage.get(q.owner, (0, 0.0, 0.0))
            usage[q.owner] = (j + 1, c + q.demand.cpus, g + q.demand.gpus)
            continue
        position += 1
        out.waiting[q.job_id] = (position, why)
    return out
