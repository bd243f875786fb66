"""REST datasets: POST /v1/datasets prepares on a real Ray head (a Ray job), GET lists and shows counts, SSE
streams progress; paths outside the data roots and other owners' datasets are refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from service.local_ray import RayHead
from service.ray_jobs import RayJobLauncher
from tests.support.api_harness import BOB, running, wait_for
from workers.data import open_dataset

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]


def test_prepare_list_show_and_follow_a_dataset(ray_head: RayHead, tmp_path: Path) -> None:
    launcher = RayJobLauncher(
        ray_head.jobs_url,
        auth_token=ray_head.auth_token,
        python=sys.executable,
        extra_env={"PYTHONPATH": str(ROOT)},
    )
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": f"document number {i}"}) + "\n" for i in range(20)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    with running(tmp_path, launcher, data_roots=[str(tmp_path)]) as srv, srv.client() as c:
        r = c.post("/v1/datasets", json={"source": str(src), "out": str(tmp_path / "ds")})
        assert r.status_code == 201, r.text
        ds = r.json()
        assert ds["state"] in ("QUEUED", "RUNNING") and ds["format"] == "text"

        events = []
        with c.stream("GET", f"/v1/datasets/{ds['id']}/events", timeout=300) as stream:
            for line in stream.iter_lines():
                if line.startswith("event: "):
                    events.append(line[len("event: ") :])
        assert events[0] == "progress" and events[-1] == "done"

        done = c.get(f"/v1/datasets/{ds['id']}").json()
        assert done["state"] == "SUCCEEDED", done
        prepared = open_dataset(tmp_path / "ds")
        assert done["documents"] == len(prepared) == 20 and done["tokens"] == prepared.num_tokens
        assert done["dataset_id"] == prepared.id and done["progress"]["stage"] == "done"
        listed = c.get("/v1/datasets").json()
        assert [d["id"] for d in listed] == [ds["id"]] and listed[0]["documents"] == 20

        failing = c.post(
            "/v1/datasets", json={"source": str(bad), "out": str(tmp_path / "bad-ds")}
        ).json()
        final = wait_for(
            lambda: (
                (d := c.get(f"/v1/datasets/{failing['id']}").json())["state"]
                in ("SUCCEEDED", "FAILED")
                and d
            ),
            timeout=300,
            interval=0.5,
        )
        # named by file and line through the Ray tasks, nothing left at --out (the CLI's Ray run
        # relies on this check: tests/unit/workers/data/test_prepare.py)
        assert final["state"] == "FAILED" and f"{bad}:2: not a JSON object" in final["error"]
        assert not (tmp_path / "bad-ds").exists() and not list(tmp_path.glob(".bad-ds.*"))

        outside = c.post("/v1/datasets", json={"source": "/etc/passwd", "out": str(tmp_path / "x")})
        assert outside.status_code == 422 and outside.json()["error"]["field"] == "source"
        with srv.client(BOB) as bob:
            assert bob.get(f"/v1/datasets/{ds['id']}").status_code == 404
            assert bob.get("/v1/datasets").json() == []
