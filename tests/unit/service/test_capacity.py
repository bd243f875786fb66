"""Capacity that knows the autoscaler, and an accelerator decided once.

A KubeRay GPU group scaled to zero leaves only the head up: the control plane must still accept a GPU job that the
group can grow to hold (and refuse one over `maxReplicas`, naming that limit), and `accelerator: auto` is resolved at
submission and stored, so a resubmitted driver runs on what the job started on. Real control plane on loopback with
a recording launcher whose cluster view each test sets.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from service.admission import NodeShape, with_autoscaler
from service.capacity import growth_limit, with_accelerator_resolved
from service.launcher import ClusterInfo, DriverInfo, DriverStatus, NodeInfo
from service.planner import plan
from tests.support.api_harness import TINY_SPEC, RecordingLauncher, running, wait_for
from workers.config import JobSpec

HEAD = NodeInfo("head", "10.0.0.1", True, 2, 2, 0, 0)  # KubeRay head: a few CPUs, no GPU
GPU_GROUP = {
    "group": "gpu",
    "cpus": 32,
    "gpus": 8,
    "max_nodes": 2,
}  # maxReplicas 2 × 8 GPUs = 16 GPUs


def gpu_spec(ring: int, **kw: object) -> dict[str, object]:
    return {
        **TINY_SPEC,
        "data": {"kind": "passkey", "seq_len": 64 * ring},
        "parallel": {"ring_size": ring},
        "resources": {"accelerator": "auto", "cpus_per_worker": 1},
        **kw,
    }


def test_planner_counts_the_group_the_autoscaler_may_grow() -> None:
    spec = JobSpec.model_validate(gpu_spec(16))
    head_only = ClusterInfo(nodes=[HEAD])
    alone = plan(spec, head_only)
    assert (
        not alone.fits and alone.accelerator == "cpu"
    )  # without the group: 2 CPU bundles, never 16
    grown = with_autoscaler(head_only, [NodeShape(**GPU_GROUP)])
    p = plan(spec, grown)
    assert p.fits and p.accelerator == "gpu" and p.bundle == {"CPU": 1.0, "GPU": 1.0}
    assert p.nodes_used == 2 and p.strategy == "PACK"
    assert sorted({s.node_id for s in p.placement}) == ["autoscaler-0-0", "autoscaler-0-1"]
    over = plan(JobSpec.model_validate(gpu_spec(17)), grown)
    assert not over.fits and "needs 17 GPUs" in over.warnings[0] and "has 16" in over.warnings[0]
    assert (
        growth_limit([NodeShape(**GPU_GROUP)])
        == "worker group 'gpu': maxReplicas 2 x (32 CPU + 8 GPU) = 16 GPUs"
    )


def test_resolve_accelerator_once() -> None:
    auto = JobSpec.model_validate(gpu_spec(2))
    with_gpu = ClusterInfo(nodes=[HEAD, NodeInfo("g", "10.0.0.2", True, 8, 8, 8, 8)])
    assert with_accelerator_resolved(auto, with_gpu).resources.accelerator == "gpu"
    assert with_accelerator_resolved(auto, ClusterInfo(nodes=[HEAD])).resources.accelerator == "cpu"
    dead_gpu = ClusterInfo(nodes=[HEAD, NodeInfo("g", "10.0.0.2", False, 8, 0, 8, 0)])
    assert with_accelerator_resolved(auto, dead_gpu).resources.accelerator == "cpu"
    named = JobSpec.model_validate(gpu_spec(2, resources={"accelerator": "cpu"}))
    assert (
        with_accelerator_resolved(named, with_gpu) is named
    )  # a named accelerator is never changed


def test_gpu_job_accepted_on_a_head_only_cluster_and_refused_over_max_replicas(
    tmp_path: Path,
) -> None:
    launcher = RecordingLauncher(nodes=[HEAD])
    with running(tmp_path, launcher, autoscaler_nodes=[GPU_GROUP]) as srv:
        c = srv.client()
        planned = c.post("/v1/plan", json=gpu_spec(16)).json()
        assert planned["fits"] and planned["accelerator"] == "gpu", planned

        first = c.post("/v1/jobs", json=gpu_spec(16, name="fills-the-group"))
        assert first.status_code == 201, first.text
        assert (
            first.json()["spec"]["resources"]["accelerator"] == "gpu"
        )  # resolved at submission, stored
        # admitted: its driver is launched, and its pending placement group is what the autoscaler scales up for
        req = wait_for(
            lambda: next((r for r in launcher.submits if r.job_id == first.json()["id"]), None)
        )
        assert req.spec.resources.accelerator == "gpu" and req.spec.world_size == 16

        second = c.post("/v1/jobs", json=gpu_spec(8, name="waits"))
        assert second.status_code == 201, second.text
        waiting = wait_for(
            lambda: (j := c.get(f"/v1/jobs/{second.json()['id']}").json())["queue_position"] and j
        )
        assert waiting["state"] == "QUEUED" and waiting["queue_position"] == 1
        assert "room for 0" in waiting["queue_reason"], waiting["queue_reason"]
        assert len(launcher.submits) == 1  # the waiting job holds nothing

        over = c.post("/v1/jobs", json=gpu_spec(17, name="too-big"))
        assert over.status_code == 422, over.text
        err = over.json()["error"]
        assert err["field"] == "parallel.ring_size"
        assert "needs 17 GPUs" in err["message"] and "maxReplicas 2" in err["message"], err[
            "message"
        ]
        assert "worker group 'gpu'" in err["message"] and "= 16 GPUs" in err["message"]


def test_without_the_autoscaler_setting_a_head_only_cluster_refuses_gpu_rings(
    tmp_path: Path,
) -> None:
    with running(tmp_path, RecordingLauncher(nodes=[HEAD])) as srv:
        r = srv.client().post("/v1/jobs", json=gpu_spec(16, resources={"accelerator": "gpu"}))
        assert r.status_code == 422 and "never be placed" in r.json()["error"]["message"]
        assert "maxReplicas" not in r.json()["error"]["message"]


@dataclass
class FlakyLauncher(RecordingLauncher):
    """A cluster that cannot be read until `down` is cleared."""

    down: threading.Event = field(default_factory=threading.Event)

    def cluster(self) -> ClusterInfo:
        if self.down.is_set():
            raise ConnectionError("head restarting")
        return super().cluster()


def test_a_retry_never_changes_the_accelerator(tmp_path: Path) -> None:
    gpu_node = NodeInfo("gpu-1", "10.0.0.2", True, 32, 32, 8, 8)
    launcher = FlakyLauncher(nodes=[HEAD, gpu_node])
    with running(tmp_path, launcher) as srv:
        c = srv.client()
        j = c.post("/v1/jobs", json=gpu_spec(4, max_restarts=2)).json()
        assert j["spec"]["resources"]["accelerator"] == "gpu"
        first = wait_for(lambda: next((r for r in launcher.submits if r.job_id == j["id"]), None))
        assert first.attempt == 0 and first.spec.resources.accelerator == "gpu"

        # the GPU node is lost with the driver: only CPUs remain, and the resubmitted driver still gets `gpu`
        launcher.nodes = [HEAD, NodeInfo("cpu-1", "10.0.0.3", True, 16, 16, 0, 0)]
        launcher.statuses[f"ringtrain-{j['id']}-0"] = DriverInfo(DriverStatus.FAILED, "node lost")
        again = wait_for(
            lambda: next(
                (r for r in launcher.submits if r.job_id == j["id"] and r.attempt == 1), None
            )
        )
        assert again.spec.resources.accelerator == "gpu"
        assert c.get(f"/v1/jobs/{j['id']}").json()["spec"]["resources"]["accelerator"] == "gpu"

        # submitted while the cluster cannot be read: still `auto`, decided once at admission and stored
        launcher.down.set()
        srv.app.state.ctx._cluster = None  # the API's short cluster cache would still answer
        launcher.nodes = [HEAD, gpu_node, NodeInfo("gpu-2", "10.0.0.4", True, 32, 32, 8, 8)]
        k = c.post("/v1/jobs", json=gpu_spec(2, name="while-down")).json()
        assert k["spec"]["resources"]["accelerator"] == "auto" and k["state"] == "QUEUED"
        launcher.down.clear()
        req = wait_for(lambda: next((r for r in launcher.submits if r.job_id == k["id"]), None))
        assert req.spec.resources.accelerator == "gpu"
        assert c.get(f"/v1/jobs/{k['id']}").json()["spec"]["resources"]["accelerator"] == "gpu"
