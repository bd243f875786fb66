"""The NetworkPolicies, offline: every overlay renders them, they validate (kubernetes-validate --strict), and a
small evaluator of NetworkPolicy ingress semantics (pod and namespace selectors, matchExpressions, port ranges,
"no policy selects the pod = open") answers who reaches what among the rendered pods: only the control plane reaches
the Ray head's Jobs API, only the Ray head (where drivers run) and labelled client namespaces reach the control
plane, Ray pods reach each other on every port. Ray pods carry the labels KubeRay adds to them
(ray.io/cluster, ray.io/node-type), on top of their templates' own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import kubernetes_validate
import pytest

from tests.deploy.test_deploy import K8S_VERSION, OVERLAY_IDS, OVERLAYS, rendered
from tests.support import deploy_helpers as dh

NS = "ringtrain"


@dataclass(frozen=True)
class Pod:
    name: str
    labels: dict[str, str]
    namespace: str = NS
    ns_labels: dict[str, str] = field(default_factory=dict)


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A LabelSelector: every matchLabels pair and every matchExpression holds ({} selects everything)."""
    selector = selector or {}
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def port_matches(ports: list[dict[str, Any]] | None, port: int) -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != "TCP":
            continue
        lo = p.get("port")
        if lo is None:
            return True
        assert isinstance(lo, int), f"named ports are not evaluated here: {p}"
        if lo <= port <= p.get("endPort", lo):
            return True
    return False


def peer_matches(peers: list[dict[str, Any]] | None, src: Pod, policy_ns: str) -> bool:
    if peers is None:
        return True
    for peer in peers:
        if "ipBlock" in peer:
            continue
        pod_sel, ns_sel = peer.get("podSelector"), peer.get("namespaceSelector")
        ns_ok = selects(ns_sel, src.ns_labels) if ns_sel is not None else src.namespace == policy_ns
        pod_ok = selects(pod_sel, src.labels) if pod_sel is not None else True
        if ns_ok and pod_ok:
            return True
    return False


def allowed(policies: list[dict[str, Any]], src: Pod, dst: Pod, port: int) -> bool:
    """Whether a TCP connection from src to dst:port is admitted by the ingress policies."""
    chosen = [
        p
        for p in policies
        if p["metadata"].get("namespace", NS) == dst.namespace
        and selects(p["spec"]["podSelector"], dst.labels)
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not chosen:
        return True
    return any(
        peer_matches(rule.get("from"), src, p["metadata"].get("namespace", NS))
        and port_matches(rule.get("ports"), port)
        for p in chosen
        for rule in p["spec"].get("ingress", [])
    )


def cluster(objs: tuple[dict[str, Any], ...]) -> tuple[Pod, list[Pod], Pod]:
    """(control plane, Ray workers by group, Ray head) as pods, with KubeRay's labels on the Ray ones."""
    cp = next(
        p
        for o in objs
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "ringtrain-api"
        for p in dh.pod_templates(o)
    )
    rc = next(o for o in objs if o["kind"] == "RayCluster")
    ray = [
        Pod(
            r.owner,
            {**r.labels, "ray.io/cluster": rc["metadata"]["name"], "ray.io/node-type": r.role},
        )
        for r in dh.pod_templates(rc)
    ]
    head = next(p for p in ray if p.labels["ray.io/node-type"] == "head")
    return Pod(cp.owner, cp.labels), [p for p in ray if p is not head], head


STRANGER = Pod("another pod in the namespace", {"app": "something-else"})
DATABASE = Pod(
    "dev PostgreSQL",
    {"app.kubernetes.io/name": "ringtrain-postgres", "app.kubernetes.io/component": "database"},
)
ELSEWHERE = Pod(
    "a pod in another namespace", {"app.kubernetes.io/component": "control-plane"}, "team-b"
)
INGRESS = Pod(
    "ingress controller",
    {"app": "ingress-nginx"},
    "ingress-nginx",
    {"ringtrain.io/api-clients": "true"},
)
PROMETHEUS = Pod(
    "prometheus", {"app": "prometheus"}, "monitoring", {"ringtrain.io/metrics-scrapers": "true"}
)


def policies(overlay: str) -> tuple[tuple[dict[str, Any], ...], list[dict[str, Any]]]:
    objs = rendered(overlay)
    return objs, [o for o in objs if o["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_policies_render_and_validate_strict(overlay: str) -> None:
    _, pols = policies(overlay)
    assert {
        p["metadata"]["name"] for p in pols
    } >= {  # an overlay may add its own (the gpu overlay's Redis)
        "ringtrain-ray-head",
        "ringtrain-ray-workers",
        "ringtrain-control-plane",
    }
    for p in pols:
        assert p["metadata"]["namespace"] == NS
        kubernetes_validate.validate(p, K8S_VERSION, strict=True)
    typo = {**pols[0], "spec": {**pols[0]["spec"], "ingres": []}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_ports_are_the_ones_the_manifests_use(overlay: str) -> None:
    objs, pols = policies(overlay)
    cm = next(
        o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "ringtrain-config"
    )["data"]
    jobs_api = urlparse(cm["RINGTRAIN_RAY_ADDRESS"]).port
    api_port = int(cm["RINGTRAIN_PORT"])
    rc = next(o for o in objs if o["kind"] == "RayCluster")
    head_ports = {
        p["name"]: p["containerPort"]
        for p in rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    }
    assert jobs_api == head_ports["dashboard"] == 8265
    by_name = {p["metadata"]["name"]: p for p in pols}
    cp_ports = {
        pt["port"]
        for r in by_name["ringtrain-control-plane"]["spec"]["ingress"]
        for pt in r["ports"]
    }
    assert cp_ports == {api_port}
    head_rules = by_name["ringtrain-ray-head"]["spec"]["ingress"]
    assert head_rules[0]["ports"] == [{"protocol": "TCP", "port": jobs_api}]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_who_reaches_what(overlay: str) -> None:
    objs, pols = policies(overlay)
    cp, workers, head = cluster(objs)
    assert workers, "no worker group rendered"

    def ok(src: Pod, dst: Pod, port: int) -> bool:
        return allowed(pols, src, dst, port)

    # the Ray head's Jobs API: the control plane, nobody else (not even the Ray workers: user code runs there)
    assert ok(cp, head, 8265)
    for src in [*workers, STRANGER, DATABASE, ELSEWHERE, INGRESS, PROMETHEUS]:
        assert not ok(src, head, 8265), src.name
    # the head's other ports: Ray pods only; the control plane needs only the Jobs API
    for port in (6379, 10001, 8266, 52365):
        assert all(ok(w, head, port) for w in workers), port
        assert (
            not ok(cp, head, port) and not ok(STRANGER, head, port) and not ok(INGRESS, head, port)
        ), port
    # the control plane: the drivers (on the head, or the drivers' group) and labelled client namespaces
    drivers = [w for w in workers if w.labels.get("app.kubernetes.io/component") == "ray-driver"]
    assert ok(head, cp, 8000) and ok(INGRESS, cp, 8000) and ok(PROMETHEUS, cp, 8000)
    assert all(ok(d, cp, 8000) for d in drivers)
    for src in [*(w for w in workers if w not in drivers), STRANGER, DATABASE, ELSEWHERE]:
        assert not ok(src, cp, 8000), src.name
    assert not ok(head, cp, 22) and not ok(INGRESS, cp, 5432)
    # workers: every port from Ray pods (collectives, object manager), nothing from elsewhere
    for w in workers:
        for port in (29500, 12345, 6379, 65535):
            assert ok(head, w, port) and all(ok(o, w, port) for o in workers), (w.name, port)
            assert not ok(cp, w, port) and not ok(STRANGER, w, port), (w.name, port)
    # Ray's metrics for the scraper namespace, and nothing else for it
    assert ok(PROMETHEUS, head, 8080) and all(ok(PROMETHEUS, w, 8080) for w in workers)
    assert not ok(PROMETHEUS, head, 6379) and not ok(PROMETHEUS, workers[0], 29500)
    # pods no policy selects are not restricted here (the dev database keeps its own access)
    assert ok(STRANGER, DATABASE, 5432)
    # another team's Ray head in the namespace is not a ringtrain head
    other_head = Pod(
        "another RayCluster's head", {"ray.io/cluster": "other", "ray.io/node-type": "head"}
    )
    assert not ok(other_head, cp, 8000) and not ok(other_head, head, 6379)


def test_rayjob_drivers_reach_the_control_plane() -> None:
    """Where jobs run as RayJobs on their own clusters (an overlay's RayJob template), their heads run the drivers:
    they reach the control plane, and not the shared head's Jobs API."""
    checked = []
    for overlay in OVERLAYS:
        objs, pols = policies(overlay)
        for tmpl in (
            o
            for o in objs
            if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "ringtrain-rayjob-template"
        ):
            cp, _, head = cluster(objs)
            (text,) = tmpl["data"].values()
            (rayjob,) = dh.load_yaml_docs(text)
            labels = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["metadata"][
                "labels"
            ]
            job_head = Pod(
                "a RayJob's head",
                {**labels, "ray.io/cluster": "ringtrain-j1-0", "ray.io/node-type": "head"},
            )
            assert allowed(pols, job_head, cp, 8000), overlay
            assert not allowed(pols, job_head, head, 8265), overlay
            checked.append(overlay)
    if not checked:
        pytest.skip("no overlay has a RayJob template")


def test_evaluator_semantics() -> None:
    """The evaluator on hand-made policies, so a mistake in it cannot make the checks above vacuous."""
    a, b = Pod("a", {"role": "a"}), Pod("b", {"role": "b", "tier": "x"})
    pol = {
        "metadata": {"name": "p", "namespace": NS},
        "spec": {
            "podSelector": {
                "matchExpressions": [{"key": "tier", "operator": "In", "values": ["x", "y"]}]
            },
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": {"role": "a"}}}],
                    "ports": [{"port": 10, "endPort": 20}],
                }
            ],
        },
    }
    assert allowed([pol], a, b, 10) and allowed([pol], a, b, 20) and not allowed([pol], a, b, 21)
    assert not allowed([pol], b, b, 15)  # b is not an allowed source
    assert allowed([pol], b, a, 1)  # a is selected by no policy: open
    assert not allowed(
        [pol], Pod("a elsewhere", {"role": "a"}, "other"), b, 15
    )  # podSelector alone: same namespace
    deny_all = {
        "metadata": {"name": "d", "namespace": NS},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
    }
    assert not allowed([deny_all], a, b, 15) and allowed(
        [deny_all, pol], a, b, 15
    )  # policies add up
    assert selects({"matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}, a.labels)
    assert not selects(
        {"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["x"]}]}, b.labels
    )
