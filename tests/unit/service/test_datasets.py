"""A dataset's prepare runs through the launcher protocol (`Launcher.run_task`), whatever runs it.

Both real launchers, in-process and without Ray: `RayJobLauncher` with a recording stand-in for
Ray's JobSubmissionClient (the one object it talks to), `KubeRayJobLauncher` against the loopback
Kubernetes API of the KubeRay tests (`tests/support/kube_stub.py`), whose RayJobs pass the vendored
CRD schema or are refused with a 422. The same story is played on both: the task carries the
prepare's command line, and the row's state follows the task's status and the prepare's output.
Kueue mode is also played end to end through `POST /v1/datasets` on the real server.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from service.datasets import DatasetService, PrepareRequest
from service.db import make_engine, migrate
from service.kuberay_jobs import KubeAPI, KubeRayJobLauncher
from service.launcher import DriverStatus
from service.ray_jobs import RayJobLauncher
from service.store import Store
from tests.support import deploy_helpers as dh
from tests.support.api_harness import ALICE, running
from tests.support.kube_stub import KUBE_TOKEN, NS, KubeStub

TEMPLATE_FILE = (
    Path(__file__).resolve().parents[3] / "deploy/k8s/overlays/kueue/rayjob-template.yaml"
)
REQ = PrepareRequest("/data/corpus dir", "/data/prepared/c", "bytes")
# `python -m workers.data.prepare` with REQ's arguments, as the cluster's shell splits it
PREPARE_ARGV = [
    *("-m", "workers.data.prepare", "/data/corpus dir"),
    *("--tokenizer", "bytes", "--out", "/data/prepared/c", "--format", "text"),
    *("--text-field", "text", "--json-progress"),
]
PROGRESS = {"done_bytes": 10, "total_bytes": 40, "documents": 3, "tokens": 90, "stage": "tokenize"}
SUMMARY = {"id": "ds-abc", "format": "text", "documents": 12, "tokens": 345, "bytes": 690}


def line(obj: dict[str, Any]) -> str:
    return json.dumps(obj) + "\n"


def template() -> dict[str, Any]:
    (doc,) = dh.load_yaml_docs(TEMPLATE_FILE.read_text())
    return doc


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    engine = make_engine(f"sqlite:///{tmp_path}/ringtrain.db")
    migrate(engine)
    yield Store(engine)
    engine.dispose()


@pytest.fixture
def kube() -> Iterator[KubeStub]:
    stub = KubeStub()
    yield stub
    stub.server.shutdown()


# -- Ray's Jobs API, recorded ----------------------------------------------------------------------
@dataclass
class JobsClient:
    """What `RayJobLauncher` calls on `ray.job_submission.JobSubmissionClient`, with Ray's answers
    (a RuntimeError naming the HTTP status for unknown and existing ids)."""

    submitted: list[dict[str, Any]] = field(default_factory=list)
    status: dict[str, str] = field(default_factory=dict)
    log: dict[str, str] = field(default_factory=dict)
    refuse: str | None = None

    def submit_job(self, **kw: Any) -> str:
        if self.refuse:
            raise RuntimeError(self.refuse)
        sid = kw["submission_id"]
        if sid in self.status:
            raise RuntimeError(f"Request failed with status code 400: Job {sid} already exists.")
        self.submitted.append(kw)
        self.status[sid] = "PENDING"
        return str(sid)

    def get_job_info(self, sid: str) -> Any:
        if sid not in self.status:
            raise RuntimeError(f"Request failed with status code 404: Job {sid} does not exist.")
        return SimpleNamespace(status=SimpleNamespace(value=self.status[sid]), message="")

    def get_job_logs(self, sid: str) -> str:
        return self.log.get(sid, "")


@dataclass
class Cluster:
    """One launcher and how the test plays its cluster: `play(sid, status, log)` puts the task in
    the state the launcher reads as `status` (a `DriverStatus`), with `log` as its output;
    `entrypoint(sid)` is the command line the cluster runs; `forget(sid)` drops the task."""

    launcher: Any
    play: Callable[[str, DriverStatus, str], None]
    entrypoint: Callable[[str], str]
    forget: Callable[[str], None]


def ray_cluster() -> Cluster:
    launcher = RayJobLauncher(
        "http://head:8265", auth_token="", python="/opt/venv/bin/python", extra_env={"A": "1"}
    )
    jobs = launcher._client_obj = JobsClient()

    def play(sid: str, status: DriverStatus, log: str) -> None:
        jobs.status[sid], jobs.log[sid] = status.value, log

    def entrypoint(sid: str) -> str:
        (sub,) = [s for s in jobs.submitted if s["submission_id"] == sid]
        assert sub["runtime_env"] == {"env_vars": {"A": "1"}}
        assert sub["entrypoint_num_cpus"] == 0.0 and sub["metadata"]["ringtrain_dataset_id"]
        return str(sub["entrypoint"])

    def forget(sid: str) -> None:
        del jobs.status[sid]  # a new head: Ray answers 404 for it

    return Cluster(launcher, play, entrypoint, forget)


# KubeRay's (jobDeploymentStatus, jobStatus) and Kueue's suspend for each driver status played
KUBE_STATES = {
    DriverStatus.PENDING: dict(suspend=True),
    DriverStatus.RUNNING: dict(jobDeploymentStatus="Running", jobStatus="RUNNING"),
    DriverStatus.SUCCEEDED: dict(jobDeploymentStatus="Complete", jobStatus="SUCCEEDED"),
    DriverStatus.FAILED: dict(jobDeploymentStatus="Failed", jobStatus="FAILED", reason="AppFailed"),
}


def kube_cluster(kube: KubeStub) -> Cluster:
    launcher = KubeRayJobLauncher(
        KubeAPI(kube.url, KUBE_TOKEN), NS, template(), python="/opt/venv/bin/python"
    )

    def play(sid: str, status: DriverStatus, log: str) -> None:
        kube.set(sid, **KUBE_STATES[status])  # type: ignore[arg-type]
        kube.pods[f"{sid}-submitter"] = ({"job-name": sid}, log)

    def forget(sid: str) -> None:
        kube.rayjobs.pop(sid)  # ttlSecondsAfterFinished: KubeRay deleted it

    return Cluster(launcher, play, lambda sid: str(kube.rayjobs[sid]["spec"]["entrypoint"]), forget)


@pytest.fixture(params=["ray", "kuberay"])
def cluster(request: pytest.FixtureRequest, kube: KubeStub) -> Cluster:
    return ray_cluster() if request.param == "ray" else kube_cluster(kube)


# -- the same story on both launchers --------------------------------------------------------------
def test_a_prepare_runs_the_prepare_command_and_its_row_follows_the_task(
    store: Store, cluster: Cluster
) -> None:
    svc = DatasetService(store.datasets, cluster.launcher)
    ds = svc.create("alice", REQ)
    sid = f"ringtrain-dataset-{ds['id']}"
    assert ds["state"] == "QUEUED" and ds["error"] is None, ds
    assert store.datasets.get(ds["id"]).submission_id == sid  # type: ignore[union-attr]
    assert shlex.split(cluster.entrypoint(sid)) == ["/opt/venv/bin/python", *PREPARE_ARGV]

    cluster.play(sid, DriverStatus.PENDING, "")
    assert svc.get(ds["id"], "alice")["state"] == "QUEUED"  # type: ignore[index]
    cluster.play(sid, DriverStatus.RUNNING, "starting\n" + line({"progress": PROGRESS}))
    running_ds = svc.get(ds["id"], "alice")
    assert running_ds is not None and running_ds["state"] == "RUNNING"
    assert running_ds["progress"] == PROGRESS
    later = {**PROGRESS, "done_bytes": 30, "documents": 9}  # news while it stays RUNNING
    cluster.play(
        sid, DriverStatus.RUNNING, line({"progress": PROGRESS}) + line({"progress": later})
    )
    assert svc.get(ds["id"], "alice")["progress"] == later  # type: ignore[index]
    done_log = line({"progress": {**PROGRESS, "stage": "done"}}) + line({"dataset": SUMMARY})
    cluster.play(sid, DriverStatus.SUCCEEDED, done_log)
    done = svc.get(ds["id"], "alice")
    assert done is not None and done["state"] == "SUCCEEDED" and done["error"] is None, done
    assert (done["dataset_id"], done["documents"], done["tokens"], done["bytes"]) == (
        "ds-abc",
        12,
        345,
        690,
    )
    assert done["progress"]["stage"] == "done" and done["source"] == "/data/corpus dir"
    cluster.forget(sid)  # a finished row is never read from the cluster again
    assert svc.get(ds["id"], "alice") == done
    assert svc.get(ds["id"], "bob") is None and svc.list("bob") == []

    bad = svc.create("alice", REQ)
    bad_sid = f"ringtrain-dataset-{bad['id']}"
    cluster.play(bad_sid, DriverStatus.FAILED, "error: /data/c/b.jsonl:2: not a JSON object\n")
    failed = svc.get(bad["id"], "alice")
    assert failed is not None and failed["state"] == "FAILED"
    assert failed["error"] == "/data/c/b.jsonl:2: not a JSON object"
    # the cluster forgot a running one (KubeRay's TTL, a new Ray head): FAILED, not RUNNING forever
    lost = svc.create("alice", REQ)
    lost_sid = f"ringtrain-dataset-{lost['id']}"
    cluster.play(lost_sid, DriverStatus.RUNNING, "")
    cluster.forget(lost_sid)
    gone = svc.get(lost["id"], "alice")
    assert gone is not None and gone["state"] == "FAILED" and "no longer knows" in gone["error"]
    assert [d["id"] for d in svc.list("alice")] == [lost["id"], bad["id"], ds["id"]]


def test_a_task_the_cluster_refuses_leaves_a_failed_row_saying_why(
    store: Store, kube: KubeStub
) -> None:
    """The Kubernetes API's 422 (a template the RayJob CRD refuses) and Ray's refusal both end the
    row FAILED with the cluster's own message, and nothing is left running."""
    bad = template()
    bad["spec"]["shutdownAfterJobFinish"] = True  # typo: an unknown field
    kueue = KubeRayJobLauncher(KubeAPI(kube.url, KUBE_TOKEN), NS, bad)
    ds = DatasetService(store.datasets, kueue).create("alice", REQ)
    assert ds["state"] == "FAILED" and "HTTP 422" in ds["error"], ds
    assert "shutdownAfterJobFinish" in ds["error"] and kube.rayjobs == {}
    ray = ray_cluster()
    ray.launcher._client_obj.refuse = "Request failed with status code 500: no space"
    ds = DatasetService(store.datasets, ray.launcher).create("alice", REQ)
    assert ds["state"] == "FAILED" and ds["error"].endswith("no space"), ds


def test_running_the_same_task_again_finds_the_first(store: Store, cluster: Cluster) -> None:
    """A retried `run_task` (Ray: 'already exists'; Kubernetes: 409) returns the same submission
    instead of failing or starting a second prepare."""
    task = REQ.task("d0123456789ab")
    assert cluster.launcher.run_task(task) == cluster.launcher.run_task(task) == task.submission_id
    assert task.submission_id == "ringtrain-dataset-d0123456789ab"


# -- Kueue mode ------------------------------------------------------------------------------------
def test_kueue_mode_prepares_as_a_rayjob_of_its_own_through_the_api(
    tmp_path: Path, kube: KubeStub
) -> None:
    """POST /v1/datasets in Kueue mode (no Ray address anywhere) creates one suspended RayJob for
    the prepare: the template's cluster, the prepare's entrypoint, one CPU-only worker pod; the row
    follows the RayJob as Kueue admits it and KubeRay runs it, also after a preemption."""
    launcher = KubeRayJobLauncher(KubeAPI(kube.url, KUBE_TOKEN), NS, template())
    assert not hasattr(launcher, "address")
    src = tmp_path / "corpus.jsonl"
    src.write_text(line({"text": "a document"}))
    body = {"source": str(src), "out": str(tmp_path / "ds")}
    with running(tmp_path, launcher, data_roots=[str(tmp_path)]) as srv, srv.client(ALICE) as c:
        r = c.post("/v1/datasets", json=body)
        assert r.status_code == 201, r.text
        ds = r.json()
        assert ds["state"] == "QUEUED" and ds["error"] is None, ds
        (name,) = kube.rayjobs
        job = kube.rayjobs[name]
        assert name == f"ringtrain-dataset-{ds['id']}" and dh.crd_errors(job) == []
        argv = shlex.split(job["spec"]["entrypoint"])
        assert argv[:3] == ["python", "-m", "workers.data.prepare"]
        want = (str(src), "--tokenizer", "bytes", "--out", str(tmp_path / "ds"), "--format")
        assert argv[3:] == [*want, "text", "--text-field", "text", "--json-progress"]
        labels = job["metadata"]["labels"]
        assert labels["ringtrain.io/task-id"] == f"dataset-{ds['id']}"
        assert labels["kueue.x-k8s.io/queue-name"] == "ringtrain" and job["spec"]["suspend"]
        assert "ringtrain.io/job-id" not in labels  # not a training job's RayJob
        (group,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 1
        res = group["template"]["spec"]["containers"][0]["resources"]
        assert "nvidia.com/gpu" not in res["limits"] and "nvidia.com/gpu" not in res["requests"]
        env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
        assert env == {"PYTHONUNBUFFERED": "1"}

        kube.set(name, jobDeploymentStatus="Running", jobStatus="RUNNING")
        kube.pods["submitter"] = ({"job-name": name}, line({"progress": PROGRESS}))
        assert c.get(f"/v1/datasets/{ds['id']}").json()["state"] == "RUNNING"
        # preempted by Kueue: waits to be admitted again, neither failed nor finished
        kube.set(name, suspend=True, jobDeploymentStatus="Suspending", jobStatus="RUNNING")
        assert launcher.status(name).status is DriverStatus.PREEMPTED
        again = c.get(f"/v1/datasets/{ds['id']}").json()
        assert again["state"] == "RUNNING" and again["error"] is None, again
        kube.set(name, jobDeploymentStatus="Complete", jobStatus="SUCCEEDED")
        kube.pods["submitter"] = ({"job-name": name}, line({"dataset": SUMMARY}))
        done = c.get(f"/v1/datasets/{ds['id']}").json()
        assert done["state"] == "SUCCEEDED" and done["documents"] == 12, done
        assert [d["id"] for d in c.get("/v1/datasets").json()] == [ds["id"]]
