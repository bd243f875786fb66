"""Day-2 operations, checked offline on the rendered manifests: a control plane of two replicas
that survives rollouts and drains, upgrades without a mixed-version cluster, the Kueue template
following image changes, quota for the last job, disruption budgets, per-ring network locality,
the RDMA memlock limit, bandwidth jobs for clusters without RDMA, CPU pods off GPU nodes,
monitors, storage per provider, and the guide agreeing with the manifests.

Rendering needs `kubectl` (skipped without it), like tests/deploy/test_deploy.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from unittest import mock

import kubernetes_validate
import pytest
import yaml

from service.kuberay_jobs import _bytes, _quantity, rayjob_for
from service.launcher import LaunchRequest
from service.settings import Settings
from tests.deploy import test_network_policy as npol
from tests.deploy.test_deploy import K8S_VERSION, OVERLAY_IDS, OVERLAYS, by_kind, rendered, the_one
from tests.support import deploy_helpers as dh
from tests.support.api_harness import TINY_SPEC
from workers.config import JobSpec

Objs = tuple[dict[str, Any], ...]
README = dh.DEPLOY / "README.md"
# What KubeRay's default submitter pod requests (GetDefaultSubmitterTemplate); Kueue counts it.
SUBMITTER = {"cpu": 0.5, "memory": 200 << 20}
DO_NOT_DISRUPT = {
    "karpenter.sh/do-not-disrupt": "true",
    "cluster-autoscaler.kubernetes.io/safe-to-evict": "false",
}
NODE_AFFINITY = "requiredDuringSchedulingIgnoredDuringExecution"
PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"
TOPOLOGY = "kueue.x-k8s.io/podset-required-topology"


def needs_kubectl() -> None:
    dh.need_kubectl()


def kustomize(path: Path) -> subprocess.CompletedProcess[str]:
    exe = dh.kubectl()
    assert exe
    cmd = [exe, "kustomize", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def set_image(kustomization: Path, name: str, ref: str) -> None:
    """What `kustomize edit set image NAME=REF` does to a kustomization.yaml (no kustomize
    binary here): one `images:` entry for NAME, replaced or added."""
    kust = yaml.safe_load(kustomization.read_text())
    new_name, _, new_tag = ref.rpartition(":")
    images = [i for i in kust.get("images", []) if i["name"] != name]
    kust["images"] = [*images, {"name": name, "newName": new_name, "newTag": new_tag}]
    kustomization.write_text(yaml.safe_dump(kust, sort_keys=False))


def rayjob_template(objs: Objs) -> dict[str, Any]:
    cm = the_one(objs, "ConfigMap", "ringtrain-rayjob-template")
    (doc,) = dh.load_yaml_docs(cm["data"]["rayjob-template.yaml"])
    return doc


def node_affinity_admits(spec: dict[str, Any], node_labels: dict[str, str]) -> bool:
    """A pod's required node affinity against a node's labels (terms ORed, expressions ANDed)."""
    req = (spec.get("affinity", {}).get("nodeAffinity") or {}).get(NODE_AFFINITY)
    if not req:
        return True
    terms = [{"matchExpressions": t.get("matchExpressions", [])} for t in req["nodeSelectorTerms"]]
    return any(npol.selects(t, node_labels) for t in terms)


# --- A: the control plane as replicas ------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_control_plane_keeps_a_replica_through_rollouts_and_drains(overlay: str) -> None:
    objs = rendered(overlay)
    dep = the_one(objs, "Deployment", "ringtrain-api")
    spec = dep["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["replicas"] >= 2, "one replica is a single point of failure"
    rolling = spec["strategy"]["rollingUpdate"]
    assert spec["strategy"]["type"] == "RollingUpdate"
    assert rolling["maxUnavailable"] == 0, "a rollout must never leave zero replicas"
    assert rolling["maxSurge"] >= 1, "with maxUnavailable 0 a rollout needs a surge"
    pdbs = by_kind(objs, "PodDisruptionBudget")
    (pdb,) = [b for b in pdbs if npol.selects(b["spec"]["selector"], labels)]
    assert 1 <= pdb["spec"]["minAvailable"] < spec["replicas"], "evict one replica, never the last"
    pod = spec["template"]["spec"]
    spread = [
        a["podAffinityTerm"]
        for a in pod["affinity"]["podAntiAffinity"][PREFERRED]
        if a["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    ]
    assert spread and npol.selects(spread[0]["labelSelector"], labels), "spread over nodes"
    api = pod["containers"][0]
    assert api["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # the migration is its own step, before the app, with the same image and database settings
    # (the database URL from the Secret, not the whole Secret: test_deploy_day3.py)
    (mig,) = pod["initContainers"]
    assert mig["command"] == ["ringtrain", "db", "upgrade"]
    config_refs = [e for e in api["envFrom"] if "configMapRef" in e]
    assert mig["image"] == api["image"] and mig["envFrom"] == config_refs
    mig_env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in mig["env"]}
    assert mig_env["RINGTRAIN_DATABASE_URL"] == {
        "name": "ringtrain-secrets",
        "key": "RINGTRAIN_DATABASE_URL",
    }
    assert api["command"] == ["ringtrain", "serve"]
    assert mig["securityContext"]["readOnlyRootFilesystem"] is True
    # ... and not again inside app start-up: `serve` is told to only check the schema
    env = {e["name"]: e.get("value") for e in api.get("env", [])}
    assert "RINGTRAIN_MIGRATE_ON_START" in env, "serve would migrate at start as well"
    with mock.patch.dict(
        os.environ, {"RINGTRAIN_MIGRATE_ON_START": env["RINGTRAIN_MIGRATE_ON_START"]}
    ):
        assert Settings().migrate_on_start is False


def test_readme_explains_replicas_and_upgrades() -> None:
    text = README.read_text()
    assert "Recreate` rollouts" not in text and "One replica" not in text
    needles = ("ringtrain db upgrade", "maxUnavailable: 0", "## 12. Upgrading", "LEADER_LEASE_S")
    for needle in needles:
        assert needle in text, needle


# --- B1: the Kueue template follows image changes ------------------------------------------------


@pytest.mark.parametrize("where", ["gpu", "kueue"])
def test_kueue_template_runs_the_image_set_with_kustomize(where: str, tmp_path: Path) -> None:
    """`kustomize edit set image` in the gpu overlay (or the kueue one) reaches the RayJob
    template: its head and workers run the RayCluster's image, with the RayCluster's rayVersion."""
    needs_kubectl()
    tree = tmp_path / "k8s"
    shutil.copytree(dh.tree_with_storage(dh.TEST_STORAGE), tree)
    ref = "registry.example.com/team/ringtrain:9.9.9-cuda"
    name = "ringtrain-cuda" if where == "gpu" else "ghcr.io/ringtrain/ringtrain"
    set_image(tree / "overlays" / where / "kustomization.yaml", name, ref)
    rc_file = tree / "base" / "raycluster.yaml"
    rc_text = rc_file.read_text().replace('rayVersion: "2.60.0"', 'rayVersion: "2.61.0"')
    rc_file.write_text(rc_text)
    out = kustomize(tree / "overlays" / "kueue")
    assert out.returncode == 0, out.stderr
    objs = tuple(dh.load_yaml_docs(out.stdout))
    rc = the_one(objs, "RayCluster")
    assert rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] == ref
    job = rayjob_template(objs)
    cluster = job["spec"]["rayClusterSpec"]
    as_cluster = {"kind": "RayCluster", "metadata": {"name": "t"}, "spec": cluster}
    images = {c["image"] for p in dh.pod_templates(as_cluster) for c in p.spec["containers"]}
    assert images == {ref}, images
    assert cluster["rayVersion"] == rc["spec"]["rayVersion"] == "2.61.0"
    assert dh.crd_errors(job) == []


# What each quoted piece of the RayJob template is (its index in the text split on single quotes),
# as the kueue overlay's replacements fill them in: the key before it and where its value comes from.
TEMPLATE_PIECES = {
    1: ("rayVersion:", "rayVersion"),
    3: ("image:", "image"),
    5: ("num-cpus:", "cpu"),
    7: ("object-store-memory:", "objectStoreMemory"),
    9: ("kueue.x-k8s.io/podset-required-topology:", "topology"),
    11: ("image:", "image"),
    13: ("cpu:", "cpu"),
    15: ("memory:", "memory"),
    17: ("nvidia.com/gpu:", "gpus"),
    19: ("cpu:", "cpu"),
    21: ("memory:", "memory"),
    23: ("nvidia.com/gpu:", "gpus"),
    25: ("sizeLimit:", "shmSize"),
    27: ("image:", "image"),
}


def template_pieces(text: str) -> dict[str, set[str]]:
    """The quoted values of the template text, by what they are (TEMPLATE_PIECES)."""
    pieces = text.split("'")
    assert len(pieces) == 2 * len(TEMPLATE_PIECES) + 1, "single quotes are reserved"
    out: dict[str, set[str]] = {}
    for i, (key, what) in TEMPLATE_PIECES.items():
        assert pieces[i - 1].rstrip().endswith(key), (i, key, pieces[i - 1][-60:])
        out.setdefault(what, set()).add(pieces[i])
    return out


def test_kueue_template_reserves_single_quotes_for_what_kustomize_fills_in() -> None:
    """The replacements split the template's text on single quotes: each odd piece must be the
    value its replacement targets (kueue/kustomization.yaml); a stray quote (an apostrophe in a
    comment) would shift them all."""
    text = (dh.OVERLAYS / "kueue" / "rayjob-template.yaml").read_text()
    values = template_pieces(text)
    assert all(len(v) == 1 for v in values.values()), values  # one value per thing, however often
    assert re.fullmatch(r"\d+\.\d+\.\d+", *values["rayVersion"])
    kust = yaml.safe_load((dh.OVERLAYS / "kueue" / "kustomization.yaml").read_text())
    indices = {
        t["options"]["index"]
        for r in kust["replacements"]
        for t in r["targets"]
        if t["select"]["name"] == "ringtrain-rayjob-template"
    }
    assert indices == set(TEMPLATE_PIECES), "every quoted piece is filled in, and nothing else"


# --- B2: upgrades without a mixed-version cluster ------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_raycluster_is_replaced_whole_on_upgrade(overlay: str) -> None:
    rc = the_one(rendered(overlay), "RayCluster")
    why = "KubeRay >= 1.6 recreates pods only with Recreate"
    assert rc["spec"]["upgradeStrategy"] == {"type": "Recreate"}, why
    crd = yaml.safe_load((dh.crd_dir() / dh.CRD_FILES["RayCluster"]).read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    props = v1["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert "Recreate" in props["upgradeStrategy"]["properties"]["type"]["enum"]
    text = README.read_text()
    assert "upgradeStrategy" in text and "Drain, then upgrade" in text


# --- B3: Kueue quota for the last job; small rings sized by their GPUs ---------------------------


def _requests(pod: dict[str, Any]) -> dict[str, float]:
    res = pod["containers"][0]["resources"]["requests"]
    return {
        "cpu": _quantity(res["cpu"]),
        "memory": _bytes(res["memory"]),
        "gpu": _quantity(res.get("nvidia.com/gpu", 0)),
    }


def _job_request(job: dict[str, Any]) -> dict[str, float]:
    """What Kueue counts for one RayJob: head + workers + the submitter pod (the template's, else
    KubeRay's default)."""
    cluster = job["spec"]["rayClusterSpec"]
    submitter = job["spec"].get("submitterPodTemplate")
    if submitter:
        total = {**_requests(submitter["spec"])}
    else:
        total = {"cpu": SUBMITTER["cpu"], "memory": float(SUBMITTER["memory"]), "gpu": 0.0}
    for k, v in _requests(cluster["headGroupSpec"]["template"]["spec"]).items():
        total[k] += v
    for g in cluster["workerGroupSpecs"]:
        for k, v in _requests(g["template"]["spec"]).items():
            total[k] += v * g["replicas"]
    return total


def _gpu_request(world: int) -> LaunchRequest:
    spec: dict[str, Any] = {**TINY_SPEC, "resources": {"accelerator": "gpu"}}
    spec["parallel"] = {"ring_size": 1, "data_parallel": world}
    spec["train"] = {"steps": 5, "batch_size": world}
    return LaunchRequest(
        job_id="j0123456789ab",
        spec=JobSpec.model_validate(spec),
        control_url="http://ringtrain-api:8000",
        ingest_token="t",
        checkpoint_dir="/mnt/checkpoints",
    )


def test_kueue_quota_admits_jobs_until_the_gpus_run_out() -> None:
    """For every job size, as many jobs as the GPU quota holds also fit the cpu and memory
    quota, counting each RayJob's head and submitter pod: GPUs run out first, never the last
    job's bookkeeping."""
    objs = rendered("kueue")
    cq = the_one(objs, "ClusterQueue")
    groups = cq["spec"]["resourceGroups"]
    (group,) = [g for g in groups if "nvidia.com/gpu" in g["coveredResources"]]
    quota = {r["name"]: r["nominalQuota"] for r in group["flavors"][0]["resources"]}
    limit = {
        "cpu": _quantity(quota["cpu"]),
        "memory": _bytes(quota["memory"]),
        "gpu": _quantity(quota["nvidia.com/gpu"]),
    }
    template = rayjob_template(objs)
    for world in range(1, int(limit["gpu"]) + 1):
        per_job = _job_request(rayjob_for(template, _gpu_request(world)))
        jobs = int(limit["gpu"] // per_job["gpu"])
        for k in ("cpu", "memory"):
            need = jobs * per_job[k]
            assert need <= limit[k], f"{jobs} jobs of {world} GPUs need {need:g} {k} > {limit[k]:g}"


def test_a_small_ring_books_its_share_of_a_node() -> None:
    template = rayjob_template(rendered("kueue"))
    job = rayjob_for(template, _gpu_request(2))
    assert dh.crd_errors(job) == []
    (g,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    pod = g["template"]["spec"]
    res = pod["containers"][0]["resources"]
    for kind in ("requests", "limits"):
        assert res[kind]["nvidia.com/gpu"] == "2" and res[kind]["cpu"] == "8"
        assert _bytes(res[kind]["memory"]) == 64 << 30
    params = g["rayStartParams"]
    assert params["num-cpus"] == "8" and int(params["object-store-memory"]) == 8 << 30
    (shm,) = [v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    assert _bytes(shm["emptyDir"]["sizeLimit"]) == 12 << 30
    # a full pod stays as the template says
    (full,) = rayjob_for(template, _gpu_request(16))["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert full["replicas"] == 2
    assert full["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] == "32"


# --- B4: network blocks per ring -----------------------------------------------------------------


def test_fast_links_never_pins_the_whole_cluster_to_one_block() -> None:
    """A required pod affinity selecting every GPU pod keeps the whole shared cluster in the first
    pod's block; the shared cluster cannot tell one ring's pods from another's, so it prefers."""
    rc = the_one(rendered("fast-links"), "RayCluster")
    for g in rc["spec"]["workerGroupSpecs"]:
        aff = g["template"]["spec"].get("affinity", {}).get("podAffinity", {})
        assert NODE_AFFINITY not in aff, g["groupName"]
    (gpu,) = [g for g in rc["spec"]["workerGroupSpecs"] if g["groupName"] == "gpu"]
    (pref,) = gpu["template"]["spec"]["affinity"]["podAffinity"][PREFERRED]
    assert pref["podAffinityTerm"]["topologyKey"] == "network.topology.kubernetes.io/block"
    # per ring (one RayJob each) in Kueue mode: topology-aware scheduling per RayJob
    job = rayjob_template(rendered("kueue"))
    (worker,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert TOPOLOGY in worker["template"]["metadata"]["annotations"]


# --- B5: memlock for RDMA ------------------------------------------------------------------------


def _memlock_check(objs: Objs, owner_part: str) -> dict[str, Any]:
    (pod,) = [p for o in objs for p in dh.pod_templates(o) if owner_part in p.owner]
    checks = [c for c in pod.spec.get("initContainers", []) if c["name"] == "memlock-check"]
    assert len(checks) == 1, f"{pod.owner}: no memlock-check init container"
    check = checks[0]
    main = pod.spec["containers"][0]
    assert check["image"] == main["image"], "the check must see the same image's limits"
    for c in dh.containers(pod.spec):
        added = c["securityContext"]["capabilities"].get("add", [])
        assert "IPC_LOCK" not in added, "IPC_LOCK does nothing for uid 1000"
    return check


def _sh(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=False)


def test_rdma_pods_refuse_to_start_without_an_unlimited_memlock() -> None:
    needs_kubectl()
    checks = [_memlock_check(rendered("fast-links"), "worker group gpu")]
    for job in ("nccl-bandwidth-rdma", "nccl-bandwidth-efa"):
        checks.append(_memlock_check(dh.render(str(dh.K8S / "jobs" / job)), "Job/nccl-bw"))
    for check in checks:
        script = check["args"][0]
        low = _sh(f"ulimit -S -l 64; {script}")
        assert low.returncode == 1 and "LimitMEMLOCK=infinity" in low.stderr, low.stderr
        ok = _sh(f"ulimit -l unlimited 2>/dev/null || exit 77; {script}")
        if ok.returncode != 77:  # raising the hard limit needs root
            assert ok.returncode == 0 and "unlimited" in ok.stdout
    text = README.read_text()
    assert "LimitMEMLOCK=infinity" in text and "IPC_LOCK" in text


# --- B6: bandwidth without RDMA ------------------------------------------------------------------


def test_tcp_bandwidth_baseline_runs_without_rdma_devices() -> None:
    needs_kubectl()
    job = the_one(dh.render(str(dh.K8S / "jobs" / "nccl-bandwidth")), "Job")
    pod = job["spec"]["template"]
    assert "k8s.v1.cni.cncf.io/networks" not in pod["metadata"].get("annotations", {})
    c = pod["spec"]["containers"][0]
    limits = set(c["resources"]["limits"])
    assert limits == {"cpu", "memory", "nvidia.com/gpu"}, "plain EKS/GKE have no RDMA devices"
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["NCCL_IB_DISABLE"] == "1" and float(env["MIN_BUSBW_GBPS"]) <= 2
    efa_job = the_one(dh.render(str(dh.K8S / "jobs" / "nccl-bandwidth-efa")), "Job")
    efa = efa_job["spec"]["template"]["spec"]["containers"][0]
    assert "vpc.amazonaws.com/efa" in efa["resources"]["limits"]
    assert {e["name"]: e["value"] for e in efa["env"]}["FI_PROVIDER"] == "efa"
    text = README.read_text()
    for needle in ("nccl-bandwidth-rdma", "nccl-bandwidth-efa", "aws-ofi-nccl", "TCPXO"):
        assert needle in text, needle


# --- B7: voluntary disruption --------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_disruption_budgets_and_autoscaler_annotations(overlay: str) -> None:
    objs = rendered(overlay)
    cp, workers, head = npol.cluster(objs)
    pdbs = by_kind(objs, "PodDisruptionBudget")

    def budget(pod: npol.Pod) -> dict[str, Any]:
        found = [b for b in pdbs if npol.selects(b["spec"]["selector"], pod.labels)]
        assert len(found) == 1, f"{pod.name}: {len(found)} PodDisruptionBudgets select it"
        return dict(found[0]["spec"])

    assert budget(head)["maxUnavailable"] == 0
    assert budget(cp)["minAvailable"] >= 1
    drivers = [w for w in workers if w.labels.get("app.kubernetes.io/component") == "ray-driver"]
    for d in drivers:
        assert budget(d)["maxUnavailable"] == 0
    # the budgets select the shared cluster only, not a RayJob's head
    other = {**head.labels, "ray.io/cluster": "ringtrain-j1-0-abcde"}
    assert not [b for b in pdbs if npol.selects(b["spec"]["selector"], other)]
    rc = the_one(objs, "RayCluster")
    groups = rc["spec"]["workerGroupSpecs"]
    templates = [rc["spec"]["headGroupSpec"]["template"]]
    templates += [g["template"] for g in groups if g["groupName"] in ("gpu", "drivers")]
    if overlay == "kueue":
        cluster = rayjob_template(objs)["spec"]["rayClusterSpec"]
        templates.append(cluster["headGroupSpec"]["template"])
        templates += [g["template"] for g in cluster["workerGroupSpecs"]]
    for t in templates:
        annotations = t["metadata"].get("annotations", {})
        assert DO_NOT_DISRUPT.items() <= annotations.items(), t["metadata"]["labels"]


# --- B8: policies for RayJob clusters (Redis clean-up: test_deploy_cluster.py) --------------------


def test_rayjob_clusters_have_ingress_policies() -> None:
    objs = rendered("kueue")
    pols = by_kind(objs, "NetworkPolicy")
    cp, _, shared_head = npol.cluster(objs)
    cluster = rayjob_template(objs)["spec"]["rayClusterSpec"]
    head_t = cluster["headGroupSpec"]["template"]
    worker_t = cluster["workerGroupSpecs"][0]["template"]

    def ray_pod(tmpl: dict[str, Any], role: str, name: str = "ringtrain-j1-0-x7k2p") -> npol.Pod:
        extra = {"ray.io/cluster": name, "ray.io/node-type": role}
        return npol.Pod(f"{name} {role}", {**tmpl["metadata"]["labels"], **extra})

    def ok(src: npol.Pod, dst: npol.Pod, port: int) -> bool:
        return npol.allowed(pols, src, dst, port)

    head, worker = ray_pod(head_t, "head"), ray_pod(worker_t, "worker")
    other_worker = ray_pod(worker_t, "worker", "ringtrain-j2-0-abcde")
    job_labels = {"job-name": "ringtrain-j1-0", "batch.kubernetes.io/job-name": "ringtrain-j1-0"}
    submitter = npol.Pod("submitter", {**job_labels, "controller-uid": "u"})
    stranger = npol.STRANGER
    assert ok(submitter, head, 8265)
    assert not ok(stranger, head, 8265) and not ok(worker, head, 8265) and not ok(cp, head, 8265)
    assert not ok(shared_head, head, 6379)
    for port in (6379, 10001, 52365):
        assert ok(worker, head, port), port
        assert not ok(stranger, head, port) and not ok(submitter, head, port), port
    for port in (29500, 6379, 65535):
        assert ok(head, worker, port) and ok(other_worker, worker, port), port
        assert not ok(stranger, worker, port) and not ok(shared_head, worker, port), port
        assert not ok(cp, worker, port), port
    assert ok(npol.PROMETHEUS, worker, 8080) and not ok(npol.PROMETHEUS, worker, 29500)
    assert ok(head, cp, 8000), "the RayJob's head runs its driver, which reports to us"


# --- B9: RBAC (tests/unit/service/test_kuberay_jobs.py), CPU pods, monitors, storage --------------------------


GPU_NODES = [
    {"nvidia.com/gpu.present": "true"},
    {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
    {"ringtrain.io/pool": "gpu"},
]
CPU_NODE = {"kubernetes.io/hostname": "cpu-1", "kubernetes.io/os": "linux"}


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_cpu_pods_stay_off_gpu_nodes(overlay: str) -> None:
    """The control plane, the head, the drivers' pod and Redis: never on a GPU node."""
    objs = rendered(overlay)
    for pod in (p for o in objs for p in dh.pod_templates(o)):
        component = pod.labels.get("app.kubernetes.io/component")
        ranks = pod.role == "worker" and component != "ray-driver"
        if ranks or "postgres" in pod.owner:  # rank pods follow their group; dev's DB anywhere
            continue
        assert node_affinity_admits(pod.spec, CPU_NODE), pod.owner
        for node in GPU_NODES:
            assert not node_affinity_admits(pod.spec, node), f"{pod.owner} may land on {node}"


def test_monitors_scrape_the_control_plane_and_every_ray_pod() -> None:
    needs_kubectl()
    objs = dh.render(str(dh.K8S / "monitoring"))
    sm, pm = the_one(objs, "ServiceMonitor"), the_one(objs, "PodMonitor")
    assert all(o["apiVersion"] == "monitoring.coreos.com/v1" for o in objs)
    kueue = rendered("kueue")
    svc = the_one(kueue, "Service", "ringtrain-api")
    endpoint = sm["spec"]["endpoints"][0]
    assert npol.selects(sm["spec"]["selector"], svc["metadata"]["labels"])
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    _, workers, head = npol.cluster(kueue)
    job_head_t = rayjob_template(kueue)["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]
    job_head = {**job_head_t["metadata"]["labels"], "ray.io/cluster": "ringtrain-j1-0-x"}
    job_head["ray.io/node-type"] = "head"
    selector = pm["spec"]["selector"]
    for labels in [head.labels, *(w.labels for w in workers), job_head]:
        assert npol.selects(selector, labels), labels
    assert not npol.selects(selector, {**head.labels, "ray.io/node-type": "redis-cleanup"})
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"  # KubeRay's name for :8080
    assert "deploy/k8s/monitoring" in README.read_text()


def test_storage_class_is_chosen_per_provider_or_the_overlay_does_not_render() -> None:
    needs_kubectl()
    bare = kustomize(dh.OVERLAYS / "gpu")
    assert bare.returncode != 0 and "ringtrain-storage-class" in bare.stderr, bare.stderr
    text = README.read_text()
    assert "ringtrain-storage-class" in text
    seen = set()
    for comp in dh.STORAGE_COMPONENTS:
        objs = dh.render_overlay("gpu", comp)
        pvc = the_one(objs, "PersistentVolumeClaim", "ringtrain-checkpoints")["spec"]
        assert pvc["accessModes"] == ["ReadWriteMany"]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", pvc["storageClassName"]), pvc
        seen.add(pvc["storageClassName"])
        for o in objs:
            if not dh.is_custom(o):
                kubernetes_validate.validate(o, K8S_VERSION, strict=True)
        assert f"`{comp}`" in text, comp
    assert len(seen) == len(dh.STORAGE_COMPONENTS), "one class per provider"


# --- B10: the guide agrees with the manifests ----------------------------------------------------


def test_readme_shm_sizes_match_the_manifest() -> None:
    rc = the_one(rendered("gpu"), "RayCluster")
    (gpu,) = [g for g in rc["spec"]["workerGroupSpecs"] if g["groupName"] == "gpu"]
    (shm,) = [v for v in gpu["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    size = shm["emptyDir"]["sizeLimit"]
    text = README.read_text()
    claims = set(re.findall(r"sizeLimit: (\w+)", text))
    assert claims == {size}, f"README says /dev/shm is {claims}, the manifest {size}"
    store = int(gpu["rayStartParams"]["object-store-memory"]) >> 30
    assert f"`object-store-memory` ({store} GiB)" in text


def test_readme_flash_attn_wheel_is_a_url_and_kueue_wording() -> None:
    text = README.read_text()
    assert "URL or path" not in text and "FLASH_ATTN_WHEEL=<URL" in text
    dockerfile = (dh.DOCKER / "Dockerfile.cuda").read_text()
    assert "a path in the context" not in dockerfile
    kust = (dh.OVERLAYS / "kueue" / "kustomization.yaml").read_text()
    assert "stays for small" not in kust and "stays for small" not in text
