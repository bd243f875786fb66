"""Elastic jobs through the real server: stored as given when their smallest shape fits, and a
422 naming the field when it cannot work (a floor above the world, a smallest shape over a
device's memory, Kueue mode)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.launcher import ClusterInfo, NodeInfo
from service.planner import GIB
from tests.support.api_harness import RecordingLauncher, running
from workers.config import JobSpec

SPEC: dict[str, Any] = {
    "name": "elastic",
    "model": {"d_model": 64, "n_layers": 2, "n_heads": 4},
    "data": {"kind": "passkey", "seq_len": 4096, "key_digits": 3},
    "parallel": {"ring_size": 2, "data_parallel": 2},
    "train": {"steps": 4, "batch_size": 2},
    "elastic": {"enabled": True, "min_world_size": 1},
}


def nodes(memory_gib: float) -> list[NodeInfo]:
    return [NodeInfo("n0", "10.0.0.1", True, 8, 8, 0, 0, memory_bytes=memory_gib * GIB)]


@dataclass
class KueueLauncher(RecordingLauncher):
    def cluster(self) -> ClusterInfo:
        return ClusterInfo(nodes=[], per_job_clusters=True)


def refused(r: Any, field: str, words: str) -> None:
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["field"] == field and words in err["message"], err


def test_elastic_jobs_are_stored_or_refused_naming_the_field(tmp_path: Path) -> None:
    with running(tmp_path / "a", RecordingLauncher(nodes=nodes(64))) as srv:
        c = srv.client()
        r = c.post("/v1/jobs", json=SPEC)
        assert r.status_code == 201, r.text
        assert c.get("/v1/jobs").json()["total"] == 1
        stored = JobSpec.model_validate(r.json()["spec"])
        assert stored.elastic.enabled and stored.elastic.min_world_size == 1 and stored.elastic.grow
        refused(
            c.post("/v1/jobs", json={**SPEC, "elastic": {"enabled": True, "min_world_size": 5}}),
            "elastic.min_world_size",
            "larger than the job's world",
        )
        refused(
            c.post("/v1/jobs", json={**SPEC, "elastic": {"enabled": True, "min_world_size": 4}}),
            "elastic.min_world_size",
            "could never shrink",
        )
        assert c.get("/v1/jobs").json()["total"] == 1  # nothing half-written
    # 8 CPUs share 0.1 GiB: a bundle's share fits no shape of this job, the smallest least of all
    with running(tmp_path / "b", RecordingLauncher(nodes=nodes(0.1))) as srv:
        refused(srv.client().post("/v1/jobs", json=SPEC), "elastic.min_world_size", "GiB per rank")
    with running(tmp_path / "c", KueueLauncher()) as srv:
        refused(srv.client().post("/v1/jobs", json=SPEC), "elastic.enabled", "Kueue")
