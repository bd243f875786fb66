"""Deploying on a real GPU cluster, checked offline: scale-from-zero settings that match the manifest, drivers that
never land on the head, a head that survives (GCS in Redis), storage class, /dev/shm sizing, Kueue mode (Kueue CRDs)
and fast links (NCCL over RDMA, a bandwidth job whose script runs here with gloo).

Rendering needs `kubectl` (skipped without it), like tests/deploy/test_deploy.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import kubernetes_validate
import pytest
import yaml

from api.app import default_launcher
from service.capacity import shapes_from_raycluster
from service.kuberay_jobs import pod_shape
from service.settings import Settings
from tests.deploy import test_network_policy as npol
from tests.deploy.test_deploy import K8S_VERSION, OVERLAY_IDS, OVERLAYS, by_kind, rendered, the_one
from tests.support import deploy_helpers as dh

NCCL_JOB = dh.K8S / "jobs" / "nccl-bandwidth"  # the TCP baseline; the variants patch it
NCCL_RDMA_JOB = dh.K8S / "jobs" / "nccl-bandwidth-rdma"
NCCL_EFA_JOB = dh.K8S / "jobs" / "nccl-bandwidth-efa"
KUBERAY_FLOOR = "1.6"  # authOptions.secretName first appears in KubeRay v1.6.0


def config(objs: tuple[dict[str, Any], ...]) -> dict[str, str]:
    return the_one(objs, "ConfigMap", "ringtrain-config")["data"]


def settings_of(objs: tuple[dict[str, Any], ...]) -> Settings:
    """The control plane's settings as the overlay's ConfigMap gives them: the same env vars, parsed by Settings."""
    env = {k: v for k, v in config(objs).items() if k.startswith("RINGTRAIN_")}
    with mock.patch.dict(os.environ, env):
        return Settings()


def custom_resources(group: dict[str, Any]) -> dict[str, float]:
    """Custom Ray resources a head or worker group advertises (`rayStartParams.resources`, the JSON object KubeRay
    passes to `ray start --resources`, quoted as KubeRay's docs show; or the group's `resources` map)."""
    out: dict[str, float] = {}
    raw = (group.get("rayStartParams") or {}).get("resources")
    if raw:
        raw = raw.strip()
        if raw.startswith('"') and raw.endswith('"'):
            raw = raw[1:-1].replace('\\"', '"')
        out.update({k: float(v) for k, v in json.loads(raw).items()})
    out.update(
        {
            k: float(v)
            for k, v in (group.get("resources") or {}).items()
            if k not in ("CPU", "GPU", "memory")
        }
    )
    return out


def quantity_bytes(q: str | int) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(q))
    assert m, q
    return (
        int(m.group(1))
        * {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}[m.group(2)]
    )


# --- scale from zero -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_autoscaler_setting_matches_the_worker_groups(overlay: str) -> None:
    objs = rendered(overlay)
    rc = the_one(objs, "RayCluster")
    s = settings_of(objs)
    if not rc["spec"].get("enableInTreeAutoscaling"):
        assert s.autoscaler_nodes == [], "a static cluster's capacity is what Ray reports"
        return
    # every group that can hold ranks is counted with its maxReplicas × per-pod resources; the drivers' group not
    assert s.autoscaler_nodes == shapes_from_raycluster(rc)
    gpu = [n for n in s.autoscaler_nodes if n.gpus]
    assert gpu and all(n.max_nodes >= 1 for n in gpu)
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    for n in gpu:
        assert groups[n.group]["minReplicas"] == 0, "the gpu group scales from zero"
    # the placement timeout leaves GPU pods time to come up from zero
    assert s.placement_timeout_s >= 1200


# --- drivers never on the head, a head that survives -----------------------------------------------------------------


@pytest.mark.parametrize(
    "overlay", sorted(set(OVERLAYS) - {"dev-cpu"}), ids=lambda o: f"overlay-{o}"
)
def test_drivers_never_target_the_head(overlay: str) -> None:
    objs = rendered(overlay)
    rc = the_one(objs, "RayCluster")
    wanted = settings_of(objs).driver_resources
    assert wanted, (
        f"{overlay}: RINGTRAIN_DRIVER_RESOURCES is not set, so drivers would run on the head"
    )
    head = rc["spec"]["headGroupSpec"]
    assert not set(wanted) & set(custom_resources(head)), (
        "the head advertises the drivers' resource"
    )
    hosts = [g for g in rc["spec"]["workerGroupSpecs"] if set(wanted) <= set(custom_resources(g))]
    assert hosts, (
        "no worker group advertises the drivers' resource: every driver would stay PENDING"
    )
    for g in hosts:
        assert g["rayStartParams"].get("num-cpus") == "0", (
            "a drivers' group must hold no rank (no CPU resource)"
        )
        assert "nvidia.com/gpu" not in g["template"]["spec"]["containers"][0]["resources"].get(
            "limits", {}
        )
        assert g["minReplicas"] >= 1, (
            "keep one drivers' pod warm: a driver should not wait for a node"
        )
        per_pod = min(custom_resources(g)[k] / v for k, v in wanted.items())
        assert per_pod * g["maxReplicas"] >= 16, "room for at least 16 concurrent drivers"
    # and the launcher the control plane builds from these settings asks Ray for them on every driver (Kueue mode:
    # each job has its own cluster, test_kueue_mode_control_plane_runs_rayjobs_from_the_mounted_template)
    shared = {"ray_address": "http://ringtrain-head-svc:8265", "kuberay_rayjob_template": ""}
    launcher = default_launcher(settings_of(objs).model_copy(update=shared))
    assert getattr(launcher, "entrypoint_resources", None) == wanted


@pytest.mark.parametrize(
    "overlay", sorted(set(OVERLAYS) - {"dev-cpu"}), ids=lambda o: f"overlay-{o}"
)
def test_head_fault_tolerance_uses_redis_with_a_secret_password(overlay: str) -> None:
    objs = rendered(overlay)
    rc = the_one(objs, "RayCluster")
    ft = rc["spec"]["gcsFaultToleranceOptions"]
    host, _, port = ft["redisAddress"].partition(":")
    svc = the_one(objs, "Service", host)
    assert int(port) in {p["port"] for p in svc["spec"]["ports"]}
    ref = ft["redisPassword"]["valueFrom"]["secretKeyRef"]
    assert "value" not in ft["redisPassword"], "the password must come from a Secret"
    # Redis reads the same Secret key, as a file its config is written from (test_deploy_day3.py
    # runs that step), never on its command line
    pod = the_one(objs, "Deployment", "ringtrain-redis")["spec"]["template"]["spec"]
    (secret,) = [v["secret"] for v in pod["volumes"] if "secret" in v]
    assert secret["secretName"] == ref["name"]
    assert [i["key"] for i in secret["items"]] == [ref["key"]]
    (redis,) = pod["containers"]
    assert redis["args"] == ["/etc/redis/redis.conf"] and "env" not in redis
    (config,) = pod["initContainers"]
    assert "appendonly yes" in config["args"][0] and "requirepass" in config["args"][0]
    # who reaches Redis: the head (the GCS) and KubeRay's clean-up pod (the head's template,
    # relabelled)
    pols = by_kind(objs, "NetworkPolicy")
    (redis_pod,) = [p for p in dh.pod_templates(the_one(objs, "Deployment", "ringtrain-redis"))]
    dst = npol.Pod("redis", redis_pod.labels)
    _, workers, head = npol.cluster(objs)
    cleanup = npol.Pod("redis cleanup", {**head.labels, "ray.io/node-type": "redis-cleanup"})
    assert npol.allowed(pols, head, dst, 6379) and npol.allowed(pols, cleanup, dst, 6379)
    for src in [*workers, npol.STRANGER]:
        assert not npol.allowed(pols, src, dst, 6379), src.name


def test_kuberay_floor_stated_and_fields_exist_in_the_crds() -> None:
    readme = (dh.DEPLOY / "README.md").read_text()
    assert f"KubeRay ≥ {KUBERAY_FLOOR}" in readme and "1.5.1" not in readme
    assert (
        f"--version {KUBERAY_FLOOR}" not in readme
    )  # the install line names the validated release, 1.7.0
    crd = yaml.safe_load((dh.crd_dir() / dh.CRD_FILES["RayCluster"]).read_text())
    spec = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"][
        "openAPIV3Schema"
    ]
    props = spec["properties"]["spec"]["properties"]
    assert "secretName" in props["authOptions"]["properties"]
    assert {"redisAddress", "redisPassword"} <= set(props["gcsFaultToleranceOptions"]["properties"])
    # the preflight command in the README reads exactly that field
    assert "authOptions.properties.secretName" in readme


# --- storage, shared memory, Secrets -------------------------------------------------------------------------------


def test_base_storage_class_placeholder_is_refused_by_the_api_server() -> None:
    pvc = next(
        d
        for d in dh.load_yaml_docs((dh.K8S / "base" / "checkpoints-pvc.yaml").read_text())
        if d["kind"] == "PersistentVolumeClaim"
    )
    placeholder = pvc["spec"]["storageClassName"]
    dns1123 = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
    assert not re.fullmatch(dns1123, placeholder), (
        "the placeholder must be an invalid class name (loud failure)"
    )
    assert re.fullmatch(dns1123, "standard-rwx")


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_every_overlay_sets_the_checkpoint_storage_class(overlay: str) -> None:
    pvc = the_one(rendered(overlay), "PersistentVolumeClaim", "ringtrain-checkpoints")["spec"]
    cls = pvc.get("storageClassName")
    assert cls != "REPLACE-ME-in-your-overlay", (
        f"{overlay} does not patch the checkpoint storage class"
    )
    if "ReadWriteMany" in pvc["accessModes"]:
        assert cls, (
            "ReadWriteMany needs an explicit class: the clouds' default classes are ReadWriteOnce"
        )
    else:
        assert overlay.startswith("dev"), (
            "only a one-node dev cluster may share a ReadWriteOnce volume"
        )


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_shm_and_object_store_are_sized_together(overlay: str) -> None:
    rc = the_one(rendered(overlay), "RayCluster")
    for g in rc["spec"]["workerGroupSpecs"]:
        pod = g["template"]["spec"]
        shm = next(v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory")
        shm_bytes = quantity_bytes(shm["emptyDir"]["sizeLimit"])
        store = int(g["rayStartParams"].get("object-store-memory", 0))
        assert store > 0, (
            f"{g['groupName']}: object-store-memory unset: Ray takes 30% of the pod's memory"
        )
        headroom = shm_bytes - store
        assert headroom >= min(16 << 30, shm_bytes // 2), (
            f"{g['groupName']}: /dev/shm leaves NCCL/gloo too little"
        )
        mem = quantity_bytes(pod["containers"][0]["resources"]["limits"]["memory"])
        assert shm_bytes <= mem // 2, f"{g['groupName']}: /dev/shm counts against the memory limit"


@pytest.mark.parametrize(
    "overlay", sorted(set(OVERLAYS) - {"dev-cpu"}), ids=lambda o: f"overlay-{o}"
)
def test_no_secret_is_rendered_outside_dev_and_each_is_documented(overlay: str) -> None:
    assert not by_kind(rendered(overlay), "Secret"), (
        "apply -k would overwrite the Secrets created out of band"
    )
    readme = (dh.DEPLOY / "README.md").read_text()
    for name in ("ringtrain-secrets", "ringtrain-ray-auth", "ringtrain-redis"):
        assert f"create secret generic {name}" in readme, name
    assert not (dh.K8S / "base" / "secrets.yaml").exists()


# --- Kueue mode ----------------------------------------------------------------------------------------------------


def rayjob_template(objs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    cm = the_one(objs, "ConfigMap", "ringtrain-rayjob-template")
    (doc,) = dh.load_yaml_docs(cm["data"]["rayjob-template.yaml"])
    return doc


def test_kueue_mode_objects_refer_to_each_other() -> None:
    objs = rendered("kueue")
    job = rayjob_template(objs)
    assert dh.crd_errors(job) == [], dh.crd_errors(job)
    labels = job["metadata"]["labels"]
    lq = the_one(objs, "LocalQueue", labels["kueue.x-k8s.io/queue-name"])
    cq = the_one(objs, "ClusterQueue", lq["spec"]["clusterQueue"])
    the_one(objs, "WorkloadPriorityClass", labels["kueue.x-k8s.io/priority-class"])
    prios = {o["metadata"]["name"]: o["value"] for o in by_kind(objs, "WorkloadPriorityClass")}
    assert prios["ringtrain-high"] > prios["ringtrain-normal"] > prios["ringtrain-low"]
    assert job["spec"]["shutdownAfterJobFinishes"] is True and job["spec"]["suspend"] is True
    assert job["spec"]["entrypoint"] == "python -m workers.driver"
    # the ephemeral cluster fits the queue: its GPU flavour, and quota for at least one job of the template
    (group,) = [
        g for g in cq["spec"]["resourceGroups"] if "nvidia.com/gpu" in g["coveredResources"]
    ]
    flavor = the_one(objs, "ResourceFlavor", group["flavors"][0]["name"])
    quota = {r["name"]: r["nominalQuota"] for r in group["flavors"][0]["resources"]}
    workers = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    per_pod = int(
        workers[0]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    )
    assert int(quota["nvidia.com/gpu"]) % per_pod == 0 and int(quota["nvidia.com/gpu"]) >= per_pod
    assert not job["spec"]["rayClusterSpec"].get("enableInTreeAutoscaling"), (
        "Kueue admits a fixed-size cluster"
    )
    # topology-aware: the ring's pods inside one network block, a level of the flavour's Topology
    topo = the_one(objs, "Topology", flavor["spec"]["topologyName"])
    level = workers[0]["template"]["metadata"]["annotations"][
        "kueue.x-k8s.io/podset-required-topology"
    ]
    assert level in [lv["nodeLabel"] for lv in topo["spec"]["levels"]]
    assert (
        cq["spec"]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] == "ringtrain"
    )


def test_kueue_mode_control_plane_runs_rayjobs_from_the_mounted_template(tmp_path: Path) -> None:
    """The overlay mounts the template where RINGTRAIN_KUBERAY_RAYJOB_TEMPLATE points, and the settings it gives
    build the KubeRay launcher from that template, with the ClusterQueue's quota as the queue's capacity."""
    objs = rendered("kueue")
    settings = settings_of(objs)
    pod = the_one(objs, "Deployment", "ringtrain-api")["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    (vol,) = [
        v
        for v in pod["volumes"]
        if v.get("configMap", {}).get("name") == "ringtrain-rayjob-template"
    ]
    assert settings.kuberay_rayjob_template == f"{mounts[vol['name']]}/rayjob-template.yaml"
    local = tmp_path / "rayjob-template.yaml"  # the file the pod would see
    local.write_text(
        the_one(objs, "ConfigMap", "ringtrain-rayjob-template")["data"]["rayjob-template.yaml"]
    )
    update = {
        "kuberay_rayjob_template": str(local),
        "kubernetes_api": "https://kube.invalid",
        "kuberay_namespace": "x",
    }
    launcher = default_launcher(settings.model_copy(update=update))
    assert type(launcher).__name__ == "KubeRayJobLauncher"
    assert launcher.template == rayjob_template(objs)  # type: ignore[attr-defined]
    # capacity: the ClusterQueue's GPU quota, in pods of the template's worker shape
    cq = the_one(objs, "ClusterQueue")
    (group,) = [
        g for g in cq["spec"]["resourceGroups"] if "nvidia.com/gpu" in g["coveredResources"]
    ]
    quota = {r["name"]: r["nominalQuota"] for r in group["flavors"][0]["resources"]}
    (shape,) = settings.autoscaler_nodes
    assert shape.gpus * shape.max_nodes == int(quota["nvidia.com/gpu"])
    assert (shape.cpus, shape.gpus) == pod_shape(rayjob_template(objs))


def test_kueue_mode_rbac_lets_the_control_plane_run_rayjobs() -> None:
    objs = rendered("kueue")
    dep = the_one(objs, "Deployment", "ringtrain-api")
    sa = dep["spec"]["template"]["spec"]["serviceAccountName"]
    assert dep["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
    assert the_one(objs, "ServiceAccount", sa)["automountServiceAccountToken"] is True
    binding = the_one(objs, "RoleBinding", "ringtrain-rayjobs")
    assert {"kind": "ServiceAccount", "name": sa, "namespace": "ringtrain"} in binding["subjects"]
    role = the_one(objs, binding["roleRef"]["kind"], binding["roleRef"]["name"])
    verbs = {v for r in role["rules"] if "rayjobs" in r["resources"] for v in r["verbs"]}
    assert {"create", "get", "delete"} <= verbs
    assert all("*" not in r["verbs"] and "*" not in r["resources"] for r in role["rules"])


def test_kueue_validator_rejects_typos() -> None:
    cq = the_one(rendered("kueue"), "ClusterQueue")
    assert dh.crd_errors(cq) == []
    bad = json.loads(json.dumps(cq))
    bad["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0]["nominalQuotaa"] = "1"
    assert any("nominalQuotaa" in e for e in dh.crd_errors(bad))
    missing = json.loads(json.dumps(cq))
    del missing["spec"]["resourceGroups"][0]["coveredResources"]
    assert any("coveredResources" in e for e in dh.crd_errors(missing))


def test_kueue_crds_vendored_in_repo() -> None:
    for f in dh.KUEUE_CRD_FILES.values():
        assert (dh.KUEUE_CRDS / f).is_file(), f
    shared = dh.ROOT.parent / "shared" / "kueue-crds"
    if shared.is_dir():
        for f in dh.KUEUE_CRD_FILES.values():
            assert (shared / f).read_bytes() == (dh.KUEUE_CRDS / f).read_bytes(), f


# --- fast links ----------------------------------------------------------------------------------------------------


def nccl_env(container: dict[str, Any]) -> dict[str, str]:
    return {
        e["name"]: e["value"]
        for e in container.get("env", [])
        if e["name"].startswith("NCCL_") and "value" in e
    }


def test_fast_links_overlay_uses_rdma_and_one_network_block() -> None:
    rc = the_one(rendered("fast-links"), "RayCluster")
    (gpu,) = [g for g in rc["spec"]["workerGroupSpecs"] if g["groupName"] == "gpu"]
    pod = gpu["template"]["spec"]
    c = pod["containers"][0]
    env = nccl_env(c)
    assert {"NCCL_SOCKET_IFNAME", "NCCL_IB_HCA"} <= set(env)
    rdma = [k for k in c["resources"]["limits"] if k.startswith("rdma/")]
    assert rdma and all(c["resources"]["requests"][k] == c["resources"]["limits"][k] for k in rdma)
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert gpu["template"]["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"]
    # one network block preferred (tests/deploy/test_deploy_day2.py: never required for the whole cluster)
    (aff,) = pod["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert aff["podAffinityTerm"]["topologyKey"] == "network.topology.kubernetes.io/block"

    # the RDMA bandwidth job tests exactly these settings
    job = next(o for o in dh.render(str(NCCL_RDMA_JOB)) if o["kind"] == "Job")
    jc = job["spec"]["template"]["spec"]["containers"][0]
    assert {k: v for k, v in nccl_env(jc).items() if k != "NCCL_DEBUG"} == {
        k: v for k, v in env.items() if k != "NCCL_DEBUG"
    }
    assert set(rdma) <= set(jc["resources"]["limits"])


def test_nccl_bandwidth_job_renders_and_validates() -> None:
    dh.need_kubectl()
    for variant in (NCCL_RDMA_JOB, NCCL_EFA_JOB):
        for o in dh.render(str(variant)):
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
    objs = dh.render(str(NCCL_JOB))
    for o in objs:
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)
    job, svc = the_one(objs, "Job"), the_one(objs, "Service")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    assert spec["template"]["spec"]["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    args = " ".join(spec["template"]["spec"]["containers"][0]["args"])
    assert f"--master-addr {job['metadata']['name']}-0.{svc['metadata']['name']}" in args
    assert "--nnodes 2" in args
    script = the_one(objs, "ConfigMap", "nccl-bw-script")["data"]["allreduce_bw.py"]
    assert script == (NCCL_JOB / "allreduce_bw.py").read_text()


@pytest.mark.parametrize("world", [2, 3])
def test_nccl_bandwidth_script_runs_with_gloo(world: int, tmp_path: Path) -> None:
    """The script the job runs, on CPU with gloo (same code path but the device): figures per size, and the
    threshold turns into the exit code."""
    from tests.support.dist import free_port

    def run(min_gbps: float) -> subprocess.CompletedProcess[str]:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            str(NCCL_JOB / "allreduce_bw.py"), "--backend", "gloo", "--sizes-mb", "1,4", "--iters", "3",
            "--min-busbw-gbps", str(min_gbps),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path, check=False
        )

    ok = run(0.0)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    lines = [ln for ln in ok.stdout.splitlines() if ln.startswith("size")]
    assert len(lines) == 2, ok.stdout
    for ln, mb in zip(lines, (1, 4), strict=True):
        nums = dict(re.findall(r"(algbw|busbw)\s+([0-9.]+)", ln))
        algbw, busbw = float(nums["algbw"]), float(nums["busbw"])
        assert f"size {mb:6d} MiB" in ln and algbw > 0
        factor = 2 * (world - 1) / world
        rounding = 0.005 * (1 + factor)  # both figures are printed with 2 decimals
        assert math.isclose(busbw, algbw * factor, rel_tol=0.02, abs_tol=rounding + 1e-9), ln
    assert f"world {world}  backend gloo" in ok.stdout and ok.stdout.rstrip().endswith("ok")
    slow = run(1e9)  # no link anywhere carries 1 EB/s
    assert slow.returncode != 0 and "FAIL: below" in slow.stdout
