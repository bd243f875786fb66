"""The autoscaler's capacity read off a RayCluster manifest (`service.capacity.shapes_from_raycluster`), in the fast
tier: the deploy tier checks it against the rendered overlays, this checks each rule on a hand-written cluster."""

from __future__ import annotations

from typing import Any

import pytest

from service.admission import NodeShape
from service.capacity import shapes_from_raycluster


def _group(
    name: str,
    *,
    params: dict[str, str] | None = None,
    limits: dict[str, Any] | None = None,
    min_replicas: int = 0,
    max_replicas: int | None = None,
) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "ray-worker", "image": "ringtrain:dev"}
    if limits is not None:
        container["resources"] = {"limits": limits}
    group: dict[str, Any] = {
        "groupName": name,
        "minReplicas": min_replicas,
        "rayStartParams": params or {},
        "template": {"spec": {"containers": [container]}},
    }
    if max_replicas is not None:
        group["maxReplicas"] = max_replicas
    return group


def _cluster(*groups: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "RayCluster", "spec": {"workerGroupSpecs": list(groups)}}


def test_each_group_counts_its_max_replicas_and_its_pods_resources() -> None:
    """Limits in Kubernetes units ("1500m" is 1.5 CPUs); rayStartParams win over the limits, as KubeRay does;
    the pool is maxReplicas (not minReplicas: a GPU group scales from zero)."""
    rc = _cluster(
        _group("cpu", limits={"cpu": "1500m", "memory": "4Gi"}, min_replicas=1, max_replicas=4),
        _group(
            "gpu",
            params={"num-cpus": "16", "num-gpus": "4"},
            limits={"cpu": "32", "nvidia.com/gpu": 8},
            max_replicas=2,
        ),
    )
    assert shapes_from_raycluster(rc) == [
        NodeShape(group="cpu", cpus=1.5, gpus=0.0, max_nodes=4),
        NodeShape(group="gpu", cpus=16.0, gpus=4.0, max_nodes=2),
    ]


def test_a_group_that_advertises_no_cpu_holds_no_ranks() -> None:
    """The drivers' group (num-cpus 0: only the custom driver resource) is no capacity for ranks."""
    rc = _cluster(
        _group("drivers", params={"num-cpus": "0"}, limits={"cpu": "2"}, max_replicas=3),
        _group("gpu", limits={"cpu": 8, "nvidia.com/gpu": "1"}, max_replicas=1),
    )
    assert shapes_from_raycluster(rc) == [NodeShape(group="gpu", cpus=8.0, gpus=1.0, max_nodes=1)]


def test_a_cpu_quantity_that_is_not_one_is_refused() -> None:
    with pytest.raises(ValueError, match="not a CPU quantity"):
        shapes_from_raycluster(_cluster(_group("odd", limits={"cpu": "2Gi"}, max_replicas=1)))
