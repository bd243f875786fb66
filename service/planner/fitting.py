"""Fit: the smallest sequence group and the cheapest memory knobs whose estimate fits a budget
(`ringtrain plan --fit`, and `ring_size: auto` at submission)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.launcher import ClusterInfo
from service.planner.memory import memory_estimate
from service.planner.preview import node_resources
from workers.config import (
    KNOB_CANDIDATES,
    MAX_WORLD,
    JobSpec,
    MemoryKnobs,
    tensor_heads_problem,
    ulysses_heads_problem,
)
from workers.parallel_dims import ParallelDims, bundles_per_node, rank_bundle, resolve_accelerator

GIB = 2**30

MAX_ALTERNATIVES = 24  # the response lists at most this many candidates tried


@dataclass
class Fit:
    """What `fit` chose (fits) or why nothing fits: the best candidate and its shortfall."""

    fits: bool
    memory_per_rank_bytes: int
    accelerator: str
    ring_size: int = 0
    ulysses_size: int = 1
    tensor_size: int = 1
    knobs: MemoryKnobs | None = None
    spec: JobSpec | None = None  # the spec it would run (fits), or the best candidate
    memory: dict[str, Any] = field(default_factory=dict)
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    shortfall_bytes: int = 0
    message: str = ""


def device_memory(spec: JobSpec, cluster: ClusterInfo) -> tuple[int | None, str]:
    """The memory one rank may use on this cluster's devices, and where it came from (or why not).

    GPU jobs: the smallest GPU's memory (`NodeInfo.gpu_memory_bytes`); CPU jobs: a bundle's share of
    its node's memory (node memory / node CPUs x cpus_per_worker), the smallest over the nodes."""
    nodes = [n for n in cluster.nodes if n.alive]
    acc = resolve_accelerator(spec.resources.accelerator, [n.gpus_total for n in nodes])
    if acc == "gpu":
        known = [n.gpu_memory_bytes for n in nodes if n.gpus_total > 0 and n.gpu_memory_bytes > 0]
        if not known:
            return None, "the cluster does not report its GPUs' memory"
        return int(min(known)), "the smallest GPU's memory"
    cpw = spec.resources.cpus_per_worker
    shares = [
        n.memory_bytes / n.cpus_total * cpw for n in nodes if n.memory_bytes > 0 and n.cpus_total
    ]
    if not shares:
        return None, "the cluster does not report its nodes' memory"
    return int(min(shares)), f"a bundle's share of node memory ({cpw:g} CPU per rank)"


def _shape_problem(spec: JobSpec, ring: int, ulysses: int, tensor: int = 1) -> str | None:
    """Why this ring x Ulysses x tensor cannot run the spec's lengths and heads (its own rules)."""
    dims = ParallelDims(ring_size=ring, ulysses_size=ulysses, tensor_size=tensor)
    need = dims.seq_divisor(spec.parallel.layout)
    lengths = [spec.data.seq_len, *(spec.eval.context_lengths or [])]
    lengths += [s.seq_len for s in getattr(spec.data, "curriculum", [])]
    if any(length % need for length in lengths):
        return f"seq_len not divisible by {need}"
    if spec.model.shape_known and (
        tensor_heads_problem(spec.model, tensor)
        or ulysses_heads_problem(spec.model, ulysses, tensor)
    ):
        return "heads"
    return None


def _shapes(spec: JobSpec, group: int, gpus_per_node: int) -> list[tuple[int, int]]:
    """(ring, ulysses) for a sequence group of `group` ranks, most Ulysses first: on GPU nodes the
    largest Ulysses group inside a node that the heads allow, then smaller; elsewhere the spec's."""
    u_spec = spec.parallel.ulysses_size
    if gpus_per_node < 1:
        return [(group // u_spec, u_spec)] if group % u_spec == 0 else []
    us = [u for u in range(min(group, gpus_per_node), 0, -1) if group % u == 0]
    return [(group // u, u) for u in us]


def _tensor_sizes(spec: JobSpec, ranks_per_node: int) -> list[int]:
    """Tensor sizes to try, in order: the spec's, then (when it is 1) each larger power of two a
    node holds and the model splits into. A larger T divides the state and the activations per
    rank but adds collectives to every block, so it comes after every sequence group at the
    spec's T (which splits only the activations)."""
    own = spec.parallel.tensor_size
    if own > 1 or not spec.model.shape_known:
        return [own]
    sizes, t = [own], 2
    while t <= ranks_per_node:
        if tensor_heads_problem(spec.model, t) is None:
            sizes.append(t)
        t *= 2
    return sizes


def _with(
    spec: JobSpec, ring: int, ulysses: int, knobs: MemoryKnobs, tensor: int | None = None
) -> JobSpec:
    shape = {"ring_size": ring, "ulysses_size": ulysses}
    if tensor is not None:
        shape["tensor_size"] = tensor
    parallel = spec.parallel.model_copy(update=shape)
    train = spec.train.model_copy(update=knobs.fields())
    return spec.model_copy(update={"parallel": parallel, "train": train})


def fit(spec: JobSpec, cluster: ClusterInfo, memory_per_rank_bytes: int | None = None) -> Fit:
    """The spec it would run: the smallest sequence group (ring x Ulysses; pipeline_size and
    data_parallel as given; world = P x dp x group x tensor within the cluster's devices) and, at
    it, the cheapest knobs whose estimate fits the budget (default: `device_memory`); when nothing
    fits at the spec's tensor_size of 1, larger tensor sizes inside a node (`_tensor_sizes`).
    ValueError when no budget is given and none is known."""
    if memory_per_rank_bytes is None:
        memory_per_rank_bytes, why = device_memory(spec, cluster)
        if memory_per_rank_bytes is None:
            raise ValueError(why)
    budget = memory_per_rank_bytes
    nodes = [n for n in cluster.nodes if n.alive]
    acc = resolve_accelerator(spec.resources.accelerator, [n.gpus_total for n in nodes])
    bundle = rank_bundle(gpu=acc == "gpu", cpus_per_worker=spec.resources.cpus_per_worker)
    per_node_counts = [bundles_per_node(bundle, node_resources(n, free=False)) for n in nodes]
    devices = sum(per_node_counts)
    dp = spec.parallel.data_parallel
    # every pipeline rank holds its own sequence group: the world is P x dp x group x tensor
    pp = spec.parallel.pipeline_size
    per_node = max((int(n.gpus_total) for n in nodes), default=0) if acc == "gpu" else 0
    knob_sets = [k for k in KNOB_CANDIDATES if k.problem(cuda=acc == "gpu") is None]
    out = Fit(fits=False, memory_per_rank_bytes=budget, accelerator=acc)
    best: tuple[int, JobSpec, MemoryKnobs, dict[str, Any]] | None = None

    def row(candidate: JobSpec, knobs: MemoryKnobs, total: int) -> dict[str, Any]:
        p = candidate.parallel
        return {
            "ring_size": p.ring_size,
            "ulysses_size": p.ulysses_size,
            "tensor_size": p.tensor_size,
            "knobs": knobs.name,
            "total_bytes": total,
            "fits": total <= budget,
        }

    tensors = _tensor_sizes(spec, max(per_node_counts, default=0))
    for tensor in tensors:
        # a node holds whole tensor groups only
        room = sum(c // tensor for c in per_node_counts) * tensor if nodes else MAX_WORLD
        max_group = min(room, MAX_WORLD) // (pp * dp * tensor)
        for group in range(1, max_group + 1):
            for ring, ulysses in _shapes(spec, group, per_node // tensor if per_node else 0):
                if _shape_problem(spec, ring, ulysses, tensor):
                    continue
                # the leanest knobs first: when even they exceed, no cheaper set fits this shape
                lean = _with(spec, ring, ulysses, knob_sets[-1], tensor)
                lean_est = memory_estimate(lean, acc)
                lean_total = int(lean_est["total_bytes"])
                if best is None or lean_total < best[0]:
                    best = (lean_total, lean, knob_sets[-1], lean_est)
                if lean_total > budget:
                    if len(out.alternatives) < MAX_ALTERNATIVES:
                        out.alternatives.append(row(lean, knob_sets[-1], lean_total))
                    continue
                for knobs in knob_sets:
                    candidate = _with(spec, ring, ulysses, knobs, tensor)
                    est = memory_estimate(candidate, acc)
                    total = int(est["total_bytes"])
                    out.alternatives.append(row(candidate, knobs, total))
                    if total <= budget:
                        out.alternatives = out.alternatives[-MAX_ALTERNATIVES:]
                        out.fits, out.spec, out.knobs, out.memory = True, candidate, knobs, est
                        out.ring_size, out.ulysses_size = ring, ulysses
                        out.tensor_size = tensor
                        tp = f" x tensor_size {tensor}" if tensor > 1 else ""
                        out.message = (
                            f"ring_size {ring} x ulysses_size {ulysses}{tp} with "
                            f"{knobs.name}: {total / GIB:.2f} of {budget / GIB:.2f} GiB per rank"
                        )
                        return out
    # Beyond the cluster (the spec's tensor_size): the smallest larger sequence group whose leanest
    # estimate fits, only to say how many devices would do. Every size is tried, not only
    # doublings: a length of 3 x 2^k runs on a group of 6, and a cluster of 12 devices is not a
    # power of two (an estimate takes microseconds).
    tensor = tensors[0]
    held = sum(c // tensor for c in per_node_counts) * tensor  # whole tensor groups only
    first = min(held, MAX_WORLD) // (pp * dp * tensor) + 1
    for group in range(first, MAX_WORLD // (pp * dp * tensor) + 1) if nodes else ():
        for ring, ulysses in _shapes(spec, group, per_node // tensor if per_node else 0):
            if _shape_problem(spec, ring, ulysses, tensor):
                continue
            lean = _with(spec, ring, ulysses, knob_sets[-1], tensor)
            total = int(memory_estimate(lean, acc)["total_bytes"])
            if total <= budget:
                return _short(
                    out,
                    best,
                    budget,
                    group * pp * dp * tensor,
                    devices,
                    row(lean, knob_sets[-1], total),
                )
    return _short(out, best, budget, None, devices, None)


def _short(
    out: Fit,
    best: tuple[int, JobSpec, MemoryKnobs, dict[str, Any]] | None,
    budget: int,
    world_needed: int | None,
    devices: int,
    would_fit: dict[str, Any] | None,
) -> Fit:
    """Nothing fits within the cluster: the best candidate, by how much it exceeds, what would
    do."""
    if best is None:
        out.message = (
            "no ring x Ulysses shape divides the spec's sequence lengths within the cluster"
        )
        return out
    total, candidate, knobs, est = best
    out.spec, out.knobs, out.memory = candidate, knobs, est
    out.ring_size, out.ulysses_size = candidate.parallel.ring_size, candidate.parallel.ulysses_size
    out.tensor_size = candidate.parallel.tensor_size
    out.shortfall_bytes = total - budget
    needed = f"a budget of at least {total / GIB:.2f} GiB per rank"
    if would_fit is not None and world_needed is not None:
        tp = would_fit["tensor_size"]
        needed += (
            f", or {world_needed} devices (ring_size {would_fit['ring_size']} x ulysses_size "
            f"{would_fit['ulysses_size']}" + (f" x tensor_size {tp}" if tp > 1 else "") + " with "
            f"{would_fit['knobs']}; the cluster has {devices})"
        )
    tp_best = f" x tensor_size {out.tensor_size}" if out.tensor_size > 1 else ""
    out.message = (
        f"nothing fits {budget / GIB:.2f} GiB per rank within the cluster's {devices} devices: the "
        f"best candidate (ring_size {out.ring_size} x ulysses_size {out.ulysses_size}{tp_best} "
        f"with {knobs.name}) needs {total / GIB:.2f} GiB, {out.shortfall_bytes} bytes "
        f"({out.shortfall_bytes / GIB:.2f} GiB) over; it would need {needed}"
    )
    return out
