"""The NetworkPolicies, offline: every overlay renders them, they validate (kubernetes-validate --strict), and a
small evaluator of NetworkPolicy semantics (pod and namespace selectors, matchExpressions, ipBlock with exceptions,
port ranges and protocols, ingress and egress, "no policy selects the pod = open") answers who reaches what among
the rendered pods: only the control plane reaches the Ray head's Jobs API, only the Ray head (where drivers run) and
labelled client namespaces reach the control plane, Ray pods reach each other on every port. Ray pods carry the
labels KubeRay adds to them (ray.io/cluster, ray.io/node-type), on top of their templates' own.

Addresses outside the cluster's pods (a load balancer, the metadata server) are endpoints with an `ip`: only ipBlock
rules match them, and ipBlock rules never match a pod. That is the portable reading (Cilium, GKE Dataplane V2, does
not match pod addresses with ipBlock), so a policy that passes here works on Calico and Cilium alike.
"""

from __future__ import annotations

import ipaddress
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
    ip: str | None = None  # set: an address outside the cluster's pods, matched by ipBlock only


def outside(name: str, ip: str) -> Pod:
    """An address outside the cluster's pods: a load balancer, the cloud's metadata server."""
    return Pod(name, {}, namespace="", ip=ip)


def in_block(ip: str, block: dict[str, Any]) -> bool:
    addr = ipaddress.ip_address(ip)
    net = ipaddress.ip_network(block["cidr"])
    if addr.version != net.version or addr not in net:
        return False
    return not any(
        addr.version == ipaddress.ip_network(e).version and addr in ipaddress.ip_network(e)
        for e in block.get("except", [])
    )


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


def port_matches(ports: list[dict[str, Any]] | None, port: int, protocol: str = "TCP") -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != protocol:
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
            if src.ip is not None and in_block(src.ip, peer["ipBlock"]):
                return True
            continue
        if src.ip is not None:  # selectors match pods, never an outside address
            continue
        pod_sel, ns_sel = peer.get("podSelector"), peer.get("namespaceSelector")
        ns_ok = selects(ns_sel, src.ns_labels) if ns_sel is not None else src.namespace == policy_ns
        pod_ok = selects(pod_sel, src.labels) if pod_sel is not None else True
        if ns_ok and pod_ok:
            return True
    return False


def allowed(policies: list[dict[str, Any]], src: Pod, dst: Pod, port: int) -> bool:
    """Whether a TCP connection from src to dst:port is admitted by the ingress policies."""
    if dst.ip is not None:
        return True  # no ingress policy of the cluster applies to an outside address
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


def types_of(policy: dict[str, Any]) -> list[str]:
    """policyTypes, or what the API server defaults it to: Ingress, plus Egress when egress rules exist."""
    spec = policy["spec"]
    return spec.get("policyTypes") or ["Ingress", *(["Egress"] if "egress" in spec else [])]


def allowed_egress(
    policies: list[dict[str, Any]], src: Pod, dst: Pod, port: int, protocol: str = "TCP"
) -> bool:
    """Whether the egress policies let src open a connection to dst:port."""
    chosen = [
        p
        for p in policies
        if p["metadata"].get("namespace", NS) == src.namespace
        and selects(p["spec"]["podSelector"], src.labels)
        and "Egress" in types_of(p)
    ]
    if not chosen:
        return True
    return any(
        peer_matches(rule.get("to"), dst, p["metadata"].get("namespace", NS))
        and port_matches(rule.get("ports"), port, protocol)
        for p in chosen
        for rule in p["spec"].get("egress", [])
    )


def connects(
    policies: list[dict[str, Any]], src: Pod, dst: Pod, port: int, protocol: str = "TCP"
) -> bool:
    """Both ends agree: src's egress policies and, for a pod, dst's ingress policies."""
    ingress = allowed(policies, src, dst, port) if protocol == "TCP" else True
    return allowed_egress(policies, src, dst, port, protocol) and ingress


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


def test_evaluator_semantics_for_addresses_and_egress() -> None:
    """ipBlock with exceptions matches outside addresses only, never a pod; egress policies close
    what they select except their rules; protocols are told apart; connects needs both ends."""
    a, b = Pod("a", {"role": "a"}), Pod("b", {"role": "b"})
    lb, metadata = outside("lb", "35.191.3.4"), outside("metadata", "169.254.169.254")
    v6 = outside("imds v6", "fd00:ec2::254")
    ingress = {
        "metadata": {"name": "i", "namespace": NS},
        "spec": {
            "podSelector": {"matchLabels": {"role": "b"}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"ipBlock": {"cidr": "35.191.0.0/16"}}], "ports": [{"port": 80}]}
            ],
        },
    }
    assert allowed([ingress], lb, b, 80) and not allowed([ingress], lb, b, 81)
    assert not allowed([ingress], outside("elsewhere", "10.0.0.1"), b, 80)
    # a pod is no address: ipBlock never matches it
    assert not allowed([ingress], Pod("a pod", {"role": "a"}), b, 80)
    egress = {
        "metadata": {"name": "e", "namespace": NS},
        "spec": {
            "podSelector": {},
            "policyTypes": ["Egress"],
            "egress": [
                {"to": [{"namespaceSelector": {}}]},
                {"ports": [{"protocol": "UDP", "port": 53}]},
                {
                    "to": [
                        {"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.169.254/32"]}},
                        {"ipBlock": {"cidr": "::/0", "except": ["fd00:ec2::254/128"]}},
                    ]
                },
            ],
        },
    }
    assert allowed_egress([egress], a, b, 1234) and allowed_egress([egress], a, lb, 443)
    assert not allowed_egress([egress], a, metadata, 80) and not allowed_egress([egress], a, v6, 80)
    assert allowed_egress([egress], a, metadata, 53, "UDP")  # DNS to any address
    assert not connects([egress, ingress], a, b, 80)  # b takes only the load balancer
    assert connects([egress], a, b, 80) and not connects([egress], a, metadata, 80)
    assert not in_block("169.254.169.254", {"cidr": "::/0"})  # families never mix
