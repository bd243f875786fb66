"""`Launcher` for Kueue mode: every job attempt is a KubeRay `RayJob` on its own ephemeral
RayCluster.

The RayJob is the overlay's template (ConfigMap `ringtrain-rayjob-template`, mounted as a file) with
the job filled in: its name (the submission id), the Kueue priority class, the driver's environment
and the gpu group's size. It is created suspended; Kueue admits it when its ClusterQueue's quota
allows, KubeRay then starts the cluster and runs `python -m workers.driver`, which reports over HTTP
exactly as on the shared cluster. A one-off task (`run_task`: a dataset's prepare) is a RayJob
of its own too, from the same template (`rayjob_for_task`). The control plane only creates, reads
and deletes RayJobs (namespace-scoped RBAC in the overlay).

Why plain HTTP and not the `kubernetes` client: four REST calls on one resource, with the pod's
service-account token and CA; the client library would be the largest dependency of the control
plane for them.

The ingest token travels in the RayJob's `runtimeEnvYAML`, readable by whoever may read RayJobs in
the namespace. It only lets its holder report for that one job attempt (rotated per attempt, refused
once the job ended).
"""

from __future__ import annotations

import copy
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from service.launcher import ClusterInfo, DriverInfo, DriverStatus, LaunchRequest, TaskRequest
from service.ray_jobs import DRIVER_MODULE, driver_environment, submission_id_for

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
GPU = "nvidia.com/gpu"
# Kueue WorkloadPriorityClasses of the overlay (kueue.yaml), by the sign of the job's priority.
PRIORITY_CLASSES = {1: "ringtrain-high", 0: "ringtrain-normal", -1: "ringtrain-low"}
# KubeRay refuses longer RayJob names (its RayCluster and pod names are derived from them).
MAX_NAME = 47


class KubeAPIError(RuntimeError):
    """An answer from the Kubernetes API other than the ones a launcher call expects."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"Kubernetes API answered HTTP {status}: {body[:500]}")
        self.status = status


@dataclass(frozen=True)
class KubeAPI:
    """Where the Kubernetes API is and how to authenticate: in a pod, its service account
    (`in_cluster`). A `token_file` is read on every request: the kubelet rotates projected
    service-account tokens in place (hourly, valid for about an hour more), so a token read once
    at start stops working while the process runs on; `token` is used when there is no file or
    it cannot be read."""

    url: str
    token: str = ""
    ca_file: str | None = None
    token_file: str | None = None

    def bearer(self) -> str:
        if self.token_file:
            try:
                return Path(self.token_file).read_text().strip()
            except OSError:
                pass
        return self.token

    @classmethod
    def in_cluster(cls, url: str = "") -> KubeAPI:
        if not url:
            host, port = (
                os.environ.get("KUBERNETES_SERVICE_HOST"),
                os.environ.get("KUBERNETES_SERVICE_PORT", "443"),
            )
            if not host:
                raise RuntimeError(
                    "RINGTRAIN_KUBERAY_RAYJOB_TEMPLATE is set but this is not a Kubernetes pod "
                    "(KUBERNETES_SERVICE_HOST unset): "
                    "set RINGTRAIN_KUBERNETES_API to the API server's URL"
                )
            url = f"https://{host}:{port}" if ":" not in host else f"https://[{host}]:{port}"
        token = SERVICE_ACCOUNT / "token"
        ca = SERVICE_ACCOUNT / "ca.crt"
        return cls(
            url,
            ca_file=str(ca) if ca.is_file() else None,
            token_file=str(token) if token.is_file() else None,
        )

    def client(self) -> httpx.Client:
        token = self.bearer()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(
            base_url=self.url, headers=headers, verify=self.ca_file or True, timeout=15
        )


def service_account_namespace() -> str:
    path = SERVICE_ACCOUNT / "namespace"
    return path.read_text().strip() if path.is_file() else "default"


def priority_class(priority: int) -> str:
    return PRIORITY_CLASSES[(priority > 0) - (priority < 0)]


def _quantity(v: Any) -> float:
    """A CPU/GPU count from a Kubernetes quantity (`"32"`, `"500m"`, `8`)."""
    s = str(v)
    return float(s[:-1]) / 1000 if s.endswith("m") else float(s)


_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50}
_DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}


def _bytes(v: Any) -> int:
    """Bytes from a Kubernetes memory quantity (`"256Gi"`, `"500M"`, `34359738368`)."""
    m = re.fullmatch(r"([0-9.]+)([KMGTP]i|[kMGTP])?", str(v).strip())
    if not m:
        raise ValueError(f"not a memory quantity: {v!r}")
    unit = m.group(2) or ""
    return math.ceil(float(m.group(1)) * (_BINARY.get(unit) or _DECIMAL.get(unit) or 1))


def _shrink_pod(group: dict[str, Any], fraction: float, min_cpus: float) -> None:
    """Size a worker pod to `fraction` of the template's node (a ring using that share of its
    GPUs): CPUs (the container's and Ray's num-cpus, never below what the ring's bundles ask),
    memory, and the object store with the memory-backed /dev/shm it lives in. Otherwise a 2-GPU
    ring would still book (and Kueue count) a whole node's CPUs and memory."""
    pod = group["template"]["spec"]
    container = pod["containers"][0]
    params = group.setdefault("rayStartParams", {})
    cpus = None
    for kind in ("requests", "limits"):
        res = container.get("resources", {}).get(kind, {})
        if "cpu" in res:
            cpus = max(math.ceil(_quantity(res["cpu"]) * fraction), math.ceil(min_cpus))
            res["cpu"] = str(cpus)
        if "memory" in res:
            res["memory"] = f"{math.ceil(_bytes(res['memory']) * fraction / (1 << 20))}Mi"
    if "num-cpus" in params:
        ray_cpus = math.ceil(_quantity(params["num-cpus"]) * fraction)
        params["num-cpus"] = str(max(ray_cpus, math.ceil(min_cpus)))
    elif cpus is not None:
        params["num-cpus"] = str(cpus)
    if "object-store-memory" in params:
        store = math.ceil(int(params["object-store-memory"]) * fraction)
        params["object-store-memory"] = str(store)
    for vol in pod.get("volumes", []):
        empty = vol.get("emptyDir") or {}
        if empty.get("medium") == "Memory" and "sizeLimit" in empty:
            empty["sizeLimit"] = f"{math.ceil(_bytes(empty['sizeLimit']) * fraction / (1 << 20))}Mi"


def _worker_group(job: dict[str, Any]) -> dict[str, Any]:
    groups = job["spec"]["rayClusterSpec"].get("workerGroupSpecs") or []
    if len(groups) != 1:
        raise ValueError(
            f"the RayJob template needs exactly one worker group (the ring's), found {len(groups)}"
        )
    return dict(groups[0])


def pod_shape(job: dict[str, Any]) -> tuple[float, float]:
    """(CPUs, GPUs) one worker pod of the template gives Ray."""
    group = _worker_group(job)
    limits = group["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
    params = group.get("rayStartParams") or {}
    cpus = (
        _quantity(params["num-cpus"]) if "num-cpus" in params else _quantity(limits.get("cpu", 1))
    )
    return cpus, _quantity(limits.get(GPU, 0))


def _from_template(
    template: dict[str, Any],
    name: str,
    what: str,
    labels: dict[str, str],
    entrypoint: str,
    env: dict[str, str],
) -> dict[str, Any]:
    """A suspended RayJob named `name` from `template` (a deep copy), with its labels, entrypoint
    and runtime environment: what a job's RayJob and a task's share. `what` names the id the name
    came from, for the error."""
    name = name.lower()
    if len(name) > MAX_NAME or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name):
        raise ValueError(
            f"{what} gives RayJob name {name!r}, not a DNS label of <= {MAX_NAME} chars"
        )
    job = copy.deepcopy(template)
    meta = job.setdefault("metadata", {})
    meta["name"] = name
    meta.pop("namespace", None)
    meta.setdefault("labels", {}).update(labels)
    body = job["spec"]
    body["entrypoint"] = entrypoint
    body["runtimeEnvYAML"] = yaml.safe_dump({"env_vars": env}, sort_keys=True)
    body["suspend"] = True  # Kueue un-suspends it on admission
    return job


def rayjob_for(
    template: dict[str, Any], req: LaunchRequest, *, python: str = "python"
) -> dict[str, Any]:
    """The RayJob that runs one attempt of `req` (a new object; the template is not changed).

    The worker group is sized for the ring and nothing more: ⌈ranks ÷ GPUs per pod⌉ fixed
    replicas (Kueue admits a fixed size), and a ring smaller than one pod asks for just the GPUs it
    uses, with the same share of the pod's CPUs, memory and shared memory."""
    spec = req.spec
    job = _from_template(
        template,
        submission_id_for(req.job_id, req.attempt),
        f"job id {req.job_id!r}",
        {
            "kueue.x-k8s.io/priority-class": priority_class(spec.priority),
            "ringtrain.io/job-id": req.job_id,
            "ringtrain.io/attempt": str(req.attempt),
        },
        f"{python} -m {DRIVER_MODULE}",
        driver_environment(req),
    )
    body = job["spec"]

    cpus, gpus = pod_shape(job)
    ranks = spec.world_size
    uses_gpu = spec.resources.accelerator == "gpu" or (
        spec.resources.accelerator == "auto" and gpus >= 1
    )
    if uses_gpu and gpus < 1:
        raise ValueError("the job asks for GPUs but the RayJob template's worker pods have none")
    per_pod = gpus if uses_gpu else math.floor(cpus / spec.resources.cpus_per_worker)
    if per_pod < 1:
        raise ValueError(
            f"one rank needs {spec.resources.cpus_per_worker:g} CPUs; "
            f"the template's worker pods give {cpus:g}"
        )
    replicas = math.ceil(ranks / per_pod)
    group = body["rayClusterSpec"]["workerGroupSpecs"][0]
    group.update(replicas=replicas, minReplicas=replicas, maxReplicas=replicas)
    if uses_gpu and ranks < per_pod:
        resources = group["template"]["spec"]["containers"][0]["resources"]
        for kind in ("requests", "limits"):
            if GPU in resources.get(kind, {}):
                resources[kind][GPU] = str(ranks)
        _shrink_pod(group, ranks / per_pod, ranks * spec.resources.cpus_per_worker)
    return job


def rayjob_for_task(
    template: dict[str, Any], task: TaskRequest, *, python: str = "python"
) -> dict[str, Any]:
    """The RayJob that runs a one-off task (a dataset's prepare): the template with the task's
    entrypoint and environment, Kueue's normal priority, and one worker pod without GPUs (a task
    here is CPU work: tokenizing), sized to `task.cpus` when that is less than the template's pod,
    which gets the same share of its memory and shared memory. Admitted, run and torn down exactly
    like a job's RayJob."""
    job = _from_template(
        template,
        task.submission_id,
        f"task id {task.task_id!r}",
        {"kueue.x-k8s.io/priority-class": priority_class(0), "ringtrain.io/task-id": task.task_id},
        task.entrypoint(python),
        {**task.env, "PYTHONUNBUFFERED": "1"},
    )
    body = job["spec"]

    cpus, _ = pod_shape(job)
    group = body["rayClusterSpec"]["workerGroupSpecs"][0]
    group.update(replicas=1, minReplicas=1, maxReplicas=1)
    resources = group["template"]["spec"]["containers"][0].setdefault("resources", {})
    for kind in ("requests", "limits"):
        resources.get(kind, {}).pop(GPU, None)
    (group.get("rayStartParams") or {}).pop("num-gpus", None)
    if task.cpus is not None and task.cpus < cpus:
        _shrink_pod(group, task.cpus / cpus, task.cpus)
    return job


def status_of(rayjob: dict[str, Any]) -> DriverInfo:
    """KubeRay's view of a RayJob as a driver status (`jobDeploymentStatus` is KubeRay's,
    `jobStatus` Ray's).

    A RayJob suspended again after Kueue admitted it was preempted: KubeRay deletes its cluster (the
    driver dies without a final report), resets `jobStatus` and goes `Suspending` → `Suspended`;
    on re-admission it starts a new cluster and submits the same entrypoint and runtime env: the
    same attempt's driver, same ingest token. Why `metadata.generation` tells the two suspended
    kinds apart: the API server bumps it for spec changes only (not status, not metadata), the
    launcher creates the RayJob suspended and never changes its spec, and Kueue admits by
    un-suspending it. So a suspended RayJob at generation > 1 was admitted before; KubeRay's status
    alone reads the same either way (a never-admitted one also passes
    `Initializing` → `Suspending` → `Suspended`)."""
    st = rayjob.get("status") or {}
    deploy, ray_status = st.get("jobDeploymentStatus") or "", st.get("jobStatus") or ""
    why = ": ".join(x for x in (st.get("reason"), st.get("message")) if x)
    if deploy in ("Failed", "ValidationFailed"):
        return DriverInfo(DriverStatus.FAILED, why or f"RayJob {deploy}")
    if ray_status in ("SUCCEEDED", "FAILED", "STOPPED"):
        return DriverInfo(DriverStatus(ray_status), why)
    suspended = bool((rayjob.get("spec") or {}).get("suspend"))
    if suspended and int((rayjob.get("metadata") or {}).get("generation") or 1) > 1:
        return DriverInfo(
            DriverStatus.PREEMPTED,
            "preempted by Kueue (its RayJob was suspended again after admission, "
            "usually for a higher-priority job)",
        )
    if deploy == "Running" and ray_status == "RUNNING":
        return DriverInfo(DriverStatus.RUNNING, why)
    if suspended or deploy in ("Suspended", "Suspending"):
        return DriverInfo(
            DriverStatus.PENDING, "waiting for Kueue to admit the RayJob (ClusterQueue quota)"
        )
    return DriverInfo(
        DriverStatus.PENDING, why or f"RayJob {deploy or 'created'}; its Ray cluster is starting"
    )


class KubeRayJobLauncher:
    submitted = (
        "RayJob {sid} created: it waits for Kueue to admit it (ClusterQueue quota), "
        "then KubeRay starts its cluster"
    )

    def __init__(
        self, api: KubeAPI, namespace: str, template: dict[str, Any], *, python: str = "python"
    ) -> None:
        if template.get("kind") != "RayJob":
            raise ValueError(f"the RayJob template is a {template.get('kind')!r}, not a RayJob")
        pod_shape(
            template
        )  # fails now, not on the first job, when the template has no usable worker group
        self.api, self.namespace, self.template, self.python = api, namespace, template, python
        self.path = f"/apis/ray.io/v1/namespaces/{namespace}/rayjobs"

    @classmethod
    def from_file(
        cls, template_path: str, *, api_url: str = "", namespace: str = ""
    ) -> KubeRayJobLauncher:
        (doc,) = [d for d in yaml.safe_load_all(Path(template_path).read_text()) if d]
        return cls(KubeAPI.in_cluster(api_url), namespace or service_account_namespace(), doc)

    def _call(self, method: str, path: str, ok: tuple[int, ...], **kw: Any) -> httpx.Response:
        with self.api.client() as http:
            r = http.request(method, path, **kw)
        if r.status_code not in ok:
            raise KubeAPIError(r.status_code, r.text)
        return r

    # -- Launcher protocol -------------------------------------------------------------------------
    def submit(self, req: LaunchRequest) -> str:
        job = rayjob_for(self.template, req, python=self.python)
        self._call(
            "POST", self.path, (200, 201, 202, 409), json=job
        )  # 409: this attempt's RayJob exists already
        return str(job["metadata"]["name"])

    def run_task(self, task: TaskRequest) -> str:
        """A RayJob of its own (`rayjob_for_task`), queued in Kueue like a job's."""
        job = rayjob_for_task(self.template, task, python=self.python)
        self._call(
            "POST", self.path, (200, 201, 202, 409), json=job
        )  # 409: this task's RayJob exists already
        return str(job["metadata"]["name"])

    def find(self, job_id: str, attempt: int) -> str | None:
        name = submission_id_for(job_id, attempt).lower()
        return None if self.status(name).status == DriverStatus.UNKNOWN else name

    def stop(self, submission_id: str) -> None:
        """Delete the RayJob: KubeRay deletes its cluster (and the driver with it); Kueue frees the
        quota."""
        self._call(
            "DELETE",
            f"{self.path}/{submission_id}",
            (200, 202, 404),
            params={"propagationPolicy": "Background"},
        )

    def status(self, submission_id: str) -> DriverInfo:
        r = self._call("GET", f"{self.path}/{submission_id}", (200, 404))
        if r.status_code == 404:
            return DriverInfo(
                DriverStatus.UNKNOWN,
                f"RayJob {submission_id} does not exist (deleted, or TTL expired)",
            )
        return status_of(r.json())

    def logs(self, submission_id: str) -> str:
        """The submitter's log (KubeRay's submitter Job has the RayJob's name): it follows the
        driver's output."""
        selector = {"labelSelector": f"job-name={submission_id}"}
        pods = self._call(
            "GET", f"/api/v1/namespaces/{self.namespace}/pods", (200,), params=selector
        ).json()["items"]
        if not pods:
            return ""
        newest = max(pods, key=lambda p: p.get("metadata", {}).get("creationTimestamp", ""))
        r = self._call(
            "GET",
            f"/api/v1/namespaces/{self.namespace}/pods/{newest['metadata']['name']}/log",
            (200, 400),
        )
        return r.text if r.status_code == 200 else ""

    def cluster(self) -> ClusterInfo:
        """No shared nodes: each job brings its own cluster, Kueue holds the quota (the control
        plane counts the queue's size from `RINGTRAIN_AUTOSCALER_NODES`). Reading the RayJob list
        checks the API and the RBAC."""
        self._call("GET", self.path, (200,), params={"limit": 1})
        return ClusterInfo(nodes=[], per_job_clusters=True)
