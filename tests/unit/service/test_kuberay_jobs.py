"""Kueue mode: the control plane runs every job as a KubeRay RayJob (service/kuberay_jobs.py).

No Kubernetes API server can run here, so `KubeStub` (tests/support/kube_stub.py) plays one on loopback for the
calls the launcher makes (create, get, list, delete RayJobs; list pods, read a log), with the API server's own
answers: 401 without the token, 409 for an existing name, 404, and 422 for an object the RayJob CRD's schema refuses
(the vendored KubeRay v1.7.0 CRD, unknown fields rejected, as tests/deploy/test_deploy.py validates the manifests).
Kueue and KubeRay are played by the test changing a RayJob's `spec.suspend` and `status` the way they do. Everything
on the control plane's side is real: uvicorn, SQLite, the scheduler and reconciler, the drivers' reports over HTTP
with the ingest token read back out of the RayJob the launcher created.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

from service.admission import NodeShape
from service.kuberay_jobs import KubeAPI, KubeRayJobLauncher, priority_class, rayjob_for, status_of
from service.launcher import DriverStatus, LaunchRequest
from service.ray_jobs import driver_environment
from tests.support import deploy_helpers as dh
from tests.support.api_harness import ALICE, TINY_SPEC, Driver, running, wait_for
from tests.support.kube_stub import KUBE_TOKEN, NS, KubeStub
from workers import protocol
from workers.config import JobSpec
from workers.protocol import DriverEnv

TEMPLATE_FILE = (
    Path(__file__).resolve().parents[3] / "deploy/k8s/overlays/kueue/rayjob-template.yaml"
)
GPU_SPEC: dict[str, Any] = {**TINY_SPEC, "resources": {"accelerator": "gpu"}}


def ranks(ring: int, dp: int) -> dict[str, Any]:
    return {
        "parallel": {"ring_size": ring, "data_parallel": dp},
        "train": {"steps": 5, "batch_size": dp},
    }


def template() -> dict[str, Any]:
    (doc,) = dh.load_yaml_docs(TEMPLATE_FILE.read_text())
    return doc


def request(spec: dict[str, Any], job_id: str = "j0123456789ab", attempt: int = 0) -> LaunchRequest:
    return LaunchRequest(
        job_id=job_id,
        spec=JobSpec.model_validate(spec),
        control_url="http://ringtrain-api:8000",
        ingest_token=f"ingest-{job_id}-{attempt}",
        checkpoint_dir="/mnt/checkpoints",
        attempt=attempt,
    )


def env_of(rayjob: dict[str, Any]) -> DriverEnv:
    """What the driver reads in its environment: the RayJob's runtimeEnvYAML, parsed by the driver's own model."""
    env = yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])["env_vars"]
    with mock.patch.dict(os.environ, env, clear=True):
        return DriverEnv()  # type: ignore[call-arg]


def gpus(rayjob: dict[str, Any]) -> tuple[int, str]:
    (group,) = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"]
    return group["replicas"], group["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"
    ]


# -- the RayJob each attempt becomes ------------------------------------------------------------------------------
def test_rayjob_for_fills_the_template_and_passes_the_crd_schema() -> None:
    tpl = template()
    before = json.dumps(tpl, sort_keys=True)
    small = rayjob_for(tpl, request({**GPU_SPEC, "priority": 5}))
    big = rayjob_for(tpl, request({**GPU_SPEC, **ranks(8, 2), "priority": -3}, attempt=2))
    assert json.dumps(tpl, sort_keys=True) == before, "the template itself is never changed"
    for job in (small, big):
        assert dh.crd_errors(job) == [], dh.crd_errors(job)
        assert (
            job["spec"]["suspend"] is True
            and job["spec"]["entrypoint"] == "python -m workers.driver"
        )
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "ringtrain"
    assert small["metadata"]["name"] == "ringtrain-j0123456789ab-0" and big["metadata"][
        "name"
    ].endswith("-2")
    assert small["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "ringtrain-high"
    assert big["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "ringtrain-low"
    # a ring of 2 on 8-GPU pods asks for one pod with 2 GPUs; 16 ranks for two full pods
    assert gpus(small) == (1, "2") and gpus(big) == (2, "8")
    # the driver reads back exactly what the control plane meant
    env = env_of(big)
    assert (env.job_id, env.attempt, env.ingest_token) == (
        "j0123456789ab",
        2,
        "ingest-j0123456789ab-2",
    )
    assert (
        env.checkpoint_dir == "/mnt/checkpoints/j0123456789ab"
        and env.control_url == "http://ringtrain-api:8000"
    )
    assert env.job_spec == JobSpec.model_validate({**GPU_SPEC, **ranks(8, 2), "priority": -3})


def test_cpu_jobs_are_sized_by_cpus_and_bad_ids_are_refused() -> None:
    spec = {**TINY_SPEC, **ranks(4, 4)}
    spec["resources"] = {"accelerator": "cpu", "cpus_per_worker": 4}
    job = rayjob_for(template(), request(spec))
    assert gpus(job)[0] == 2  # 16 ranks x 4 CPUs on 32-CPU pods
    assert dh.crd_errors(job) == []
    with pytest.raises(ValueError, match="not a DNS label"):
        rayjob_for(template(), request(GPU_SPEC, job_id="j" * 60))
    with pytest.raises(ValueError, match="worker pods give 32"):
        rayjob_for(
            template(),
            request({**spec, "resources": {"accelerator": "cpu", "cpus_per_worker": 64}}),
        )
    assert [priority_class(p) for p in (10, 1, 0, -1)] == ["ringtrain-high"] * 2 + [
        "ringtrain-normal",
        "ringtrain-low",
    ]


@pytest.mark.parametrize(
    ("suspend", "deploy", "ray", "want", "generation"),
    [
        (True, "", "", DriverStatus.PENDING, 1),  # waiting for Kueue
        (
            True,
            "Suspended",
            "",
            DriverStatus.PENDING,
            1,
        ),  # never admitted: KubeRay suspends a new RayJob too
        # suspended again after admission (spec changed since creation): preempted by Kueue, whatever KubeRay's
        # progress (not reacted yet, deleting the cluster, done)
        (True, "Running", "RUNNING", DriverStatus.PREEMPTED, 3),
        (True, "Suspending", "RUNNING", DriverStatus.PREEMPTED, 3),
        (True, "Suspended", "", DriverStatus.PREEMPTED, 3),
        (
            False,
            "Suspended",
            "",
            DriverStatus.PENDING,
            4,
        ),  # admitted again: KubeRay starts a new cluster
        (False, "Initializing", "", DriverStatus.PENDING, 2),
        (False, "Running", "PENDING", DriverStatus.PENDING, 2),
        (False, "Running", "RUNNING", DriverStatus.RUNNING, 2),
        (False, "Running", "SUCCEEDED", DriverStatus.SUCCEEDED, 2),
        (False, "Complete", "SUCCEEDED", DriverStatus.SUCCEEDED, 2),
        (False, "Complete", "STOPPED", DriverStatus.STOPPED, 2),
        (False, "Failed", "FAILED", DriverStatus.FAILED, 2),
        (False, "Failed", "", DriverStatus.FAILED, 2),  # e.g. SubmissionFailed, DeadlineExceeded
        (False, "ValidationFailed", "", DriverStatus.FAILED, 2),
    ],
)
def test_kuberay_status_maps_to_the_driver_status(
    suspend: bool, deploy: str, ray: str, want: DriverStatus, generation: int
) -> None:
    info = status_of(
        {
            "metadata": {"generation": generation},
            "spec": {"suspend": suspend},
            "status": {
                "jobDeploymentStatus": deploy,
                "jobStatus": ray,
                "reason": "AppFailed" if ray == "FAILED" else "",
            },
        }
    )
    assert info.status is want
    if suspend:
        assert "Kueue" in info.message
    if want is DriverStatus.PREEMPTED:
        assert not want.finished and "preempted" in info.message
    if want is DriverStatus.FAILED and ray == "FAILED":
        assert info.message == "AppFailed"


# -- a Kubernetes API for the launcher's calls: tests.support.kube_stub.KubeStub --------------------


@pytest.fixture
def kube() -> Iterator[KubeStub]:
    stub = KubeStub()
    yield stub
    stub.server.shutdown()


def test_the_control_plane_runs_each_job_as_a_rayjob(tmp_path: Path, kube: KubeStub) -> None:
    launcher = KubeRayJobLauncher(KubeAPI(kube.url, KUBE_TOKEN), NS, template())
    quota = [
        NodeShape(group="gpu", cpus=32, gpus=8, max_nodes=1)
    ]  # the ClusterQueue: one 8-GPU pod
    with running(
        tmp_path, launcher, autoscaler_nodes=quota, checkpoint_dir="/mnt/checkpoints"
    ) as srv:
        c = srv.client(ALICE)
        assert c.get("/readyz").status_code == 200
        # larger than the queue can ever hold: refused at once, naming what there is
        r = c.post("/v1/jobs", json={**GPU_SPEC, "parallel": {"ring_size": 16}})
        assert r.status_code == 422 and "GPU" in r.text, r.text
        # three 4-GPU jobs: the shared-cluster queue would hold one back; Kueue mode hands all three to Kueue
        ok, failing, cancelled = (
            c.post(
                "/v1/jobs", json={**GPU_SPEC, "name": n, "parallel": {"ring_size": 4}, **extra}
            ).json()["id"]
            for n, extra in (("ok", {}), ("failing", {"max_restarts": 1}), ("cancelled", {}))
        )
        wait_for(lambda: all(kube.created(j) for j in (ok, failing, cancelled)), timeout=30)
        for j in (ok, failing, cancelled):
            job = wait_for(
                lambda j=j: (x := c.get(f"/v1/jobs/{j}").json())["state"] == "PLACING" and x,
                timeout=30,
            )
            assert job["queue_position"] is None
            assert "waits for Kueue to admit it" in job["transitions"][-1]["reason"], job[
                "transitions"
            ]

        # ok: Kueue admits it, the driver (token from its RayJob) reports, KubeRay reports completion
        (name,) = kube.created(ok)
        kube.set(name, jobDeploymentStatus="Running", jobStatus="RUNNING")
        d = Driver(srv, ok, token=env_of(kube.rayjobs[name]).ingest_token)
        assert d.state("RUNNING", reason="all 4 ranks placed").status_code == 200
        assert d.metrics(range(5)).status_code == 200
        assert d.state("SUCCEEDED", reason="done").status_code == 200
        kube.set(name, jobDeploymentStatus="Complete", jobStatus="SUCCEEDED")
        assert c.get(f"/v1/jobs/{ok}").json()["state"] == "SUCCEEDED"

        # failing: its cluster dies without a report; a restart is a new RayJob (attempt 1, a new token)
        (first,) = kube.created(failing)
        kube.set(
            first,
            jobDeploymentStatus="Failed",
            jobStatus="FAILED",
            reason="AppFailed",
            message="OOMKilled",
        )
        wait_for(lambda: len(kube.created(failing)) == 2, timeout=30)
        second = kube.created(failing)[1]
        assert second.endswith("-1") and env_of(kube.rayjobs[second]).attempt == 1
        assert env_of(kube.rayjobs[second]).ingest_token != env_of(kube.rayjobs[first]).ingest_token
        job = c.get(f"/v1/jobs/{failing}").json()
        retry = [t["reason"] for t in job["transitions"] if t["to"] == "RETRYING"]
        assert job["restarts"] == 1 and len(retry) == 1 and "AppFailed: OOMKilled" in retry[0], job[
            "transitions"
        ]

        # cancelled: the RayJob is deleted (KubeRay removes its cluster), the job ends CANCELLED
        (name,) = kube.created(cancelled)
        kube.pods["submitter-x"] = ({"job-name": name}, "driver: placement group pending\n")
        assert "placement group pending" in launcher.logs(name)
        assert c.post(f"/v1/jobs/{cancelled}/cancel").status_code == 202
        wait_for(lambda: name in kube.deleted, timeout=30)
        wait_for(lambda: c.get(f"/v1/jobs/{cancelled}").json()["state"] == "CANCELLED", timeout=30)
        assert kube.created(ok) and not kube.created(cancelled)


def test_kueue_preemption_waits_for_the_same_rayjob_and_resumes(
    tmp_path: Path, kube: KubeStub
) -> None:
    """Kueue preempts a running job: KubeRay deletes its cluster (the driver dies without a final report). The job
    is RETRYING without using a restart and keeps its RayJob; re-admitted, KubeRay runs the same attempt's driver
    again, whose token still reports, and which resumes from its last checkpoint: no point is stored twice."""
    launcher = KubeRayJobLauncher(KubeAPI(kube.url, KUBE_TOKEN), NS, template())
    quota = [NodeShape(group="gpu", cpus=32, gpus=8, max_nodes=1)]
    with running(
        tmp_path, launcher, autoscaler_nodes=quota, checkpoint_dir="/mnt/checkpoints"
    ) as srv:
        c = srv.client(ALICE)
        jid, waiting = (
            c.post(
                "/v1/jobs",
                json={**GPU_SPEC, "name": n, "parallel": {"ring_size": 4}, "max_restarts": 1},
            ).json()["id"]
            for n in ("preempted", "waiting")
        )
        wait_for(lambda: kube.created(jid) and kube.created(waiting), timeout=30)
        for j in (jid, waiting):
            wait_for(lambda j=j: c.get(f"/v1/jobs/{j}").json()["state"] == "PLACING", timeout=30)
        (name,), (never_admitted,) = kube.created(jid), kube.created(waiting)

        # admitted; the driver (token from its RayJob) runs and reports steps 0..4
        kube.set(name, jobDeploymentStatus="Running", jobStatus="RUNNING")
        token = env_of(kube.rayjobs[name]).ingest_token
        first = Driver(srv, jid, token=token)
        assert first.state("RUNNING", reason="training on 1 node(s), 4 rank(s)").status_code == 200
        assert first.metrics(range(5)).status_code == 200

        # the other job waits in Kueue all along: KubeRay suspends a new RayJob too, that is no preemption
        kube.set(never_admitted, suspend=True, jobDeploymentStatus="Suspended")
        # Kueue preempts the running one (suspend again); KubeRay deletes the cluster, then reads Suspended
        kube.set(name, suspend=True, jobDeploymentStatus="Suspending", jobStatus="RUNNING")
        job = wait_for(
            lambda: (x := c.get(f"/v1/jobs/{jid}").json())["state"] == "RETRYING" and x, timeout=30
        )
        kube.set(name, suspend=True, jobDeploymentStatus="Suspended")
        kube.passes(name, 3)
        job = c.get(f"/v1/jobs/{jid}").json()
        (why,) = [t["reason"] for t in job["transitions"] if t["to"] == "RETRYING"]
        assert why.startswith("preempted by Kueue") and "higher-priority" in why, why
        assert "waits to be admitted again, then resumes from the last checkpoint" in why, why
        assert job["state"] == "RETRYING" and job["restarts"] == 0 and job["error"] is None, job
        assert kube.created(jid) == [name] and name not in kube.deleted, (
            "Kueue re-admits the same RayJob"
        )
        other = c.get(f"/v1/jobs/{waiting}").json()
        assert other["state"] == "PLACING" and [t["to"] for t in other["transitions"]] == [
            "QUEUED",
            "PLACING",
        ]

        # re-admitted: KubeRay submits the same entrypoint and runtime env, i.e. this attempt's driver and token
        kube.set(name, jobDeploymentStatus="Running", jobStatus="RUNNING")
        assert env_of(kube.rayjobs[name]).ingest_token == token
        again = Driver(srv, jid, token=token)
        hello = again.post(
            []
        )  # the reporter's handshake: numbering continues after the stored reports
        assert hello.status_code == 200, hello.text
        again.seq = hello.json()["acked_seq"]
        assert again.seq == first.seq
        # it replays its journal up to the checkpoint at step 2 (held already: skipped), says it resumes there
        # (steps 3 and 4 of the preempted run are superseded), and trains on with values of its own
        replay = [
            again.item("metric", step=s, name="loss", value=1.0 / (s + 1), replay=True)
            for s in range(3)
        ]
        assert again.post(replay).status_code == 200
        assert again.state("PLACING", reason="waiting for 4 GPUs", resume_step=2).status_code == 200
        assert again.state("RUNNING", reason="training on 1 node(s), 4 rank(s)").status_code == 200
        assert c.get(f"/v1/jobs/{jid}").json()["state"] == "RUNNING"
        fresh = [
            again.item("metric", step=s, name="loss", value=2.0 / (s + 1)) for s in range(3, 7)
        ]
        assert again.post(fresh).status_code == 200
        assert again.state("SUCCEEDED", reason="finished at step 6").status_code == 200
        kube.set(name, jobDeploymentStatus="Complete", jobStatus="SUCCEEDED")

        job = c.get(f"/v1/jobs/{jid}").json()
        assert [t["to"] for t in job["transitions"]] == [
            "QUEUED", "PLACING", "RUNNING", "RETRYING", "PLACING", "RUNNING", "SUCCEEDED",
        ]  # fmt: skip
        assert job["state"] == "SUCCEEDED" and job["restarts"] == 0 and kube.created(jid) == [name]
        points = c.get(f"/v1/jobs/{jid}/metrics").json()["points"]
        assert sorted((p["step"], p["value"]) for p in points) == [
            *((s, pytest.approx(1.0 / (s + 1))) for s in range(3)),
            *((s, pytest.approx(2.0 / (s + 1))) for s in range(3, 7)),
        ], points
        assert c.get(f"/v1/jobs/{waiting}").json()["state"] == "PLACING"


def test_an_api_server_refusal_is_retried_then_fails_the_job(
    tmp_path: Path, kube: KubeStub
) -> None:
    """A template the CRD schema refuses (here a typo) never leaves a job half-started: each try is refused with
    the API server's message, and the job fails with it after `submit_attempts` tries."""
    bad = template()
    bad["spec"]["shutdownAfterJobFinish"] = True  # typo: unknown field
    launcher = KubeRayJobLauncher(KubeAPI(kube.url, KUBE_TOKEN), NS, bad)
    quota = [NodeShape(group="gpu", cpus=32, gpus=8, max_nodes=1)]
    with running(tmp_path, launcher, autoscaler_nodes=quota, submit_attempts=1) as srv:
        c = srv.client(ALICE)
        jid = c.post("/v1/jobs", json=GPU_SPEC).json()["id"]
        job = wait_for(
            lambda: (x := c.get(f"/v1/jobs/{jid}").json())["state"] == "FAILED" and x, timeout=30
        )
        assert "HTTP 422" in job["error"] and "shutdownAfterJobFinish" in job["error"], job["error"]
        assert kube.rayjobs == {}
    with pytest.raises(RuntimeError, match="HTTP 401"):
        KubeRayJobLauncher(KubeAPI(kube.url, "wrong"), NS, template()).cluster()


# -- RBAC: the overlay's Role grants what the launcher calls, nothing more -------------------------
def rbac_verb(method: str, path: str) -> tuple[str, str, str]:
    """(API group, resource, verb) the API server authorizes for a call, as RBAC names them."""
    core = re.fullmatch(rf"/api/v1/namespaces/{NS}/(pods)(?:/([^/]+))?(?:/(log))?", path)
    ray = re.fullmatch(rf"/apis/ray.io/v1/namespaces/{NS}/(rayjobs)(?:/([^/]+))?", path)
    m = core or ray
    assert m, path
    group = "" if core else "ray.io"
    resource, name = m.group(1), m.group(2)
    if core and m.group(3):
        resource = "pods/log"
    verbs = {"POST": "create", "DELETE": "delete", "GET": "get" if name else "list"}
    return group, resource, verbs[method]


def test_the_role_grants_exactly_what_the_launcher_calls(kube: KubeStub) -> None:
    """Every launcher call (submit, status, logs, stop, the readiness check) against the loopback
    API server, as RBAC verbs, equals the rules of the kueue overlay's Role: no patch, watch,
    status or Kueue workloads that no code uses."""
    dh.need_kubectl()
    launcher = KubeRayJobLauncher(KubeAPI(kube.url, KUBE_TOKEN), NS, template())
    sid = launcher.submit(request(GPU_SPEC))
    kube.pods["ringtrain-j0123456789ab-0-abcde"] = ({"job-name": sid}, "driver output")
    launcher.status(sid)
    assert launcher.logs(sid) == "driver output"
    launcher.cluster()
    launcher.stop(sid)
    used = {rbac_verb(m, path) for m, path in kube.calls}
    objs = dh.render_overlay("kueue")
    role = next(o for o in objs if o["kind"] == "Role")
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted - used == set(), "granted but never called"
    assert used - granted == set(), "called but not granted"


# -- one release per cluster: the driver refuses another version than the control plane's ---------
def test_a_driver_of_another_release_refuses_to_run() -> None:
    job = rayjob_for(template(), request(GPU_SPEC))
    env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
    assert env["RINGTRAIN_CONTROL_PLANE_VERSION"] == protocol.ringtrain_version()
    env_of(job).check_version()  # same release: runs
    newer = mock.patch.object(protocol, "ringtrain_version", return_value="9.9.9")
    with newer, pytest.raises(protocol.VersionMismatch) as err:
        env_of(job).check_version()
    msg = str(err.value)
    assert "runs 9.9.9" in msg and f"control plane {env['RINGTRAIN_CONTROL_PLANE_VERSION']}" in msg
    assert "same image tag" in msg and "Upgrading" in msg
    # ringtrain's version is 0.1.0 for every build: Ray's is compared too, sent the same way (the
    # Ray job launcher builds the same environment)
    import ray

    sent = env["RINGTRAIN_CONTROL_PLANE_RAY_VERSION"]
    assert sent == protocol.ray_version() == ray.__version__
    assert driver_environment(request(GPU_SPEC))["RINGTRAIN_CONTROL_PLANE_RAY_VERSION"] == sent
    other_ray = mock.patch.object(protocol, "ray_version", return_value="2.0.1")
    with other_ray, pytest.raises(protocol.VersionMismatch) as err:
        env_of(job).check_version()
    msg = str(err.value)
    assert msg.startswith("Ray version mismatch") and "runs Ray 2.0.1" in msg
    assert f"control plane Ray {sent}" in msg and "same image tag" in msg and "Upgrading" in msg
    # a control plane from before the checks sends no version: the driver takes its own, runs
    sent_by_new = ("RINGTRAIN_CONTROL_PLANE_VERSION", "RINGTRAIN_CONTROL_PLANE_RAY_VERSION")
    old = {k: v for k, v in env.items() if k not in sent_by_new}
    with mock.patch.dict(os.environ, old, clear=True):
        driver = protocol.DriverEnv()  # type: ignore[call-arg]
    assert driver.control_plane_version == protocol.ringtrain_version()
    assert driver.control_plane_ray_version == protocol.ray_version()
    driver.check_version()
