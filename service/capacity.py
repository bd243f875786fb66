"""What the cluster *can* hold, not only what is up now: worker groups the autoscaler may grow, and
the accelerator.

Why: a KubeRay GPU group scaled to zero shows no GPU to Ray, so a planner that reads only live nodes
refuses every GPU job and no placement group ever asks the autoscaler for a node. The control plane
therefore counts each worker group's `maxReplicas` × per-pod resources
(`RINGTRAIN_AUTOSCALER_NODES`, one `NodeShape` per group; see `service.admission.with_autoscaler`)
as capacity, and resolves `accelerator: auto` once, against that capacity, at submission: the spec
stored with the job says `gpu` or `cpu`, so a resubmitted driver (a lost driver, a replaced head)
never re-decides it on whatever nodes happen to be up.

`shapes_from_raycluster` reads those shapes off a RayCluster object, so the setting can be checked
against (or derived from) the manifest that defines the groups.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from service.admission import NodeShape
from service.launcher import ClusterInfo
from service.planner import Fit, fit
from workers.config import JobSpec
from workers.parallel_dims import resolve_accelerator


def with_accelerator_resolved(spec: JobSpec, cluster: ClusterInfo) -> JobSpec:
    """The spec with `auto` replaced by what it means on this cluster (`resolve_accelerator`'s rule,
    over the alive nodes counted with those the autoscaler may add); a spec naming `gpu` or `cpu` is
    returned as is."""
    node_gpus = [n.gpus_total for n in cluster.nodes if n.alive]
    accelerator = resolve_accelerator(spec.resources.accelerator, node_gpus)
    if accelerator == spec.resources.accelerator:
        return spec
    resources = spec.resources.model_copy(update={"accelerator": accelerator})
    return spec.model_copy(update={"resources": resources})


def growth_limit(shapes: Sequence[NodeShape]) -> str:
    """The autoscaler's bound in words, for a 422 that says which limit the job is over."""
    parts = []
    for s in shapes:
        name = f"worker group {s.group!r}" if s.group else "a worker group"
        unit = f"{s.cpus:g} CPU" + (f" + {s.gpus:g} GPU" if s.gpus else "")
        total = f"{s.max_nodes * s.gpus:g} GPUs" if s.gpus else f"{s.max_nodes * s.cpus:g} CPUs"
        parts.append(f"{name}: maxReplicas {s.max_nodes} x ({unit}) = {total}")
    return "; ".join(parts)


_QUANTITY = re.compile(r"^([0-9.]+)(m?)$")


def _cpus(value: Any) -> float:
    """A Kubernetes CPU quantity ("32", "500m", 4) in CPUs."""
    m = _QUANTITY.match(str(value).strip())
    if not m:
        raise ValueError(f"not a CPU quantity: {value!r}")
    return float(m.group(1)) / (1000 if m.group(2) else 1)


def _group_resources(group: Mapping[str, Any]) -> tuple[float, float]:
    """CPUs and GPUs one pod of the group gives Ray: `rayStartParams` win, else the container's
    limits (as KubeRay derives them)."""
    params = group.get("rayStartParams") or {}
    limits = (
        (group["template"]["spec"]["containers"][0].get("resources") or {}).get("limits")
    ) or {}
    cpus = _cpus(params["num-cpus"]) if "num-cpus" in params else _cpus(limits.get("cpu", 0))
    gpus = (
        float(params["num-gpus"])
        if "num-gpus" in params
        else float(limits.get("nvidia.com/gpu", 0))
    )
    return cpus, gpus


def shapes_from_raycluster(rc: Mapping[str, Any]) -> list[NodeShape]:
    """One shape per worker group that can hold ranks (a group that advertises no CPU, such as the
    drivers' group, holds none)."""
    out = []
    for g in rc["spec"].get("workerGroupSpecs", []):
        cpus, gpus = _group_resources(g)
        if cpus <= 0:
            continue
        out.append(
            NodeShape(
                group=g["groupName"], cpus=cpus, gpus=gpus, max_nodes=int(g.get("maxReplicas", 0))
            )
        )
    return out


class FitError(ValueError):
    """`fit` found nothing (`result` says by how much) or had no budget (`result` None)."""

    def __init__(self, message: str, result: Fit | None = None) -> None:
        super().__init__(message)
        self.result = result


def fit_spec(
    spec: JobSpec, cluster: ClusterInfo, memory_per_rank_bytes: int | None = None
) -> tuple[JobSpec, Fit]:
    """The spec `fit` would run (ring x Ulysses and knobs chosen), for `plan --fit` and for
    `parallel.ring_size: auto` at submission, where the result is stored with the job: a
    resubmitted driver never re-decides it. Budget: given, else the devices' memory."""
    try:
        result = fit(spec, cluster, memory_per_rank_bytes)
    except ValueError as e:
        raise FitError(str(e)) from e
    if not result.fits or result.spec is None:
        raise FitError(result.message, result)
    return result.spec, result
