"""The parallel shape of a job and the placement rules every layer shares. No torch, no Ray.

Why one module: the planner's preview, admission, the driver's reservation and the trainer's mesh
must agree on how many ranks a job has, which ranks share a sequence, which accelerator `auto` means
and how many ranks fit a node; separate copies of these rules drift apart. This module sits beside
`workers.config` and `workers.protocol` in the ground layer, so the control plane may import it.

The shape (`ParallelDims`, after torchtitan's class of the same name): world = pipeline_size x
data_parallel x ring_size x ulysses_size x tensor_size. The *sequence group* is the ulysses_size x
ring_size ranks the sequence is split over; a tensor-parallel group (tensor_size ranks) holds the
same tokens and splits the heads and MLP columns instead. A *replica* is one data-parallel copy:
ring x Ulysses x tensor ranks. Its ranks are contiguous, tensor innermost, then Ulysses:

    rank = pp_rank * stage_size
           + ((dp_index * ring_size + ring_rank) * ulysses_size + ulysses_rank) * tensor_size
           + tp_rank

with stage_size = data_parallel x ring x Ulysses x tensor: the pipeline dimension is outermost, so
one pipeline stage's ranks (its FSDP, ring, Ulysses and tensor groups) are one contiguous block, on
as few nodes as possible, and only the stage-to-stage hops (activations, once per microbatch) are
left to cross nodes. Without a pipeline (pipeline_size 1) pp_rank is 0 and nothing changes.

so a tensor group (four collectives per block: the chattiest) is a block of neighbouring ranks on
one node, a Ulysses group (the latency-bound all-to-all) is a block of tensor groups, a ring is a
block of Ulysses groups, and rank ordering keeps each replica on as few nodes as possible.
`seq_divisor(layout)` is what the global sequence length must be a multiple of: the ring layout
cuts the sequence into ring_size (contiguous, striped) or 2 x ring_size (zigzag) chunks, each
ring shard splits again into ulysses_size equal pieces, and a tensor group splits each of those
into tensor_size pieces of the residual stream (sequence parallelism between its projections).

The rules, each decided here only:

- Accelerator (`resolve_accelerator`): `auto` means GPUs when any alive node has a GPU (in the
  control plane: counting the nodes the autoscaler may add), not only when the cluster's GPUs
  number at least the world size, so a job admitted and charged as a GPU job never starts on CPUs.
  A job's demand is one GPU per rank and must not change with what happens to be up; a job larger
  than the GPUs waits for them or is refused, never moved silently onto CPUs, and a GPU group the
  autoscaler scaled to zero still means GPUs.
- One bundle per rank (`rank_bundle`): {"CPU": cpus_per_worker}, plus {"GPU": 1} on GPUs. With
  tensor parallelism, one bundle per *tensor group* (`ParallelDims.placement_bundle`: a rank's
  resources times tensor_size, its T actors started inside it): Ray keeps a bundle on one node,
  but nothing short of STRICT_PACK for the whole job keeps several bundles together, and a tensor
  group split over two nodes would put its per-block collectives on the network. Capacity is
  counted in these units everywhere (admission, planner, driver).
- Bundles per node (`bundles_per_node`): counted in Ray's resource unit (0.0001), as Ray itself
  counts, so 0.3 free CPUs hold three bundles of 0.1 CPU (float floor division says two, and the
  planner and admission would disagree with the driver's placement check).
- Strategy (`choose_strategy`): STRICT_PACK when one node's *total* resources hold the whole job,
  else PACK. The planner previews what the driver will ask Ray for.
- Rank order (`order_ranks`) and crossings (`ParallelDims.ring_crossings`): the planner's preview
  and the driver call the same functions. A tensor group never spans nodes: its all-reduces sit on
  the critical path of every block, so ranks are handed out in whole tensor groups per node, and a
  placement that leaves a node a part of one is refused (`TensorGroupSplit`). Crossings are counted
  along the actual rings (`ParallelDims.rings`: the ranks that share dp_index, ulysses_rank and
  tp_rank, ulysses_size x tensor_size apart), not along consecutive ranks: with Ulysses or tensor
  parallelism consecutive ranks are Ulysses or tensor peers, so a ring whose every hop crosses
  nodes can sit in a replica whose consecutive ranks share a node.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol

LAYOUTS = ("contiguous", "zigzag", "striped")
Accelerator = Literal["gpu", "cpu"]
STRICT_PACK = "STRICT_PACK"
PACK = "PACK"
RESOURCE_UNIT = 1e-4  # Ray's fixed-point resource granularity


class _ParallelFields(Protocol):
    """What `ParallelDims.of` reads (`workers.config.ParallelConfig`, which imports this module)."""

    @property
    def data_parallel(self) -> int: ...

    @property
    def ring_size(self) -> int: ...

    @property
    def ulysses_size(self) -> int: ...

    @property
    def tensor_size(self) -> int: ...


class TensorGroupSplit(ValueError):
    """A placement put part of a tensor-parallel group on another node."""


@dataclass(frozen=True)
class RankCoordinates:
    """Where one rank sits in the shape."""

    dp_index: int  # data-parallel replica
    ring_rank: int
    ulysses_rank: int
    tp_rank: int = 0
    pp_rank: int = 0  # pipeline rank: which stage (stages, with virtual stages) the rank runs


@dataclass(frozen=True)
class ParallelDims:
    """Validated parallel degrees and what follows from them."""

    data_parallel: int = 1
    ring_size: int = 1
    ulysses_size: int = 1
    tensor_size: int = 1
    pipeline_size: int = 1  # last: positional (dp, ring, ulysses, tensor) construction stays valid

    def __post_init__(self) -> None:
        for name in ("data_parallel", "ring_size", "ulysses_size", "tensor_size", "pipeline_size"):
            degree = getattr(self, name)
            if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {degree!r}")

    @classmethod
    def of(cls, parallel: _ParallelFields) -> ParallelDims:
        """The shape of a spec's `parallel` section."""
        tensor = getattr(parallel, "tensor_size", 1)
        pipeline = getattr(parallel, "pipeline_size", 1)
        return cls(
            parallel.data_parallel, parallel.ring_size, parallel.ulysses_size, tensor, pipeline
        )

    @property
    def seq_group_size(self) -> int:
        """Ranks the sequence is split over: ulysses_size x ring_size."""
        return self.ulysses_size * self.ring_size

    @property
    def replica_size(self) -> int:
        """Ranks of one data-parallel replica: the sequence group times the tensor group."""
        return self.seq_group_size * self.tensor_size

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage: every data-parallel replica of it."""
        return self.data_parallel * self.replica_size

    @property
    def world_size(self) -> int:
        return self.pipeline_size * self.stage_size

    @property
    def placement_units(self) -> int:
        """Placement bundles the job reserves: one per tensor group (one per rank without TP)."""
        return self.world_size // self.tensor_size

    def placement_bundle(self, *, gpu: bool, cpus_per_worker: float) -> dict[str, float]:
        """The resources of one placement bundle: a tensor group's ranks, on one node."""
        rank = rank_bundle(gpu=gpu, cpus_per_worker=cpus_per_worker)
        return {kind: amount * self.tensor_size for kind, amount in rank.items()}

    def describe(self) -> str:
        """The shape in words, for messages."""
        dp, ulysses, ring = self.data_parallel, self.ulysses_size, self.ring_size
        words = f"data_parallel {dp} x ulysses_size {ulysses} x ring_size {ring}"
        if self.pipeline_size > 1:
            words = f"pipeline_size {self.pipeline_size} x " + words
        return words + (f" x tensor_size {self.tensor_size}" if self.tensor_size > 1 else "")

    def seq_divisor(self, layout: str) -> int:
        """The global sequence length must be a multiple of this for `layout`."""
        chunks = chunks_per_rank(layout)
        return self.ring_size * math.lcm(chunks, self.ulysses_size * self.tensor_size)

    def coordinates(self, rank: int) -> RankCoordinates:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        t = self.tensor_size
        return RankCoordinates(
            dp_index=(rank % self.stage_size) // self.replica_size,
            ring_rank=(rank // (self.ulysses_size * t)) % self.ring_size,
            ulysses_rank=(rank // t) % self.ulysses_size,
            tp_rank=rank % t,
            pp_rank=rank // self.stage_size,
        )

    def order_ranks(self, locations: Sequence[WorkerLocation]) -> list[RankAssignment]:
        # each (pipeline rank, replica) is one contiguous block of ranks, placed as a replica is
        assignments = order_ranks(
            locations, self.replica_size, self.pipeline_size * self.data_parallel, self.tensor_size
        )
        return [replace(a, ring=self.ring_index(a.rank)) for a in assignments]

    def ring_index(self, rank: int) -> int:
        """Which ring `rank` belongs to, numbered as `rings` lists them: (pp_rank, dp_index,
        ulysses_rank, tp_rank) in row-major order. Equal to the data-parallel replica when
        U = T = P = 1."""
        at = self.coordinates(rank)
        replica = at.pp_rank * self.data_parallel + at.dp_index
        return (replica * self.ulysses_size + at.ulysses_rank) * self.tensor_size + at.tp_rank

    def rings(self, assignments: Sequence[RankAssignment]) -> list[list[RankAssignment]]:
        """Each ring's ranks in ring order (ring_rank 0, 1, ...): the ranks sharing pp_rank,
        dp_index, ulysses_rank and tp_rank. Rings are listed by (pp_rank, dp_index, ulysses_rank,
        tp_rank)."""
        if len(assignments) != self.world_size:
            raise ValueError(f"expected {self.world_size} assignments, got {len(assignments)}")
        rings: dict[tuple[int, int, int, int], list[RankAssignment]] = {}
        for assignment in sorted(assignments, key=lambda a: a.rank):
            at = self.coordinates(assignment.rank)
            key = (at.pp_rank, at.dp_index, at.ulysses_rank, at.tp_rank)
            rings.setdefault(key, []).append(assignment)
        return list(rings.values())

    def ring_crossings(self, assignments: Sequence[RankAssignment]) -> list[int]:
        """Per ring (as `rings` lists them): how many of its hops (cyclic, ring_rank r -> r+1)
        join ranks on different nodes. A ring of one rank has none; a ring of two counts both of
        its hops (r 0 -> 1 and 1 -> 0), as a longer ring counts its closing hop."""
        return [
            sum(ring[i].node_id != ring[(i + 1) % len(ring)].node_id for i in range(len(ring)))
            for ring in self.rings(assignments)
        ]

    def node_crossings(self, assignments: Sequence[RankAssignment]) -> int:
        """Ring hops that cross a node boundary, over all rings."""
        return sum(self.ring_crossings(assignments))

    def nodes_per_ring(self, assignments: Sequence[RankAssignment]) -> list[int]:
        """Per ring (as `rings` lists them): how many nodes it spans."""
        return [len({a.node_id for a in ring}) for ring in self.rings(assignments)]


def stage_layers(
    n_layers: int, stages: int, split: Sequence[int] | str | None = None
) -> list[range]:
    """The layer indices of each pipeline stage, in order: `split` (layers per stage) or an even
    split. The spec's rules (`workers.config.rules.pipeline_problem`) refuse what fails here;
    `auto` is the control plane's to resolve (`service.planner.resolve_pipeline_split`)."""
    if isinstance(split, str):
        raise ValueError(
            f"parallel.pipeline_split {split!r} is resolved by the control plane at submission "
            "(`ringtrain plan SPEC` shows the split it chooses): give the list of layers per stage"
        )
    sizes = list(split) if split is not None else [n_layers // stages] * stages
    if len(sizes) != stages or sum(sizes) != n_layers or min(sizes) < 1:
        raise ValueError(f"cannot split {n_layers} layers into {stages} stages as {sizes}")
    starts = [sum(sizes[:i]) for i in range(stages)]
    return [range(a, a + n) for a, n in zip(starts, sizes, strict=True)]


def stage_rank(stage: int, pipeline_size: int) -> int:
    """The pipeline rank that runs `stage` (loop order: stage s on rank s mod P, so interleaved
    schedules give each rank stages r, r + P, ...)."""
    return stage % pipeline_size


def chunks_per_rank(layout: str) -> int:
    """How many equal chunks of the global sequence one ring rank holds under `layout`: zigzag pairs
    an early chunk with a late one, the others hold one (`workers.attention.layouts`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return 2 if layout == "zigzag" else 1


# --- accelerator and bundles ------------------------------------------------------------------


# What ring attention holds beyond its saved tensors is its ring buffers: in the forward, the K/V in
# hand and the K/V in flight; in the backward, those plus dK/dV travelling and arriving (four times
# a rank's K/V). Run over this many K/V-head chunks, one chunk's full ring after another, they
# shrink to a chunk's; the bytes sent are the same, in more, smaller messages. Heads are
# independent, so the result is the same to the bit.
MAX_RING_HEAD_CHUNKS = 4


def ring_head_chunks(kv_heads: int, ring_size: int) -> int:
    """K/V-head chunks ring attention's forward and backward run in (`workers.attention.ring`, and
    the planner's ring buffers): the most up to MAX_RING_HEAD_CHUNKS that divide the K/V heads; 1 on
    a ring of one (nothing travels)."""
    if ring_size == 1 or kv_heads < 1:
        return 1
    top = min(kv_heads, MAX_RING_HEAD_CHUNKS)
    return max(c for c in range(1, top + 1) if kv_heads % c == 0)


def resolve_accelerator(requested: str, node_gpus: Iterable[float]) -> Accelerator:
    """What a job asking for `requested` runs on, given each alive node's total GPUs."""
    if requested == "gpu":
        return "gpu"
    if requested == "cpu":
        return "cpu"
    if requested != "auto":
        raise ValueError(f"accelerator must be 'auto', 'cpu' or 'gpu', got {requested!r}")
    return "gpu" if any(gpus > 0 for gpus in node_gpus) else "cpu"


def rank_bundle(*, gpu: bool, cpus_per_worker: float) -> dict[str, float]:
    """The resources one rank reserves."""
    bundle = {"CPU": float(cpus_per_worker)}
    if gpu:
        bundle["GPU"] = 1.0
    return bundle


def _units(amount: float) -> int:
    return round(amount / RESOURCE_UNIT)


def bundles_per_node(bundle: Mapping[str, float], node_resources: Mapping[str, float]) -> int:
    """How many `bundle`s fit in `node_resources` (a node's total or free resources)."""
    counts = [
        max(0, _units(node_resources.get(kind, 0.0))) // _units(amount)
        for kind, amount in bundle.items()
        if _units(amount) > 0
    ]
    if not counts:
        raise ValueError(f"a bundle must ask for some resource, got {dict(bundle)}")
    return min(counts)


def choose_strategy(
    world_size: int,
    bundle: Mapping[str, float],
    nodes_total: Sequence[Mapping[str, float]],
) -> str:
    """STRICT_PACK when the whole group fits one node's total resources, else PACK."""
    if any(bundles_per_node(bundle, node) >= world_size for node in nodes_total):
        return STRICT_PACK
    return PACK


# --- rank order ------------------------------------------------------------------------------


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
    replica: int  # data-parallel replica (dp_index) the rank belongs to
    group_rank: int  # position inside its replica (rank - replica x replica_size)
    local_rank: int  # index among this job's actors on the same node (GPU id order)
    local_world_size: int
    visible_devices: tuple[str, ...]  # sorted union of the node's GPU ids (empty on CPU)
    device: str  # "cuda:<k>" or "cpu"
    ring: int = (
        0  # the ring it belongs to (`ParallelDims.ring_index`; set by ParallelDims.order_ranks)
    )


def _gpu_key(gpu_id: str) -> tuple[int, int | str]:
    return (0, int(gpu_id)) if str(gpu_id).isdigit() else (1, str(gpu_id))


def _first_gpu(location: WorkerLocation) -> tuple[int, int | str]:
    """Sort key of an actor inside its node: its lowest GPU id (CPU actors last)."""
    return min((_gpu_key(g) for g in location.gpu_ids), default=(2, 0))


def _fill_groups(
    node_order: list[str],
    remaining: dict[str, list[tuple[int, ...]]],
    units_per_replica: int,
    data_parallel: int,
) -> list[list[tuple[str, list[tuple[int, ...]]]]]:
    """Each replica as (node, units) segments, on as few nodes as possible (best fit). A unit is
    one tensor group's actors (one actor without tensor parallelism)."""
    groups: list[list[tuple[str, list[tuple[int, ...]]]]] = []
    for _ in range(data_parallel):
        need, segments = units_per_replica, []
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
            taken = remaining[pick][:need]
            remaining[pick] = remaining[pick][need:]
            segments.append((pick, taken))
            need -= len(taken)
        groups.append(segments)
    return groups


def order_ranks(
    locations: Sequence[WorkerLocation],
    replica_size: int,
    data_parallel: int = 1,
    tensor_size: int = 1,
) -> list[RankAssignment]:
    """Assign ranks to actors (index = bundle/actor order). Returns assignments indexed by rank.

    Ray does not keep one node's bundles contiguous, so ranks are assigned from where the actors
    landed: actors grouped by node (nodes in order of first appearance), GPU id ascending inside a
    node; each replica (rank = replica x replica_size + group_rank) is filled with as few nodes
    as possible (whole nodes first, then the node whose remaining actors fit the gap exactly, else
    the smallest node that covers it), and its node segments are contiguous (how often its rings
    then cross nodes: `ParallelDims.ring_crossings`). On each node the visible devices are the
    sorted union of that node's GPU ids of this job and an actor's device is the index of its GPU
    in that list (the usual local-rank convention, so NCCL sees its peers).

    `replica_size` is the ranks of one replica (ring x Ulysses x tensor). With `tensor_size` T >
    1 actors are handed out in whole tensor groups (T neighbours in GPU order on one node); a node
    holding a number of this job's actors that is not a multiple of T raises `TensorGroupSplit`.
    """
    world = replica_size * data_parallel
    if len(locations) != world:
        raise ValueError(
            f"expected {world} actors (replica {replica_size} x data_parallel "
            f"{data_parallel}), got {len(locations)}"
        )
    nodes: dict[str, list[int]] = {}
    for i, loc in enumerate(locations):
        nodes.setdefault(loc.node_id, []).append(i)
    for idxs in nodes.values():
        idxs.sort(key=lambda i: (_first_gpu(locations[i]), i))
    node_order = list(nodes)
    if replica_size % tensor_size:
        raise ValueError(f"a replica of {replica_size} ranks holds no whole tensor groups")
    for n, idxs in nodes.items():
        if len(idxs) % tensor_size:
            raise TensorGroupSplit(
                f"node {n} holds {len(idxs)} of this job's ranks, not a multiple of "
                f"parallel.tensor_size ({tensor_size}): "
                "a tensor-parallel group must sit on one node"
            )
    remaining = {
        n: [tuple(idxs[k : k + tensor_size]) for k in range(0, len(idxs), tensor_size)]
        for n, idxs in nodes.items()
    }
    unit_groups = _fill_groups(node_order, remaining, replica_size // tensor_size, data_parallel)
    groups = [
        [(n, [i for unit in units for i in unit]) for n, units in segments]
        for segments in unit_groups
    ]

    # Keep a node shared by consecutive groups adjacent in global rank order: its segment goes last
    # in the earlier group and first in the later one (a replica that is one ring is a cycle:
    # segment order does not change its crossings).
    for d, segments in enumerate(groups):
        prev_nodes = {n for n, _ in groups[d - 1]} if d else set()
        next_nodes = {n for n, _ in groups[d + 1]} if d + 1 < len(groups) else set()
        segments.sort(key=lambda s: 0 if s[0] in prev_nodes else 2 if s[0] in next_nodes else 1)

    # Per-node local ranks and visible devices (GPU order, independent of rank order).
    local: dict[int, tuple[int, int]] = {}
    visible: dict[str, tuple[str, ...]] = {}
    for n, idxs in nodes.items():
        for k, i in enumerate(idxs):
            local[i] = (k, len(idxs))
        visible[n] = tuple(sorted({g for i in idxs for g in locations[i].gpu_ids}, key=_gpu_key))

    out: list[RankAssignment] = []
    for replica, segments in enumerate(groups):
        group_rank = 0
        for n, idxs in segments:
            for i in idxs:
                loc = locations[i]
                device = f"cuda:{visible[n].index(loc.gpu_ids[0])}" if loc.gpu_ids else "cpu"
                out.append(
                    RankAssignment(
                        rank=replica * replica_size + group_rank,
                        actor_index=i,
                        node_id=n,
                        node_ip=loc.node_ip,
                        replica=replica,
                        group_rank=group_rank,
                        local_rank=local[i][0],
                        local_world_size=local[i][1],
                        visible_devices=visible[n],
                        device=device,
                    )
                )
                group_rank += 1
    return out
