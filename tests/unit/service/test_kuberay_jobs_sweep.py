"""A ring smaller than one worker pod books its share of the pod, not the whole node (`rayjob_for`'s pod shrink).

The template is the deploy one (8 GPUs, 32 CPUs, 256Gi, a 32 GiB object store, 48Gi of /dev/shm per pod); the
expected quantities are that pod's numbers times the ring's share, worked out by hand here.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from service.kuberay_jobs import rayjob_for
from service.launcher import LaunchRequest
from tests.support import deploy_helpers as dh
from tests.support.api_harness import TINY_SPEC
from workers.config import JobSpec

TEMPLATE_FILE = (
    Path(__file__).resolve().parents[3] / "deploy/k8s/overlays/kueue/rayjob-template.yaml"
)


def _template() -> dict[str, Any]:
    (doc,) = dh.load_yaml_docs(TEMPLATE_FILE.read_text())
    return doc


def _request(resources: dict[str, Any]) -> LaunchRequest:
    spec = {**TINY_SPEC, "parallel": {"ring_size": 2}, "resources": resources}
    return LaunchRequest(
        job_id="j0123456789ab",
        spec=JobSpec.model_validate(spec),
        control_url="http://ringtrain-api:8000",
        ingest_token="ingest",
        checkpoint_dir="/mnt/checkpoints",
    )


def _pod(job: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], str]:
    (group,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    spec = group["template"]["spec"]
    res = spec["containers"][0]["resources"]
    (shm,) = [v["emptyDir"]["sizeLimit"] for v in spec["volumes"] if "emptyDir" in v]
    return group["rayStartParams"], res["requests"], res["limits"], shm


def test_a_two_gpu_ring_books_a_quarter_of_an_eight_gpu_pod() -> None:
    tpl = _template()
    assert _pod({"spec": tpl["spec"]})[0] == {
        "num-cpus": "32",
        "object-store-memory": str(32 << 30),
    }  # the numbers below are a quarter of these
    params, requests, limits, shm = _pod(rayjob_for(tpl, _request({"accelerator": "gpu"})))
    quarter = {"cpu": "8", "memory": "65536Mi", "nvidia.com/gpu": "2"}  # 256Gi / 4 = 64 x 1024 Mi
    assert requests == quarter and limits == quarter
    assert params == {"num-cpus": "8", "object-store-memory": str(8 << 30)}
    assert shm == "12288Mi"  # 48Gi / 4


def test_the_shrunk_pod_keeps_the_cpus_its_ranks_ask_for() -> None:
    """Two ranks of 6 CPUs need 12, more than a quarter of the pod's 32: Ray's num-cpus and the container get 12."""
    params, requests, limits, _ = _pod(
        rayjob_for(_template(), _request({"accelerator": "gpu", "cpus_per_worker": 6}))
    )
    assert params["num-cpus"] == "12" and requests["cpu"] == limits["cpu"] == "12"


def test_decimal_memory_units_shrink_as_bytes() -> None:
    """ "64G" is 64 x 10^9 bytes: a quarter is 16 x 10^9 bytes, 15258.79 MiB, booked as 15259Mi."""
    tpl = copy.deepcopy(_template())
    (group,) = tpl["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    for kind in ("requests", "limits"):
        group["template"]["spec"]["containers"][0]["resources"][kind]["memory"] = "64G"
    _, requests, limits, _ = _pod(rayjob_for(tpl, _request({"accelerator": "gpu"})))
    assert requests["memory"] == limits["memory"] == "15259Mi"
