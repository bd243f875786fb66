"""Deploy validation, offline: kustomize overlays render, every object validates (KubeRay CRD schemas with unknown
fields rejected; built-in kinds with kubernetes-validate --strict), names cross-reference, Dockerfiles are sound.

Rendering needs `kubectl` (it embeds kustomize; scripts/setup.sh installs it): without it those
tests skip (fail where RINGTRAIN_REQUIRE_KUBECTL=1, as in CI) and the file-level checks still run.
"""

from __future__ import annotations

import copy
import filecmp
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml

from tests.support import deploy_helpers as dh

K8S_VERSION = (
    "1.35.0"  # a current release that kubernetes-validate ships schemas for (checked below)
)
RAY_GROUP = "ray.io/"
OVERLAYS = dh.overlay_names()
# Not the bare overlay name: conftest skips tests carrying a `gpu` keyword, and a parameter id `gpu` would be one.
OVERLAY_IDS = [f"overlay-{ov}" for ov in OVERLAYS]
DOCKERFILES = {"cpu": dh.DOCKER / "Dockerfile.cpu", "cuda": dh.DOCKER / "Dockerfile.cuda"}
# Overlays whose Ray pods run the CUDA image and carry a GPU worker group.
GPU_OVERLAYS = {"gpu", "kueue", "fast-links"}
# Secrets that only the dev overlay renders; every other overlay expects them created out of band (deploy/README.md
# shows the `kubectl create secret` of each, with these keys).
OUT_OF_BAND_SECRETS = {
    "ringtrain-secrets": {"RINGTRAIN_API_TOKENS", "RINGTRAIN_DATABASE_URL"},
    "ringtrain-ray-auth": {"auth_token"},
    "ringtrain-redis": {"password"},
}
# Pods that run as root: the GKE storage component's one-shot Job that hands the Filestore share to the pods' uid
# (Filestore ignores fsGroup; components/storage-gke, the storage the tests render the gpu overlays with).
ROOT_PODS = {"Job/ringtrain-checkpoints-owner"}
THIRD_PARTY_IMAGES = re.compile(
    r"^(postgres|redis):\d+\.\d+"
)  # the dev database; the gpu overlay's GCS Redis


def rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    dh.need_kubectl()
    return dh.render_overlay(overlay)


def by_kind(objs, kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def the_one(objs, kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in by_kind(objs, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def all_pods(objs) -> list[dh.PodRef]:
    return [p for o in objs for p in dh.pod_templates(o)]


def dockerfile_images() -> dict[str, str]:
    out = {}
    for flavour, path in DOCKERFILES.items():
        ref = dh.declared_image(path.read_text())
        assert ref, f"{path} has no '# image: REF' header"
        out[flavour] = ref
    return out


def base_resources() -> list[dict[str, Any]]:
    """The base's plain YAML resources, read without kustomize (so some checks run where kubectl is absent)."""
    kust = yaml.safe_load((dh.K8S / "base" / "kustomization.yaml").read_text())
    docs = []
    for res in kust["resources"]:
        docs += dh.load_yaml_docs((dh.K8S / "base" / res).read_text())
    return docs


# --- rendering and schema validation -------------------------------------------------------------------------------


def test_overlays_exist():
    assert {"dev-cpu", "gpu"} <= set(OVERLAYS), OVERLAYS


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_overlay_renders(overlay):
    objs = rendered(overlay)
    kinds = {o["kind"] for o in objs}
    assert {"RayCluster", "Deployment", "Service", "ConfigMap", "PersistentVolumeClaim"} <= kinds, (
        kinds
    )
    assert ("Secret" in kinds) == overlay.startswith("dev"), "only the dev overlay carries Secrets"
    names = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names)), f"duplicate objects: {names}"
    for o in objs:
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == "ringtrain", (
                f"{o['kind']}/{o['metadata']['name']}"
            )


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_kuberay_objects_match_crd_schema(overlay):
    objs = [o for o in rendered(overlay) if dh.is_custom(o)]
    assert by_kind(objs, "RayCluster") or by_kind(objs, "ClusterQueue"), (
        "no RayCluster (or Kueue queue) rendered"
    )
    for o in objs:
        errors = dh.crd_errors(o)
        assert not errors, f"{o['kind']}/{o['metadata']['name']} ({overlay}):\n" + "\n".join(errors)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_builtin_kinds_validate_strict(overlay):
    for o in rendered(overlay):
        if dh.is_custom(o):
            continue
        try:
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"{o['kind']}/{o['metadata']['name']} ({overlay}): {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            pytest.fail(e.message)


def test_kubernetes_validate_is_offline_and_strict():
    """The pinned version is shipped, and --strict really rejects an unknown field (no network involved)."""
    assert K8S_VERSION.rsplit(".", 1)[0] in {
        v.rsplit(".", 1)[0] for v in kubernetes_validate.utils.all_versions()
    }
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {"a": "b"}}
    kubernetes_validate.validate(cm, K8S_VERSION, strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({**cm, "dta": {"a": "b"}}, K8S_VERSION, strict=True)


def test_base_files_validate_without_kustomize():
    """The base's files are plain manifests: valid on their own, even where kubectl is absent."""
    for o in base_resources():
        if o["apiVersion"].startswith(RAY_GROUP):
            assert not dh.crd_errors(o), dh.crd_errors(o)
        else:
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)


def _base_raycluster() -> dict[str, Any]:
    return copy.deepcopy(the_one(base_resources(), "RayCluster"))


def test_crd_validator_rejects_typos_and_non_string_params():
    good = _base_raycluster()
    assert dh.crd_errors(good) == []

    typo = _base_raycluster()
    typo["spec"]["workerGroupSpecs"][0]["minReplica"] = typo["spec"]["workerGroupSpecs"][0].pop(
        "minReplicas"
    )
    assert any("minReplica" in e for e in dh.crd_errors(typo))

    typo2 = _base_raycluster()
    typo2["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = (
        "Always"
    )
    assert any("imagePullPolicyy" in e for e in dh.crd_errors(typo2))

    number = _base_raycluster()
    number["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    errors = dh.crd_errors(number)
    assert any("rayStartParams" in e and "string" in e for e in errors), errors

    boolean = _base_raycluster()
    boolean["spec"]["workerGroupSpecs"][0]["rayStartParams"]["block"] = True
    assert any("rayStartParams" in e for e in dh.crd_errors(boolean))

    missing = _base_raycluster()
    del missing["spec"]["workerGroupSpecs"][0]["groupName"]
    assert any("groupName" in e for e in dh.crd_errors(missing))


def test_crd_validator_keeps_open_maps_open_and_nulls_dropped():
    ok = _base_raycluster()
    ok["spec"]["headGroupSpec"]["template"]["metadata"]["annotations"] = {
        "anything/goes": "x"
    }  # free-form map
    ok["spec"]["headGroupSpec"]["serviceType"] = None  # nulls are dropped, as the API server does
    assert dh.crd_errors(ok) == []


def test_rayjob_schema_loads_and_validates():
    job = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": "j"},
        "spec": {
            "entrypoint": "python -m workers.driver",
            "rayClusterSpec": _base_raycluster()["spec"],
        },
    }
    assert dh.crd_errors(job) == []
    job["spec"]["entrypointt"] = "x"
    assert dh.crd_errors(job)


def test_crds_vendored_in_repo():
    for name in [*dh.CRD_FILES.values(), "SOURCE.txt"]:
        assert (dh.IN_REPO_CRDS / name).is_file(), f"missing {dh.IN_REPO_CRDS / name}"
    shared = dh.ROOT.parent / "shared" / "kuberay-crds"
    if shared.is_dir():
        for name in dh.CRD_FILES.values():
            assert filecmp.cmp(shared / name, dh.IN_REPO_CRDS / name, shallow=False), (
                f"{name} differs from {shared}"
            )


# --- cross-references ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_services_select_pods_and_ports(overlay):
    objs = rendered(overlay)
    pods = all_pods(objs)
    for svc in by_kind(objs, "Service"):
        sel = svc["spec"].get("selector") or {}
        assert sel, f"Service/{svc['metadata']['name']} has no selector"
        matches = [p for p in pods if sel.items() <= p.labels.items()]
        assert matches, f"Service/{svc['metadata']['name']} selects no pod template: {sel}"
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for p in matches:
                ports = [cp for c in p.spec["containers"] for cp in c.get("ports", [])]
                assert any(target in (cp.get("name"), cp["containerPort"]) for cp in ports), (
                    f"Service/{svc['metadata']['name']} targetPort {target} not exposed by {p.owner}"
                )
    for o in by_kind(objs, "Deployment") + by_kind(objs, "StatefulSet"):
        sel = o["spec"]["selector"]["matchLabels"]
        assert sel.items() <= o["spec"]["template"]["metadata"]["labels"].items(), (
            f"{o['kind']}/{o['metadata']}"
        )


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_configmap_points_at_ray_head_and_control_plane(overlay):
    objs = rendered(overlay)
    cm = the_one(objs, "ConfigMap", "ringtrain-config")["data"]
    rc = the_one(objs, "RayCluster")

    ray = urlparse(cm["RINGTRAIN_RAY_ADDRESS"])
    assert (
        ray.scheme == "http"
        and ray.hostname == f"{rc['metadata']['name']}-head-svc"
        and ray.port == 8265
    ), ray
    head_ports = {
        p["containerPort"]
        for p in rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    }
    assert {6379, 8265, 10001} <= head_ports

    public = urlparse(cm["RINGTRAIN_PUBLIC_URL"])
    svc = the_one(objs, "Service", public.hostname)
    assert public.port in {p["port"] for p in svc["spec"]["ports"]}
    dep = the_one(objs, "Deployment", "ringtrain-api")
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    api = dep["spec"]["template"]["spec"]["containers"][0]
    assert int(cm["RINGTRAIN_PORT"]) in {p["containerPort"] for p in api["ports"]}

    # the checkpoint dir is where the shared volume is mounted, in every pod that mounts it
    ckpt = cm["RINGTRAIN_CHECKPOINT_DIR"]
    pvc = the_one(objs, "PersistentVolumeClaim", "ringtrain-checkpoints")["metadata"]["name"]
    mounting = 0
    for p in all_pods(objs):
        vols = {
            v["name"]
            for v in p.spec.get("volumes", [])
            if v.get("persistentVolumeClaim", {}).get("claimName") == pvc
        }
        for c in p.spec["containers"]:
            paths = [m["mountPath"] for m in c.get("volumeMounts", []) if m["name"] in vols]
            if paths:
                mounting += 1
                assert paths == [ckpt], f"{p.owner} mounts {pvc} at {paths}, not {ckpt}"
    assert mounting >= 3, (
        "checkpoints must be mounted in the control plane, the head and the workers"
    )


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_referenced_names_exist(overlay):
    objs = rendered(overlay)
    names = {k: {o["metadata"]["name"] for o in by_kind(objs, k)} for k in ("Secret", "ConfigMap")}
    secret_keys = {
        o["metadata"]["name"]: {*o.get("data", {}), *o.get("stringData", {})}
        for o in by_kind(objs, "Secret")
    }
    if not overlay.startswith("dev"):
        secret_keys = {**OUT_OF_BAND_SECRETS, **secret_keys}
        names["Secret"] |= set(OUT_OF_BAND_SECRETS)
    pvcs = {o["metadata"]["name"] for o in by_kind(objs, "PersistentVolumeClaim")}
    for p in all_pods(objs):
        vols = {v["name"]: v for v in p.spec.get("volumes", [])}
        for v in vols.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in pvcs, f"{p.owner}: {v}"
            if "secret" in v:
                assert v["secret"]["secretName"] in names["Secret"], f"{p.owner}: {v}"
            if "configMap" in v:
                assert v["configMap"]["name"] in names["ConfigMap"], f"{p.owner}: {v}"
        for c in dh.containers(p.spec):
            for m in c.get("volumeMounts", []):
                assert m["name"] in vols or m["name"] in p.claim_templates, (
                    f"{p.owner}: mount {m['name']}"
                )
            for ef in c.get("envFrom", []):
                for key, kind in (("secretRef", "Secret"), ("configMapRef", "ConfigMap")):
                    if key in ef:
                        assert ef[key]["name"] in names[kind], f"{p.owner}: {ef}"
            for e in c.get("env", []):
                for key, kind in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap")):
                    ref = e.get("valueFrom", {}).get(key)
                    if ref:
                        assert ref["name"] in names[kind], f"{p.owner}: env {e['name']}"
                        if kind == "Secret":
                            keys = secret_keys[ref["name"]]
                        else:
                            obj = the_one(objs, kind, ref["name"])
                            keys = {**obj.get("data", {}), **obj.get("stringData", {})}
                        assert ref["key"] in keys, (
                            f"{p.owner}: {kind}/{ref['name']} has no key {ref['key']}"
                        )
        sa = p.spec.get("serviceAccountName")
        if sa:
            assert sa in {o["metadata"]["name"] for o in by_kind(objs, "ServiceAccount")}, (
                f"{p.owner}: {sa}"
            )
    for rc in by_kind(objs, "RayCluster"):
        secret = rc["spec"].get("authOptions", {}).get("secretName")
        if secret:
            assert "auth_token" in secret_keys[secret]
        redis = (
            (rc["spec"].get("gcsFaultToleranceOptions") or {})
            .get("redisPassword", {})
            .get("valueFrom", {})
        )
        if "secretKeyRef" in redis:
            assert redis["secretKeyRef"]["key"] in secret_keys[redis["secretKeyRef"]["name"]]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_images_match_dockerfiles(overlay):
    objs = rendered(overlay)
    ours = dockerfile_images()
    rc = the_one(objs, "RayCluster")
    for p in all_pods(objs):
        for c in dh.containers(p.spec):
            img = c["image"]
            assert ":" in img.rsplit("/", 1)[-1] and not img.endswith(":latest"), (
                f"{p.owner}: unpinned {img}"
            )
            assert img in ours.values() or THIRD_PARTY_IMAGES.match(img), (
                f"{p.owner}: {img} is no Dockerfile's tag"
            )
    ray_images = {c["image"] for p in dh.pod_templates(rc) for c in p.spec["containers"]}
    assert len(ray_images) == 1, f"head and workers must run one image: {ray_images}"
    want = ours["cuda"] if overlay in GPU_OVERLAYS else ours["cpu"]
    assert ray_images == {want}
    api = the_one(objs, "Deployment", "ringtrain-api")["spec"]["template"]["spec"]["containers"][0]
    assert api["image"] == ours["cpu"]
    # rayVersion names the Ray release the images are built on
    ray_version = {
        dh.arg_defaults(dh.parse_dockerfile(f.read_text()))["RAY_VERSION"]
        for f in DOCKERFILES.values()
    }
    assert ray_version == {rc["spec"]["rayVersion"]}


def test_every_dockerfile_image_is_deployed():
    dh.need_kubectl()
    used = {
        c["image"] for ov in OVERLAYS for p in all_pods(rendered(ov)) for c in dh.containers(p.spec)
    }
    for flavour, ref in dockerfile_images().items():
        assert ref in used, f"{flavour} image {ref} is used by no overlay"


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_ray_cluster_shape(overlay):
    objs = rendered(overlay)
    rc = the_one(objs, "RayCluster")
    head = rc["spec"]["headGroupSpec"]["rayStartParams"]
    assert head.get("num-cpus") == "0" and head.get("dashboard-host") == "0.0.0.0"
    groups = rc["spec"]["workerGroupSpecs"]
    assert groups
    for g in groups:
        assert all(isinstance(v, str) for v in g.get("rayStartParams", {}).values())
        assert g["minReplicas"] <= g.get("replicas", g["minReplicas"]) <= g["maxReplicas"], g[
            "groupName"
        ]
        pod = g["template"]["spec"]
        shm = [v for v in pod.get("volumes", []) if v.get("emptyDir", {}).get("medium") == "Memory"]
        mounts = {
            m["name"]: m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", [])
        }
        assert any(mounts.get(v["name"]) == "/dev/shm" for v in shm), (
            f"{g['groupName']}: no memory-backed /dev/shm"
        )
    gpu_groups = [
        g
        for g in groups
        if "nvidia.com/gpu" in g["template"]["spec"]["containers"][0]["resources"]["limits"]
    ]
    if overlay not in GPU_OVERLAYS:
        assert not gpu_groups
        return
    assert gpu_groups, "the gpu overlay has no GPU worker group"
    assert rc["spec"].get("enableInTreeAutoscaling") is True
    for g in gpu_groups:
        pod = g["template"]["spec"]
        res = pod["containers"][0]["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"]
        gpus = str(res["limits"]["nvidia.com/gpu"])
        assert g["rayStartParams"].get("num-gpus", gpus) == gpus, (
            "num-gpus must equal the nvidia.com/gpu limit"
        )
        assert any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", [])), (
            "no GPU toleration"
        )
        anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            0
        ]
        assert anti["topologyKey"] == "kubernetes.io/hostname"
        assert (
            anti["labelSelector"]["matchLabels"].items()
            <= g["template"]["metadata"]["labels"].items()
        )


@pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)
def test_control_plane_hardening_and_probes(overlay):
    objs = rendered(overlay)
    dep = the_one(objs, "Deployment", "ringtrain-api")
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    tmp = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    assert any(m["mountPath"] == "/tmp" and m["name"] in tmp for m in c["volumeMounts"])
    assert {"requests", "limits"} <= c["resources"].keys()
    envs = {e["name"] for e in c.get("env", [])}
    secret_keys = {
        k
        for s in by_kind(objs, "Secret")
        if s["metadata"]["name"] == "ringtrain-secrets"
        for k in s["stringData"]
    } or (OUT_OF_BAND_SECRETS["ringtrain-secrets"] if not overlay.startswith("dev") else set())
    assert {"RINGTRAIN_API_TOKENS", "RINGTRAIN_DATABASE_URL"} <= secret_keys
    assert {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} <= envs
    for p in all_pods(objs):
        for ctr in dh.containers(p.spec):
            assert ctr.get("securityContext", {}).get("allowPrivilegeEscalation") is False, p.owner
        if p.owner in ROOT_PODS:  # the one documented exception (test_deploy_day3.py checks it)
            continue
        assert p.spec["securityContext"]["runAsNonRoot"] is True, p.owner
        assert p.spec["securityContext"].get("runAsUser", 1) != 0, p.owner


def test_dev_credentials_stay_in_the_dev_overlay():
    dh.need_kubectl()
    for ov in OVERLAYS:
        if ov.startswith("dev"):
            continue
        text = yaml.safe_dump_all(list(rendered(ov)))
        assert "dev-token" not in text and "ringtrain-dev" not in text, (
            f"{ov} carries dev credentials"
        )
        assert not by_kind(rendered(ov), "StatefulSet"), (
            f"{ov} should use a managed database, not the dev one"
        )


# --- Dockerfiles ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_dockerfile_sound(flavour):
    path = DOCKERFILES[flavour]
    text = path.read_text()
    instrs = dh.parse_dockerfile(text)
    args = dh.arg_defaults(instrs)
    froms = [i for i in instrs if i.cmd == "FROM"]
    assert len(froms) >= 2, "multi-stage: a build stage and a runtime stage"
    stages = set()
    for f in froms:
        ref = dh.substitute(f.args.split()[0], args)
        assert "$" not in ref, f"{path.name}:{f.line}: FROM {ref} uses an ARG without a default"
        if ref == "scratch":  # an empty stage: files copied in, or a named build context's place
            stages.add(f.args.split()[-1])
            continue
        name, _, tag = ref.rpartition(":")
        assert name and tag and tag != "latest", f"{path.name}:{f.line}: FROM {ref} is not pinned"
        assert re.fullmatch(r"rayproject/ray", name), (
            f"{path.name}: base must be a Ray image, got {ref}"
        )
        assert re.fullmatch(
            r"2\.60\.\d+-py311-" + (r"cu\d{3}" if flavour == "cuda" else "cpu"), tag
        ), ref
        if " AS " in f.args.upper():
            stages.add(f.args.split()[-1])
    for i in instrs:
        if i.cmd in ("COPY", "ADD"):
            assert dh.copy_sources_exist(i) == [], dh.copy_sources_exist(i)
            flags, _ = dh.split_flags(i.args)
            if "from" in flags:
                assert flags["from"] in stages, (
                    f"{path.name}:{i.line}: unknown stage {flags['from']}"
                )
        if i.cmd == "RUN":
            for m in re.finditer(r"from=([\w-]+)", i.args):
                assert m.group(1) in stages, f"{path.name}:{i.line}: unknown stage {m.group(1)}"
    final_start = max(n for n, i in enumerate(instrs) if i.cmd == "FROM")
    users = [i.args.split(":")[0] for i in instrs[final_start:] if i.cmd == "USER"]
    assert users and users[-1] not in ("root", "0"), (
        f"{path.name}: the runtime stage must end as a non-root USER"
    )
    assert "TORCH_VERSION=2.13.0" in text
    assert "pip install ." not in text and ("pip wheel" in text)
    if flavour == "cuda":
        assert "flash-attn" in text and "flash_attn" in text
        # the CUDA of the base tag is pinned (not the moving -gpu alias) and torch's wheels are built for it
        assert args["CUDA_TAG"] in dh.substitute(args["TORCH_INDEX_URL"], args)
    else:
        assert "download.pytorch.org/whl/cpu" in text


def test_dockerfile_tags_documented():
    readme = (dh.DEPLOY / "README.md").read_text()
    for path in DOCKERFILES.values():
        ref = dh.declared_image(path.read_text())
        build = f"docker build -f deploy/docker/{path.name} -t {ref} ."
        assert build in path.read_text(), f"{path.name} does not show its own build command"
        assert build in readme, f"deploy/README.md lacks: {build}"


def test_dockerignore_keeps_context_small():
    text = (dh.ROOT / ".dockerignore").read_text()
    assert "**" in [ln.strip() for ln in text.splitlines()], (
        ".dockerignore should exclude everything, then re-include"
    )
    assert set(dh.dockerignore_included()) >= {"pyproject.toml", "api", "service", "workers"}
    for secretish in (".venv", ".git", "ringtrain.db"):
        assert not any(Path(secretish).match(inc) for inc in dh.dockerignore_included())


def test_readme_covers_operations():
    readme = (dh.DEPLOY / "README.md").read_text()
    for needle in (
        "helm install",
        "--server-side",
        "kubectl apply -k deploy/k8s/overlays/dev-cpu",
        "kubectl apply -k deploy/k8s/overlays/gpu",
        "port-forward",
        "RINGTRAIN_URL",
        "ringtrain submit",
        "maxReplicas",
        "/mnt/checkpoints",
        "NVLink",
    ):
        assert needle in readme, f"deploy/README.md does not mention {needle!r}"
    for ov in re.findall(r"deploy/k8s/overlays/([\w-]+)", readme):
        assert ov in OVERLAYS, f"README names overlay {ov}, which does not exist"
