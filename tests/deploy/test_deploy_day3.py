"""Day 3 on Kubernetes, checked offline on the rendered manifests: rolling updates that drop no
connection and a drain procedure that fits the disruption budgets; a database proxy the schema
upgrade can use; storage, node labels, Filestore ownership and load-balancer addresses per
provider; node shapes and topology labels as components; the image build's parallelism and
prebuilt wheel, images pinned by digest in the walkthroughs; and a namespace locked down by
default (Pod Security, no Kubernetes token in Ray pods, no cloud metadata, a hardened RayJob
submitter, the Redis password out of the command line, read-only root filesystems, no whole
Secret in the init container).

Rendering needs `kubectl` (skipped without it), like tests/deploy/test_deploy.py. Stacks (an
overlay with components added) are rendered once per session (tests/deploy/stacks.py).
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from service.capacity import shapes_from_raycluster
from service.kuberay_jobs import _bytes, _quantity, pod_shape, rayjob_for
from tests.deploy import pod_security as pss
from tests.deploy import stacks
from tests.deploy import test_network_policy as npol
from tests.deploy.test_deploy import K8S_VERSION, OVERLAY_IDS, OVERLAYS, by_kind, rendered, the_one
from tests.deploy.test_deploy_cluster import quantity_bytes, settings_of
from tests.deploy.test_deploy_day2 import (
    README,
    _gpu_request,
    _job_request,
    node_affinity_admits,
    rayjob_template,
    template_pieces,
)
from tests.support import deploy_helpers as dh

Objs = tuple[dict[str, Any], ...]
SERVE = dh.ROOT / "api" / "cli" / "serve.py"
COMPONENTS = dh.K8S / "components"
GPU_OVERLAYS = ("gpu", "kueue", "fast-links")
# Provider stacks: the gpu overlay with each provider's storage, load balancer and database parts.
PROVIDERS = {
    "gke": ("storage-gke", "lb-gke", "db-proxy-cloud-sql"),
    "eks": ("storage-eks", "lb-eks"),
    "aks": ("storage-aks", "lb-aks"),
}
# Node shapes, each rendered in Kueue mode (so the RayJob template and the quota are checked too),
# two of them with a provider's topology labels.
SHAPES = {"gpu-node-8": (), "gpu-node-4": ("topology-gke",), "gpu-node-1": ("topology-eks",)}
TOPOLOGY_LABELS = {
    "topology-gke": [
        "cloud.google.com/gce-topology-block",
        "cloud.google.com/gce-topology-subblock",
        "cloud.google.com/gce-topology-host",
    ],
    "topology-eks": [
        "topology.k8s.aws/network-node-layer-1",
        "topology.k8s.aws/network-node-layer-2",
        "topology.k8s.aws/network-node-layer-3",
    ],
}
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
# Cloud metadata and credential endpoints no pod of the namespace may reach (AWS/GCE/Azure IMDS,
# GKE's Workload Identity server without Dataplane V2, the EKS Pod Identity agent, IMDS on IPv6).
METADATA = ["169.254.169.254", "169.254.169.252", "169.254.170.23", "fd00:ec2::254", "fd00:ec2::23"]
KUBE_DNS = npol.Pod("kube-dns", {"k8s-app": "kube-dns"}, "kube-system", {"name": "kube-system"})
ROOT_JOB = "Job/ringtrain-checkpoints-owner"
TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


def provider_stack(provider: str) -> Objs:
    return stacks.render("gpu", gpu=PROVIDERS[provider])


def shape_stack(shape: str) -> Objs:
    return stacks.render("kueue", gpu=(dh.TEST_STORAGE, shape), own=SHAPES[shape])


def all_stacks() -> list[tuple[str, Objs]]:
    """Every overlay as committed (gpu ones with the test storage) and every component stack."""
    out = [(ov, rendered(ov)) for ov in OVERLAYS]
    out += [(f"gpu+{p}", provider_stack(p)) for p in PROVIDERS]
    out += [(f"kueue+{s}", shape_stack(s)) for s in SHAPES]
    return out


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (c,) = [c for c in dh.containers(pod) if c["name"] == name]
    return c


def readme_section(heading: str) -> str:
    return stacks.section(README.read_text(), heading)


# --- pods as they run: KubeRay's additions included -------------------------------------------------------------


def kuberay_pods(kind: str, name: str, spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The pods KubeRay makes from a RayCluster spec (or a RayJob's), with the autoscaler container
    it adds to the head (its securityContext and mounts from autoscalerOptions; KubeRay's default
    has none), and a RayJob's submitter pod (the template's, else KubeRay's default container)."""
    cluster = spec.get("rayClusterSpec", spec)
    pods = []
    for ref in dh.pod_templates(
        {"kind": "RayCluster", "metadata": {"name": name}, "spec": cluster}
    ):
        pod = dict(ref.spec)
        if ref.role == "head" and cluster.get("enableInTreeAutoscaling"):
            opts = cluster.get("autoscalerOptions") or {}
            autoscaler = {
                "name": "autoscaler",
                "securityContext": opts.get("securityContext", {}),
                "volumeMounts": [
                    *opts.get("volumeMounts", []),
                    {"name": "ray-logs", "mountPath": "/tmp/ray"},  # KubeRay adds it
                ],
            }
            pod["containers"] = [*pod["containers"], autoscaler]
        pods.append((f"{kind}/{ref.owner.split('/', 1)[1]}", pod))
    if kind == "RayJob":
        submitter = (spec.get("submitterPodTemplate") or {}).get("spec") or {
            "containers": [{"name": "ray-job-submitter"}],  # KubeRay's default: no securityContext
            "restartPolicy": "Never",
        }
        pods.append((f"RayJob/{name} submitter", submitter))
    return pods


def pods_of(objs: Objs) -> list[tuple[str, dict[str, Any]]]:
    """Every pod the objects make, KubeRay's included: workload templates, the RayCluster's pods,
    and the pods of the RayJob template (each job's cluster)."""
    out = []
    for o in objs:
        if o["kind"] == "RayCluster":
            out += kuberay_pods("RayCluster", o["metadata"]["name"], o["spec"])
        else:
            out += [(p.owner, p.spec) for p in dh.pod_templates(o)]
    for cm in by_kind(objs, "ConfigMap"):
        if cm["metadata"]["name"] == "ringtrain-rayjob-template":
            job = rayjob_template(objs)
            out += kuberay_pods("RayJob", job["metadata"]["name"], job["spec"])
    return out


def ray_pods(objs: Objs) -> list[tuple[str, dict[str, Any]]]:
    return [(o, p) for o, p in pods_of(objs) if o.startswith(("RayCluster/", "RayJob/"))]


def validate_all(objs: Objs) -> None:
    for o in objs:
        if dh.is_custom(o):
            assert dh.crd_errors(o) == [], (o["kind"], dh.crd_errors(o))
        else:
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)


def test_every_stack_renders_and_validates() -> None:
    """Each component on its overlay: every object valid (CRDs with unknown fields rejected,
    built-in kinds strict), namespaced into ringtrain except the cluster-scoped ones."""
    for name, objs in all_stacks():
        validate_all(objs)
        job = [o for o in objs if o["kind"] == "ConfigMap" and "rayjob-template.yaml" in o["data"]]
        if job:
            assert dh.crd_errors(rayjob_template(objs)) == [], name
        for o in objs:
            scoped = o["kind"] in {"Namespace", "StorageClass"}
            assert (o["metadata"].get("namespace") is None) == scoped or dh.is_custom(o), (name, o)


# --- 5: rolling updates drop no connection; drains fit the budgets ----------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_a_stopping_replica_keeps_serving_until_the_load_balancers_forget_it(overlay: str) -> None:
    pod = the_one(rendered(overlay), "Deployment", "ringtrain-api")["spec"]["template"]["spec"]
    api = container(pod, "api")
    delay = api["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert delay >= 10, "endpoints, kube-proxy and cloud load balancers take seconds to drop a pod"
    m = re.search(r"timeout_graceful_shutdown=(\d+)", SERVE.read_text())
    assert m, "uvicorn's graceful shutdown is set in api/cli/serve.py"
    graceful = int(m.group(1))
    assert pod["terminationGracePeriodSeconds"] >= delay + graceful + 10, (
        "the kubelet kills the pod at the end of its grace period, preStop included"
    )


def _selector(text: str) -> dict[str, Any]:
    """A kubectl -l selector (k=v, k!=v, k, !k joined by commas) as a LabelSelector."""
    out: dict[str, Any] = {"matchLabels": {}, "matchExpressions": []}
    for term in text.split(","):
        if "!=" in term:
            k, v = term.split("!=")
            out["matchExpressions"].append({"key": k, "operator": "NotIn", "values": [v]})
        elif "=" in term:
            k, v = term.split("=")
            out["matchLabels"][k] = v
        elif term.startswith("!"):
            out["matchExpressions"].append({"key": term[1:], "operator": "DoesNotExist"})
        else:
            out["matchExpressions"].append({"key": term, "operator": "Exists"})
    return out


def test_drain_procedure_moves_exactly_the_pods_the_budgets_hold() -> None:
    """The guide's node-drain procedure names, by label, the pods whose budgets allow no eviction
    (the head, the drivers' pod) and no other, and covers what EKS and GKE do with such budgets."""
    text = readme_section("## 14. Node upgrades and drains")
    objs = rendered("gpu")
    cp, workers, head = npol.cluster(objs)
    (drivers,) = [w for w in workers if w.labels["app.kubernetes.io/component"] == "ray-driver"]
    (gpu,) = [w for w in workers if w.labels["app.kubernetes.io/component"] == "ray-worker-gpu"]
    pods = {"head": head, "drivers": drivers, "gpu workers": gpu, "control plane": cp}

    def picks(line: str) -> set[str]:
        (sel,) = re.findall(r"-l\s+([\w./=!,-]+)", line)
        return {name for name, p in pods.items() if npol.selects(_selector(sel), p.labels)}

    lines = [ln for ln in stacks.bash_lines(text) if re.search(r"-l\s", ln)]
    # every selector names one kind of pod; what is deleted is the head and the drivers' pod
    assert all(len(picks(ln)) == 1 for ln in lines), [(ln, picks(ln)) for ln in lines]
    deleted = [picks(ln) for ln in lines if "delete pod" in ln]
    assert sorted(map(sorted, deleted)) == [["drivers"], ["head"]], deleted
    held = {
        name
        for name, p in pods.items()
        for b in by_kind(objs, "PodDisruptionBudget")
        if npol.selects(b["spec"]["selector"], p.labels) and b["spec"].get("maxUnavailable") == 0
    }
    assert held == {"head", "drivers"}
    for needle in (
        "kubectl cordon",
        "kubectl drain",
        "update-nodegroup-version",  # EKS managed node groups
        "PodEvictionFailure",
        "--force",
        "60 minutes",  # GKE's surge upgrades evict anyway after an hour
        "maintenance exclusion",
        "ray list jobs",  # which drivers still run on the drivers' pod
    ):
        assert needle in text, needle
    for heading in ("### GKE from zero", "### EKS from zero"):
        walk = readme_section(heading)
        assert "§14" in walk and "rollout undo" in walk, heading


# --- 6: a database proxy the schema upgrade can use ---------------------------------------------------------------


def test_database_proxy_is_a_native_sidecar_up_before_the_schema_upgrade() -> None:
    objs = provider_stack("gke")
    pod = the_one(objs, "Deployment", "ringtrain-api")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["initContainers"]] == ["cloud-sql-proxy", "db-upgrade"]
    assert [c["name"] for c in pod["containers"]] == ["api"]
    proxy, upgrade = pod["initContainers"]
    # restartPolicy Always makes it a sidecar: started in order, kept running, stopped last;
    # the next init container waits for its startup probe
    assert proxy["restartPolicy"] == "Always" and "restartPolicy" not in upgrade
    probe = proxy["startupProbe"]["httpGet"]
    assert probe["path"] == "/startup"
    ports = {p["name"]: p["containerPort"] for p in proxy["ports"]}
    args = proxy["args"]
    assert f"--http-port={ports[probe['port']]}" in args and "--health-check" in args
    assert "--http-address=0.0.0.0" in args, "the kubelet probes the pod's address"
    assert "--port=5432" in args and not any(a.startswith("--address") for a in args)
    # where RINGTRAIN_DATABASE_URL must point, as the guide says
    assert "@127.0.0.1:5432/ringtrain" in README.read_text()
    instance = the_one(objs, "ConfigMap", "ringtrain-cloud-sql")["data"]["instance"]
    assert "REPLACE" in instance and "$(CLOUD_SQL_INSTANCE)" in args
    assert pss.violations(pod, "restricted") == []


# --- 7: storage, GPU node labels, Filestore ownership, load balancers ---------------------------------------------


@pytest.mark.parametrize("component", dh.STORAGE_COMPONENTS)
def test_redis_volume_names_a_storage_class_of_the_provider(component: str) -> None:
    objs = dh.render_overlay("gpu", component)
    wanted = the_one(objs, "ConfigMap", "ringtrain-storage-class")["data"]["redisStorageClassName"]
    pvc = the_one(objs, "PersistentVolumeClaim", "ringtrain-redis-data")["spec"]
    assert pvc["storageClassName"] == wanted and pvc["accessModes"] == ["ReadWriteOnce"]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", wanted)
    classes = {o["metadata"]["name"]: o for o in by_kind(objs, "StorageClass")}
    if component == "storage-eks":  # no default class on new EKS clusters: the component ships one
        sc = classes[wanted]
        assert sc["provisioner"] == "ebs.csi.aws.com"
        assert sc["volumeBindingMode"] == "WaitForFirstConsumer"  # an EBS volume lives in one zone
        assert sc["parameters"]["encrypted"] == "true"
    # the committed manifest names no real class: a claim no component patched is refused
    raw = yaml.safe_load_all((dh.OVERLAYS / "gpu" / "redis.yaml").read_text())
    (claim,) = [d for d in raw if d and d["kind"] == "PersistentVolumeClaim"]
    assert not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", claim["spec"]["storageClassName"])


def tolerates(spec: dict[str, Any], taint: dict[str, str]) -> bool:
    for t in spec.get("tolerations", []):
        key_ok = t.get("key") == taint["key"] or (
            not t.get("key") and t.get("operator") == "Exists"
        )
        value_ok = t.get("operator") == "Exists" or t.get("value") == taint["value"]
        effect_ok = not t.get("effect") or t["effect"] == taint["effect"]
        if key_ok and value_ok and effect_ok:
            return True
    return False


def _eks_node_groups() -> dict[str, dict[str, Any]]:
    (config,) = [
        d
        for block in re.findall(
            r"```yaml\n(.*?)```", readme_section("### EKS from zero"), re.DOTALL
        )
        for d in yaml.safe_load_all(block)
        if d and d.get("kind") == "ClusterConfig"
    ]
    return {g["name"]: g for g in config["managedNodeGroups"]}


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_gpu_nodes_repel_cpu_pods_by_the_taint_and_labels_the_guide_sets(overlay: str) -> None:
    """GPU nodes carry the taint nvidia.com/gpu=present:NoSchedule and the label
    ringtrain.io/pool=gpu (GKE taints GPU pools itself; the EKS walkthrough's node groups set both):
    only GPU workers tolerate the taint, and every CPU pod's node affinity refuses the label."""
    objs = rendered(overlay)
    groups = _eks_node_groups()
    gpu_groups = [g for g in groups.values() if "gpu" in g["name"]]
    cpu_groups = [g for g in groups.values() if "gpu" not in g["name"]]
    assert gpu_groups and cpu_groups
    for g in gpu_groups:
        assert g["labels"]["ringtrain.io/pool"] == "gpu"
        assert GPU_TAINT in g["taints"]
    for g in cpu_groups:
        assert not g.get("taints") and "ringtrain.io/pool" not in g.get("labels", {})
    for owner, pod in pods_of(objs):
        gpu_pod = any(
            "nvidia.com/gpu" in (c.get("resources") or {}).get("limits", {})
            for c in pod["containers"]
        )
        assert tolerates(pod, GPU_TAINT) == gpu_pod, owner
        if gpu_pod:
            continue
        if owner.startswith("RayJob/"):  # Kueue places these: the flavor's labels, below
            continue
        for g in gpu_groups:
            assert not node_affinity_admits(pod, g["labels"]), f"{owner} may land on {g['name']}"
        for g in cpu_groups:
            assert node_affinity_admits(pod, g.get("labels", {})), f"{owner} refuses {g['name']}"
    # Kueue mode: every pod of a RayJob goes to the flavor's nodes, the GPU nodes (heads and
    # submitters included: one flavor covers cpu, memory and GPUs; the node shapes leave them room)
    for flavor in by_kind(objs, "ResourceFlavor"):
        for g in gpu_groups:
            assert flavor["spec"]["nodeLabels"].items() <= g["labels"].items()
        assert tolerates(flavor["spec"], GPU_TAINT)
    gke = readme_section("### GKE from zero")
    assert "--node-labels=ringtrain.io/pool=gpu" in gke


def test_filestore_share_is_handed_to_the_uid_the_pods_run_as(tmp_path: Path) -> None:
    """Filestore ignores fsGroup: the GKE storage component's Job chowns the share's root to the
    uid:gid every other pod that mounts it runs as. Run here on a directory (as root)."""
    objs = provider_stack("gke")
    job = the_one(objs, "Job", "ringtrain-checkpoints-owner")
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    ckpt = settings_of(objs).checkpoint_dir
    (vol,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert vol["persistentVolumeClaim"]["claimName"] == "ringtrain-checkpoints"
    assert [m["mountPath"] for m in c["volumeMounts"]] == [str(ckpt)]
    owners = set()
    for owner, p in pods_of(objs):
        mounts = {
            v["name"]
            for v in p.get("volumes", [])
            if v.get("persistentVolumeClaim", {}).get("claimName") == "ringtrain-checkpoints"
        }
        if owner != ROOT_JOB and mounts:
            sc = p["securityContext"]
            owners.add((sc["runAsUser"], sc["runAsGroup"]))
    assert len(owners) == 1, owners
    ((uid, gid),) = owners
    m = re.search(r"chown (\d+):(\d+) ", c["args"][0])
    assert m and (int(m.group(1)), int(m.group(2))) == (uid, gid)
    api = container(the_one(objs, "Deployment", "ringtrain-api")["spec"]["template"]["spec"], "api")
    assert c["image"] == api["image"], "the control plane's image, pulled already"
    assert set(c["securityContext"]["capabilities"]["add"]) == {"CHOWN", "FOWNER"}
    assert job["spec"]["ttlSecondsAfterFinished"] <= 3600, "gone before the next apply"
    for labels in ({"nvidia.com/gpu.present": "true"}, {"ringtrain.io/pool": "gpu"}):
        assert not node_affinity_admits(pod, labels)
    if os.geteuid() != 0:
        pytest.skip("running the chown needs root")
    share = tmp_path / "share"
    share.mkdir(mode=0o755)
    script = c["args"][0].replace(str(ckpt), str(share))
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    st = share.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, gid, 0o2775)
    assert f"{uid}:{gid} 2775" in out.stdout


@pytest.mark.parametrize(
    ("provider", "address"),
    [("gke", "35.191.7.9"), ("gke", "130.211.2.3"), ("eks", "192.168.40.7"), ("aks", "10.225.1.4")],
)
def test_cloud_load_balancer_reaches_the_api_and_nothing_else(provider: str, address: str) -> None:
    objs = provider_stack(provider)
    pols = by_kind(objs, "NetworkPolicy")
    for pol in pols:
        kubernetes_validate.validate(pol, K8S_VERSION, strict=True)
    lb = npol.outside(f"{provider} load balancer", address)
    cp, workers, head = npol.cluster(objs)
    assert npol.allowed(pols, lb, cp, 8000)
    assert not npol.allowed(pols, lb, cp, 9090), "the proxy's health port is the kubelet's"
    assert not npol.allowed(pols, lb, head, 8265) and not npol.allowed(pols, lb, head, 6379)
    assert not any(npol.allowed(pols, lb, w, 29500) for w in workers)
    assert not npol.allowed(pols, npol.outside("the internet", "203.0.113.9"), cp, 8000)
    # without the component the namespace's policy drops it
    bare = by_kind(rendered("gpu"), "NetworkPolicy")
    assert not npol.allowed(bare, lb, cp, 8000)


# --- 8: node shapes and topology labels ---------------------------------------------------------------------------


def _component_values(name: str) -> dict[str, str]:
    (doc,) = dh.load_yaml_docs((COMPONENTS / name / "gpu-node.yaml").read_text())
    return dict(doc["data"])


@pytest.mark.parametrize("shape", SHAPES)
def test_node_shape_sizes_the_group_the_template_the_capacity_and_the_quota(shape: str) -> None:
    objs = shape_stack(shape)
    node = the_one(objs, "ConfigMap", "ringtrain-gpu-node")["data"]
    assert node == _component_values(shape), "the component's values are the ones rendered"
    rc = the_one(objs, "RayCluster")
    (group,) = [g for g in rc["spec"]["workerGroupSpecs"] if g["groupName"] == "gpu"]
    pod = group["template"]["spec"]
    res = container(pod, "ray-worker")["resources"]
    want = {"cpu": node["cpu"], "memory": node["memory"], "nvidia.com/gpu": node["gpus"]}
    assert res["requests"] == res["limits"] == want
    assert group["rayStartParams"] == {
        "num-cpus": node["cpu"],
        "object-store-memory": node["objectStoreMemory"],
    }
    (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["sizeLimit"] == node["shmSize"]
    assert group["maxReplicas"] == int(node["maxReplicas"])
    # /dev/shm holds the object store and leaves NCCL room; it counts against the pod's memory
    shm_b, store, mem = (
        quantity_bytes(node["shmSize"]),
        int(node["objectStoreMemory"]),
        quantity_bytes(node["memory"]),
    )
    assert shm_b - store >= min(16 << 30, shm_b // 2) and shm_b <= mem // 2
    # the control plane counts what the group can hold; Kueue's GPU quota is the same pool
    settings = settings_of(objs)
    assert settings.autoscaler_nodes == shapes_from_raycluster(rc)
    cq = the_one(objs, "ClusterQueue")
    (rg,) = cq["spec"]["resourceGroups"]
    quota = {r["name"]: r["nominalQuota"] for r in rg["flavors"][0]["resources"]}
    assert quota["cpu"] == node["kueueCpuQuota"] and quota["memory"] == node["kueueMemoryQuota"]
    (cap,) = settings.autoscaler_nodes
    assert cap.gpus * cap.max_nodes == int(quota["nvidia.com/gpu"])
    # the RayJob template's worker pod is the shared cluster's
    template = rayjob_template(objs)
    text = the_one(objs, "ConfigMap", "ringtrain-rayjob-template")["data"]["rayjob-template.yaml"]
    values = template_pieces(text)
    assert values["cpu"] == {node["cpu"]} and values["memory"] == {node["memory"]}
    assert values["gpus"] == {node["gpus"]} and values["shmSize"] == {node["shmSize"]}
    assert values["objectStoreMemory"] == {node["objectStoreMemory"]}
    (tgroup,) = template["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert container(tgroup["template"]["spec"], "ray-worker")["resources"] == res
    assert pod_shape(template) == (cap.cpus, cap.gpus)
    assert dh.crd_errors(template) == []
    # GPUs run out before cpu or memory quota, for every ring size
    limit = {
        "cpu": _quantity(quota["cpu"]),
        "memory": _bytes(quota["memory"]),
        "gpu": _quantity(quota["nvidia.com/gpu"]),
    }
    for world in range(1, int(limit["gpu"]) + 1):
        per_job = _job_request(rayjob_for(template, _gpu_request(world)))
        jobs = int(limit["gpu"] // per_job["gpu"])
        for k in ("cpu", "memory"):
            assert jobs * per_job[k] <= limit[k], f"{shape}: {jobs} jobs of {world} GPUs: {k}"


def test_default_node_shape_is_the_8_gpu_component() -> None:
    (doc,) = dh.load_yaml_docs((dh.OVERLAYS / "gpu" / "gpu-node.yaml").read_text())
    assert doc["data"] == _component_values("gpu-node-8")
    listed = {p.name for p in COMPONENTS.iterdir() if p.name.startswith("gpu-node-")}
    assert listed == set(SHAPES)


@pytest.mark.parametrize("component", TOPOLOGY_LABELS)
def test_kueue_topology_uses_the_providers_node_labels(component: str) -> None:
    (shape,) = [s for s, own in SHAPES.items() if component in own]
    objs = shape_stack(shape)
    topo = the_one(objs, "Topology")
    levels = [lv["nodeLabel"] for lv in topo["spec"]["levels"]]
    assert levels == [*TOPOLOGY_LABELS[component], "kubernetes.io/hostname"]
    assert the_one(objs, "ResourceFlavor")["spec"]["topologyName"] == topo["metadata"]["name"]
    (group,) = rayjob_template(objs)["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    required = group["template"]["metadata"]["annotations"][
        "kueue.x-k8s.io/podset-required-topology"
    ]
    assert required == levels[0], "one ring inside one domain of the top level"
    # the default, for nodes labelled by hand, is the generic key
    default = rayjob_template(rendered("kueue"))["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    assert (
        default["template"]["metadata"]["annotations"]["kueue.x-k8s.io/podset-required-topology"]
        == "network.topology.kubernetes.io/block"
    )


# --- 9: the image build, images by digest --------------------------------------------------------------------------


def _flash_attn_step() -> tuple[str, dict[str, str]]:
    """The flash-attn stage's RUN (its shell command, BuildKit's --mount flags dropped) and the
    ARG defaults it sees as environment."""
    instrs = dh.parse_dockerfile((dh.DOCKER / "Dockerfile.cuda").read_text())
    stage = [i for i in instrs if i.cmd == "FROM"]
    (start,) = [
        n for n, i in enumerate(instrs) if i.cmd == "FROM" and i.args.endswith(" flash-attn")
    ]
    end = instrs.index(next(s for s in stage if instrs.index(s) > start))
    env = dh.arg_defaults(instrs)
    runs = []
    for i in instrs[start:end]:
        if i.cmd == "ARG" and "=" in i.args:
            k, _, v = i.args.partition("=")
            env[k] = v.strip('"')
        if i.cmd == "RUN":
            runs.append(i.args)
    (run,) = runs
    flags, _ = dh.split_flags(run)
    assert flags.get("mount", "").startswith("type=bind,from=flash-attn-prebuilt,target=")
    command = re.sub(r"^(--\S+\s+)+", "", run)
    return command, {k: dh.substitute(v, env) for k, v in env.items()}


def _run_step(
    tmp_path: Path, command: str, env: dict[str, str], **extra: str
) -> tuple[str, list[str]]:
    """Run the step in a directory standing in for the build's paths, with `pip` recording its
    calls (and writing the wheel `pip wheel`/`pip download` would)."""
    prebuilt, wheels, log = tmp_path / "prebuilt", tmp_path / "wheels", tmp_path / "pip.log"
    prebuilt.mkdir(parents=True, exist_ok=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    pip = bin_dir / "pip"
    pip.write_text(
        "#!/bin/sh\n"
        f'echo "MAX_JOBS=$MAX_JOBS NVCC_THREADS=$NVCC_THREADS $*" >> {log}\n'
        'case "$1" in wheel|download) '
        f"touch {wheels}/flash_attn-2.8.3-cp311-cp311-linux_x86_64.whl;; esac\n"
    )
    pip.chmod(0o755)
    script = command.replace("/prebuilt", str(prebuilt)).replace("/home/ray/wheels", str(wheels))
    run_env = {**env, **extra, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    out = subprocess.run(
        ["sh", "-c", script], env=run_env, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    calls = log.read_text().splitlines() if log.exists() else []
    return out.stdout, calls


def test_flash_attn_comes_prebuilt_or_compiles_with_explicit_parallelism(tmp_path: Path) -> None:
    command, env = _flash_attn_step()
    assert env["MAX_JOBS"] == "auto" and env["NVCC_THREADS"].isdigit()
    # no wheel given: compiled, with the jobs it prints (the CPUs, capped at one per 8 GiB) and
    # NVCC_THREADS, after installing the torch it compiles against
    out, calls = _run_step(tmp_path / "compile", command, env)
    m = re.search(r"MAX_JOBS=(\d+) NVCC_THREADS=(\d+)", out)
    assert m, out
    jobs = int(m.group(1))
    total_kib = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
    assert 1 <= jobs <= max(1, min(len(os.sched_getaffinity(0)), total_kib // (8 << 20)))
    wheels = [c.split(" ", 2) for c in calls if c.split(" ")[2] == "wheel"]
    assert len(wheels) == 1 and wheels[0][:2] == [f"MAX_JOBS={jobs}", f"NVCC_THREADS={m.group(2)}"]
    assert "flash-attn==" in wheels[0][2]
    assert any(f"torch=={env['TORCH_VERSION']}" in c for c in calls)
    # an explicit number is used as given
    out, calls = _run_step(tmp_path / "explicit", command, {**env, "MAX_JOBS": "3"})
    assert "MAX_JOBS=3 " in out
    assert [c.split(" ")[0] for c in calls if c.split(" ")[2] == "wheel"] == ["MAX_JOBS=3"]
    # a prebuilt wheel in the named build context: copied, nothing installed or compiled
    pre = tmp_path / "prebuilt"
    pre.mkdir(parents=True)
    (pre / "flash_attn-2.8.3+local-cp311-cp311-linux_x86_64.whl").write_bytes(b"wheel")
    out, calls = _run_step(tmp_path, command, env)
    assert (
        calls == []
        and (tmp_path / "wheels" / "flash_attn-2.8.3+local-cp311-cp311-linux_x86_64.whl").is_file()
    )
    # and how to make and pass one is in the guide and the Dockerfile
    text = README.read_text()
    dockerfile = (dh.DOCKER / "Dockerfile.cuda").read_text()
    for needle in (
        "--build-context flash-attn-prebuilt=",
        "--target flash-attn-wheel",
        "MAX_JOBS",
        "NVCC_THREADS",
    ):
        assert needle in text and needle in dockerfile, needle
    assert re.search(r"^FROM scratch AS flash-attn-prebuilt$", dockerfile, re.MULTILINE)
    assert re.search(r"^COPY --from=flash-attn /home/ray/wheels/ /$", dockerfile, re.MULTILINE)


def _images(objs: Objs) -> set[str]:
    return {c["image"] for _, pod in pods_of(objs) for c in dh.containers(pod) if "image" in c}


@pytest.mark.parametrize("heading", ["### GKE from zero", "### EKS from zero"])
def test_walkthrough_renders_with_every_image_pinned_by_digest(heading: str) -> None:
    """The guide's walkthrough, replayed (its `kustomize edit` commands on a copy of deploy/k8s,
    then the overlay it applies): valid, and every image, the RayJob template's included, pinned
    by digest; the digests in the guide are placeholders and say so."""
    dh.need_kubectl()
    text = readme_section(heading)
    walk = stacks.replay(text)
    objs = stacks.render_stack(walk.stack())
    validate_all(objs)
    images = _images(objs)
    assert images and all(re.search(r":[\w.-]+@sha256:\S+$", i) for i in images), images
    digests = {i.split("@", 1)[1] for i in images}
    assert all(d.startswith("sha256:PLACEHOLDER-") for d in digests), digests
    # the tags the guide pins are the ones the manifests name (only the digest is added)
    plain = stacks.render_stack(stacks.Stack(walk.stack().overlay, walk.stack().components))
    tag = re.compile(r":([\w.-]+)(@|$)")
    assert {tag.search(i).group(1) for i in images} == {
        tag.search(i).group(1) for i in _images(plain)
    }
    assert "PLACEHOLDER" in text and "imagetools inspect" in text
    names = {c for comps in walk.components.values() for c in comps}
    assert any("storage-" in c for c in names) and any("gpu-node-" in c for c in names)
    assert any("lb-" in c for c in names)
    for secret in ("ringtrain-secrets", "ringtrain-ray-auth", "ringtrain-redis"):
        assert f"create secret generic {secret}" in text


# --- 10: locked down by default -------------------------------------------------------------------------------------


def test_namespace_enforces_baseline_and_reports_restricted() -> None:
    for ov in OVERLAYS:
        labels = the_one(rendered(ov), "Namespace")["metadata"]["labels"]
        prefix = "pod-security.kubernetes.io/"
        assert labels[prefix + "enforce"] == "baseline"
        assert labels[prefix + "warn"] == labels[prefix + "audit"] == "restricted"
        for mode in ("enforce", "warn", "audit"):
            assert re.fullmatch(r"v1\.\d+", labels[f"{prefix}{mode}-version"]), mode


def test_every_pod_meets_baseline_and_all_but_the_ownership_job_restricted() -> None:
    """What the namespace's labels admit: every pod baseline (enforced), every pod but the GKE
    storage component's root Job restricted (so warn/audit stay quiet), the control plane and
    Redis among them, and KubeRay's own containers (autoscaler, RayJob submitter) included."""
    seen = set()
    for name, objs in all_stacks():
        for owner, pod in pods_of(objs):
            seen.add(owner)
            assert pss.violations(pod, "baseline") == [], (name, owner)
            restricted = pss.violations(pod, "restricted")
            assert (restricted != []) == (owner == ROOT_JOB), (name, owner, restricted)
    assert {"Deployment/ringtrain-api", "Deployment/ringtrain-redis", ROOT_JOB} <= seen
    assert "RayJob/ringtrain-JOBID-0 submitter" in seen and "RayCluster/ringtrain head" in seen


def test_pod_security_checker_refuses_what_the_standards_refuse() -> None:
    good = {
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [
            {
                "name": "c",
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"]},
                },
            }
        ],
        "volumes": [{"name": "v", "emptyDir": {}}],
    }
    assert pss.violations(good, "restricted") == []

    def with_(path: list[Any], value: Any) -> dict[str, Any]:
        bad = yaml.safe_load(yaml.safe_dump(good))
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return bad

    baseline_bad = [
        with_(["hostNetwork"], True),
        with_(["containers", 0, "securityContext", "privileged"], True),
        with_(["containers", 0, "securityContext", "capabilities", "add"], ["SYS_ADMIN"]),
        with_(["volumes", 0], {"name": "v", "hostPath": {"path": "/"}}),
        with_(["securityContext", "seccompProfile", "type"], "Unconfined"),
        with_(["containers", 0, "ports"], [{"containerPort": 80, "hostPort": 80}]),
    ]
    for bad in baseline_bad:
        assert pss.violations(bad, "baseline"), bad
    restricted_bad = [
        with_(
            ["containers", 0, "securityContext"], {"capabilities": {"drop": ["ALL"]}}
        ),  # APE unset
        with_(["securityContext", "runAsNonRoot"], False),
        with_(["containers", 0, "securityContext", "allowPrivilegeEscalation"], True),
        with_(["containers", 0, "securityContext", "capabilities"], {"drop": ["NET_RAW"]}),
        with_(["containers", 0, "securityContext", "capabilities", "add"], ["CHOWN"]),
        with_(["securityContext", "seccompProfile"], {}),
        with_(["volumes", 0], {"name": "v", "nfs": {"server": "x", "path": "/"}}),
        with_(["containers", 0, "securityContext", "runAsUser"], 0),
    ]
    for bad in restricted_bad:
        assert pss.violations(bad, "baseline") == [] or bad["volumes"][0].get("hostPath")
        assert pss.violations(bad, "restricted"), bad


def test_ray_pods_get_no_kubernetes_token_but_the_autoscaler_does() -> None:
    """Ray pods run user code: no service-account token in any of them, the RayJob submitter
    included. Only the autoscaler container (gpu overlays) mounts one, a projected token of its own
    ServiceAccount at the in-cluster path its client reads."""
    for name, objs in all_stacks():
        for owner, pod in ray_pods(objs):
            assert pod.get("automountServiceAccountToken") is False, (name, owner)
            for c in dh.containers(pod):
                mounts = [m for m in c.get("volumeMounts", []) if m["mountPath"] == TOKEN_PATH]
                assert bool(mounts) == (c["name"] == "autoscaler"), (name, owner, c["name"])
        rc = the_one(objs, "RayCluster")
        if not rc["spec"].get("enableInTreeAutoscaling"):
            continue
        head = rc["spec"]["headGroupSpec"]["template"]["spec"]
        (mount,) = [
            m
            for m in rc["spec"]["autoscalerOptions"]["volumeMounts"]
            if m["mountPath"] == TOKEN_PATH
        ]
        assert mount["readOnly"] is True
        (vol,) = [v for v in head["volumes"] if v["name"] == mount["name"]]
        sources = {k for s in vol["projected"]["sources"] for k in s}
        assert sources == {"serviceAccountToken", "configMap", "downwardAPI"}
        files = {
            *(
                s["serviceAccountToken"]["path"]
                for s in vol["projected"]["sources"]
                if "serviceAccountToken" in s
            ),
            *(
                i["path"]
                for s in vol["projected"]["sources"]
                if "configMap" in s
                for i in s["configMap"]["items"]
            ),
        }
        assert {"token", "ca.crt"} <= files  # what Ray's KubeRay client reads


def _ray_and_other_pods(objs: Objs) -> list[npol.Pod]:
    cp, workers, head = npol.cluster(objs)
    pods = [cp, head, *workers]
    job_head = (
        rayjob_template(objs)
        if any(
            o["kind"] == "ConfigMap" and o["metadata"]["name"] == "ringtrain-rayjob-template"
            for o in objs
        )
        else None
    )
    if job_head:
        cluster = job_head["spec"]["rayClusterSpec"]
        kuberay = {"ray.io/cluster": "ringtrain-j1-0"}
        head_labels = cluster["headGroupSpec"]["template"]["metadata"]["labels"]
        pods.append(npol.Pod("RayJob head", {**head_labels, **kuberay, "ray.io/node-type": "head"}))
        worker_labels = cluster["workerGroupSpecs"][0]["template"]["metadata"]["labels"]
        pods.append(
            npol.Pod("RayJob worker", {**worker_labels, **kuberay, "ray.io/node-type": "worker"})
        )
        sub = job_head["spec"]["submitterPodTemplate"]["metadata"]["labels"]
        pods.append(npol.Pod("RayJob submitter", {**sub, "job-name": "ringtrain-j1-0"}))
    for o in objs:
        if (
            o["kind"] in ("Deployment", "StatefulSet", "Job")
            and o["metadata"]["name"] != "ringtrain-api"
        ):
            (ref,) = dh.pod_templates(o)
            pods.append(npol.Pod(ref.owner, ref.labels))
    return pods


def test_no_pod_reaches_the_cloud_metadata_service() -> None:
    for name, objs in all_stacks():
        pols = by_kind(objs, "NetworkPolicy")
        pods = _ray_and_other_pods(objs)
        cp, _, head = npol.cluster(objs)
        proxy = name == "gpu+gke"  # the stack with components/db-proxy-cloud-sql
        for src in pods:
            for ip in METADATA:
                for port in (80, 988, 443):
                    ok = npol.connects(pols, src, npol.outside("metadata", ip), port)
                    opened = {("169.254.169.254", 80), ("169.254.169.252", 988)}
                    allowed_here = proxy and src.name == cp.name and (ip, port) in opened
                    assert ok == allowed_here, (name, src.name, ip, port)
            # the rest of the world, the cluster's DNS and the other pods stay reachable
            assert npol.allowed_egress(pols, src, npol.outside("registry", "142.250.1.1"), 443)
            assert npol.allowed_egress(pols, src, npol.outside("v6 host", "2001:db8::1"), 443)
            assert npol.allowed_egress(pols, src, KUBE_DNS, 53, "UDP")
            assert npol.allowed_egress(
                pols, src, npol.outside("node-local DNS", "169.254.20.10"), 53, "UDP"
            )
            for dst in pods:
                assert npol.allowed_egress(pols, src, dst, 6379), (name, src.name, dst.name)
        assert npol.connects(pols, cp, head, 8265) and npol.connects(pols, head, cp, 8000)


def test_rayjob_submitter_runs_with_the_namespace_security_context() -> None:
    """KubeRay's default submitter pod has no securityContext; the template's has the one every
    pod has, KubeRay's default requests (Kueue counts them), and the head's image."""
    objs = rendered("kueue")
    job = rayjob_template(objs)
    submitter = job["spec"]["submitterPodTemplate"]["spec"]
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    for key in ("runAsNonRoot", "runAsUser", "runAsGroup", "seccompProfile"):
        assert submitter["securityContext"][key] == head["securityContext"][key], key
    assert submitter["restartPolicy"] == "Never", "a Job's pod"
    (c,) = submitter["containers"]
    assert c["name"] == "ray-job-submitter" and "command" not in c, "KubeRay sets the command"
    assert c["image"] == container(head, "ray-head")["image"]
    assert c["resources"] == {
        "requests": {"cpu": "500m", "memory": "200Mi"},
        "limits": {"cpu": "1", "memory": "1Gi"},
    }
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"]["drop"] == ["ALL"]
    # the head's Jobs API still takes it
    pols = by_kind(objs, "NetworkPolicy")
    labels = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    job_head = npol.Pod(
        "head", {**labels, "ray.io/cluster": "ringtrain-j1-0", "ray.io/node-type": "head"}
    )
    sub = npol.Pod(
        "submitter", {**job["spec"]["submitterPodTemplate"]["metadata"]["labels"], "job-name": "j"}
    )
    assert npol.connects(pols, sub, job_head, 8265)


def _redis_config(text: str) -> dict[str, list[str]]:
    """A redis.conf's directives, arguments unquoted as Redis' config parser does
    (sdssplitargs: "..." with \\\\, \\", \\n, \\t, \\xHH escapes; '...' with \\' only)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        args, i = [], 0
        while i < len(line):
            if line[i] == " ":
                i += 1
                continue
            if line[i] == '"':
                i, buf = i + 1, ""
                while line[i] != '"':
                    if line[i] == "\\":
                        i += 1
                        esc = {"n": "\n", "r": "\r", "t": "\t", "b": "\b", "a": "\a"}
                        if line[i] == "x":
                            buf += chr(int(line[i + 1 : i + 3], 16))
                            i += 2
                        else:
                            buf += esc.get(line[i], line[i])
                    else:
                        buf += line[i]
                    i += 1
                args.append(buf)
                i += 1
                assert i >= len(line) or line[i] == " ", "a closing quote must end the argument"
            else:
                j = line.find(" ", i)
                j = len(line) if j < 0 else j
                args.append(line[i:j])
                i = j
        out[args[0]] = args[1:]
    return out


@pytest.mark.parametrize(
    "password", ["0123abcdef", 'with "quotes" and \\ back\\slashes', "spaces $(not run) `either` ;"]
)
def test_redis_password_goes_from_the_secret_file_to_the_config_not_the_command_line(
    password: str, tmp_path: Path
) -> None:
    objs = rendered("gpu")
    pod = the_one(objs, "Deployment", "ringtrain-redis")["spec"]["template"]["spec"]
    everything = yaml.safe_dump(pod)
    assert "REDIS_PASSWORD" not in everything and "--requirepass" not in everything
    for c in dh.containers(pod):
        assert "envFrom" not in c and not any(
            "secretKeyRef" in e.get("valueFrom", {}) for e in c.get("env", [])
        )
    (init,) = pod["initContainers"]
    (redis,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    secret_dir = mounts[next(n for n in mounts if "secret" in vols[n])]
    config_dir = mounts[next(n for n in mounts if "emptyDir" in vols[n])]
    assert vols[next(n for n in mounts if "emptyDir" in vols[n])]["emptyDir"]["medium"] == "Memory"
    assert redis["args"] == [f"{config_dir}/redis.conf"]
    # the init step, run here with its two directories stood in for
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "password").write_text(password)
    (tmp_path / "config").mkdir()
    script = (
        init["args"][0]
        .replace(secret_dir, str(tmp_path / "secret"))
        .replace(config_dir, str(tmp_path / "config"))
    )
    out = subprocess.run(init["command"] + [script], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    conf = tmp_path / "config" / "redis.conf"
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    parsed = _redis_config(conf.read_text())
    assert parsed["requirepass"] == [password]
    assert parsed["appendonly"] == ["yes"] and parsed["dir"] == ["/data"]


def test_ray_pods_write_only_to_their_scratch_volumes() -> None:
    """A read-only root filesystem in every Ray container, the autoscaler's and the RayJob
    submitter's included, with emptyDirs where Ray and the libraries write. The RayJob worker is
    the one exception, stated in its template (its pod must keep /dev/shm as its only emptyDir)."""
    scratch = {"/tmp", "/tmp/ray", "/home/ray/.cache"}
    exceptions = set()
    for name, objs in all_stacks():
        for owner, pod in ray_pods(objs):
            empty = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
            for c in dh.containers(pod):
                if not (c.get("securityContext") or {}).get("readOnlyRootFilesystem"):
                    exceptions.add((owner, c["name"]))
                    continue
                mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
                wants = {
                    "ray-head": scratch,
                    "ray-worker": scratch,
                    "autoscaler": {"/tmp", "/tmp/ray"},
                    "ray-job-submitter": {"/tmp"},
                }.get(c["name"], set())  # init containers (memlock-check) write nothing
                for path in wants:
                    assert mounts.get(path) in empty, (name, owner, c["name"], path)
    assert exceptions == {("RayJob/ringtrain-JOBID-0 worker group gpu", "ray-worker")}, exceptions
    text = (dh.OVERLAYS / "kueue" / "rayjob-template.yaml").read_text()
    assert "worker keeps a writable one" in text


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_schema_upgrade_gets_the_database_url_not_the_whole_secret(overlay: str) -> None:
    pod = the_one(rendered(overlay), "Deployment", "ringtrain-api")["spec"]["template"]["spec"]
    upgrade = container(pod, "db-upgrade")
    assert not [e for e in upgrade.get("envFrom", []) if "secretRef" in e]
    refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in upgrade.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert refs == {
        "RINGTRAIN_DATABASE_URL": {"name": "ringtrain-secrets", "key": "RINGTRAIN_DATABASE_URL"}
    }
    api = container(pod, "api")
    assert {"secretRef": {"name": "ringtrain-secrets"}} in api["envFrom"], "the app needs both keys"
