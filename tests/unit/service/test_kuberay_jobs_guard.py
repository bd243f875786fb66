"""Kueue mode's pure pieces and the launcher's log read (service/kuberay_jobs.py), in process.

The in-cluster API address (IPv6 in brackets), the service-account files (CA, token, namespace
without its newline), Kubernetes quantities (millicores, binary and decimal memory units), KubeRay's
reason and message in a failed job's status, and `logs`: the newest submitter pod's log, empty when
the API server answers 400 (the pod has no container running yet). The API server is a tiny HTTP
server on 127.0.0.1 with hand-written answers. And `rayjob_for` on variants of the deploy template
(8 GPUs, 32 CPUs per pod): a 2-GPU ring's pod without `num-cpus` gets Ray's CPUs from its shrunk
container (a quarter: 8), a disk `emptyDir` keeps its size (only the memory-backed /dev/shm
shrinks), the template's namespace is dropped (the launcher's is used), and a name of exactly 47
characters is a valid RayJob name. A task's RayJob (`rayjob_for_task`) is one CPU-only pod sized
to the task's CPUs (an eighth of the pod for 4 CPUs), with unbuffered output.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from service import kuberay_jobs
from service.kuberay_jobs import (
    MAX_NAME,
    KubeAPI,
    KubeRayJobLauncher,
    _bytes,
    _quantity,
    rayjob_for,
    rayjob_for_task,
    service_account_namespace,
    status_of,
)
from service.launcher import DriverStatus, TaskRequest
from tests.support.kube_stub import KUBE_TOKEN, KubeStub
from tests.support.kube_stub import NS as STUB_NS
from tests.unit.service.test_kuberay_jobs import GPU_SPEC, request, template

NS = "ml-jobs"


def test_the_in_cluster_api_address_and_service_account_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(kuberay_jobs, "SERVICE_ACCOUNT", tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    api = KubeAPI.in_cluster()
    assert (api.url, api.ca_file, api.token_file) == ("https://10.96.0.1:443", None, None)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00:10:96::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    (tmp_path / "ca.crt").write_text("CA")
    (tmp_path / "token").write_text("sa-token\n")
    api = KubeAPI.in_cluster()
    assert api.url == "https://[fd00:10:96::1]:6443"
    assert (api.ca_file, api.token_file) == (str(tmp_path / "ca.crt"), str(tmp_path / "token"))
    assert api.bearer() == "sa-token"
    assert KubeAPI.in_cluster("https://api.example:6443").url == "https://api.example:6443"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    with pytest.raises(RuntimeError, match="RINGTRAIN_KUBERNETES_API"):
        KubeAPI.in_cluster()
    assert service_account_namespace() == "default"
    (tmp_path / "namespace").write_text(f"{NS}\n")
    assert service_account_namespace() == NS


def test_kubernetes_quantities() -> None:
    assert [_quantity(v) for v in ("32", "500m", 8, "1.5", "250m")] == [32.0, 0.5, 8.0, 1.5, 0.25]
    assert [_bytes(v) for v in ("256Gi", "500M", 34359738368, "1Ki", "1k", "1.5Mi", "2T")] == [
        256 * 2**30,
        500 * 10**6,
        34359738368,
        1024,
        1000,
        1572864,
        2 * 10**12,
    ]
    with pytest.raises(ValueError, match="not a memory quantity"):
        _bytes("12Gb")


def test_a_failed_rayjob_says_kuberays_reason_and_message() -> None:
    job = {
        "metadata": {"generation": 2},
        "spec": {"suspend": False},
        "status": {
            "jobDeploymentStatus": "Failed",
            "jobStatus": "",
            "reason": "DeadlineExceeded",
            "message": "activeDeadlineSeconds reached",
        },
    }
    info = status_of(job)
    assert (info.status, info.message) == (
        DriverStatus.FAILED,
        "DeadlineExceeded: activeDeadlineSeconds reached",
    )
    job["status"] = {"jobDeploymentStatus": "Initializing"}
    assert status_of(job).message == "RayJob Initializing; its Ray cluster is starting"
    # re-admitted: a new cluster starts while Ray's status still reads the old driver's
    job["status"] = {"jobDeploymentStatus": "Initializing", "jobStatus": "RUNNING"}
    assert status_of(job).status is DriverStatus.PENDING
    # suspended at any generation past creation's (1) was admitted before: preempted
    job["spec"]["suspend"], job["status"] = True, {"jobDeploymentStatus": "Suspended"}
    assert status_of(job).status is DriverStatus.PREEMPTED
    job["metadata"]["generation"] = 1
    assert status_of(job).status is DriverStatus.PENDING


@pytest.fixture
def kube() -> Iterator[KubeStub]:
    """The Kubernetes API on loopback, with a RayJob's submitter Job tried three times: its pods'
    names are not in age order."""
    stub = KubeStub()
    for name, created in (("sub-b", "10:00"), ("sub-a", "11:30"), ("sub-c", "09:00")):
        stub.pods[name] = ({"job-name": "rj-1"}, f"log of {name}")
        stub.pod_created[name] = f"2026-11-29T{created}:00Z"
    yield stub
    stub.server.shutdown()


def test_logs_are_the_newest_submitter_pods(kube: KubeStub) -> None:
    launcher = KubeRayJobLauncher(KubeAPI(kube.url, KUBE_TOKEN), STUB_NS, template())
    assert launcher.logs("rj-1") == "log of sub-a"
    pods = f"/api/v1/namespaces/{STUB_NS}/pods"
    assert kube.calls == [("GET", pods), ("GET", f"{pods}/sub-a/log")]
    assert launcher.logs("rj-2") == ""  # no pod yet
    kube.log_status = 400  # the container is not running yet
    assert launcher.logs("rj-1") == ""


def test_a_small_ring_on_a_template_without_num_cpus_keeps_its_disk_and_drops_the_namespace() -> (
    None
):
    tpl = template()
    tpl["metadata"]["namespace"] = "somewhere-else"
    (group,) = tpl["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    del group["rayStartParams"]["num-cpus"]
    pod = group["template"]["spec"]
    pod["volumes"].append({"name": "scratch", "emptyDir": {"sizeLimit": "100Gi"}})
    job = rayjob_for(tpl, request({**GPU_SPEC, "parallel": {"ring_size": 2}}))
    (group,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert (limits["cpu"], limits["nvidia.com/gpu"]) == ("8", "2")
    assert group["rayStartParams"]["num-cpus"] == "8"
    sizes = {
        v["name"]: v["emptyDir"]["sizeLimit"]
        for v in group["template"]["spec"]["volumes"]
        if "emptyDir" in v
    }
    assert sizes == {"dshm": "12288Mi", "scratch": "100Gi"}  # 48Gi / 4; the disk as it was
    assert "namespace" not in job["metadata"]


def test_a_name_of_exactly_the_longest_kuberay_takes_is_accepted() -> None:
    assert MAX_NAME == 47
    longest = "j" * (MAX_NAME - len("ringtrain--0"))
    job = rayjob_for(template(), request(GPU_SPEC, job_id=longest))
    assert len(job["metadata"]["name"]) == 47
    with pytest.raises(ValueError, match="not a DNS label"):
        rayjob_for(template(), request(GPU_SPEC, job_id=longest + "j"))


def test_a_task_books_one_cpu_pod_of_its_size() -> None:
    tpl = template()
    tpl["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"] = "8"
    task = TaskRequest("ds-1", "workers.data.prepare", ("in",), {"A": "1"}, cpus=4)
    job = rayjob_for_task(tpl, task)
    assert job["metadata"]["name"] == "ringtrain-ds-1"
    assert yaml.safe_load(job["spec"]["runtimeEnvYAML"]) == {
        "env_vars": {"A": "1", "PYTHONUNBUFFERED": "1"}
    }
    (group,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (1, 1, 1)
    res = group["template"]["spec"]["containers"][0]["resources"]
    for kind in ("requests", "limits"):
        assert res[kind] == {"cpu": "4", "memory": "32768Mi"}  # 256Gi / 8, no GPU
    assert group["rayStartParams"] == {"num-cpus": "4", "object-store-memory": str(2**32)}
    (shm,) = [v for v in group["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["sizeLimit"] == "6144Mi"
    whole = rayjob_for_task(template(), TaskRequest("ds-2", "workers.data.prepare"))
    limits = whole["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert limits["containers"][0]["resources"]["limits"] == {"cpu": "32", "memory": "256Gi"}


def test_resubmitting_and_deleting_twice_are_no_errors(kube: KubeStub) -> None:
    """After a control-plane crash the same attempt's RayJob is created again (409: it exists) and
    a stop may come after KubeRay's TTL removed it (404)."""
    launcher = KubeRayJobLauncher(KubeAPI(kube.url, KUBE_TOKEN), STUB_NS, template())
    name = "ringtrain-j0123456789ab-0"
    assert launcher.submit(request(GPU_SPEC)) == name
    assert launcher.submit(request(GPU_SPEC)) == name  # 409 from the API server
    launcher.stop(name)
    launcher.stop(name)  # 404 from the API server
    assert launcher.find("j0123456789ab", 0) is None
    rayjobs = f"/apis/ray.io/v1/namespaces/{STUB_NS}/rayjobs"
    assert kube.calls == [
        ("POST", rayjobs),
        ("POST", rayjobs),
        ("DELETE", f"{rayjobs}/{name}"),
        ("DELETE", f"{rayjobs}/{name}"),
        ("GET", f"{rayjobs}/{name}"),
    ]
    assert kube.deleted == [name]


def test_the_token_file_wins_and_the_token_is_the_fallback(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("from-file\n")
    assert KubeAPI("https://k", "given", token_file=str(tmp_path / "token")).bearer() == "from-file"
    assert KubeAPI("https://k", "given", token_file=str(tmp_path / "gone")).bearer() == "given"
