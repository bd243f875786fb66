"""POST /v1/plan with fit (wrapped body and query forms), its 422 with the shortfall, and
`parallel.ring_size: auto` resolved and stored at submission. Budgets bracket the estimates of
tests/unit/service/test_fit.py's model (ring 2 cannot fit 0.76 GiB, ring 4 with full can)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from api.cli import main
from service.launcher import NodeInfo
from service.planner import GIB
from tests.support.api_harness import ALICE, RecordingLauncher, running

SPEC: dict[str, Any] = {
    "name": "fit",
    "model": {"d_model": 256, "n_layers": 4, "n_heads": 8},
    "data": {"kind": "passkey", "seq_len": 65536},
    "parallel": {"ring_size": 2},
    "train": {"steps": 5},
}


def nodes(count: int, cpus: int) -> list[NodeInfo]:
    mem = 12 * GIB
    return [
        NodeInfo(f"n{i}", f"10.0.0.{i}", True, cpus, cpus, 0, 0, memory_bytes=mem)
        for i in range(count)
    ]


def test_plan_fit_and_ring_auto(tmp_path):
    with running(tmp_path, RecordingLauncher(nodes=nodes(2, 8))) as srv:
        c = srv.client()
        r = c.post("/v1/plan", json={"spec": SPEC, "fit": {"memory_per_rank_gib": 0.76}})
        assert r.status_code == 200, r.text
        p = r.json()
        assert p["valid"] and p["fit"]["fits"] and p["fit"]["budget_source"] == "given"
        assert (p["fit"]["ring_size"], p["fit"]["ulysses_size"]) == (4, 1)
        assert p["fit"]["knobs_name"] == "full" and p["world_size"] == 4
        assert p["spec"]["parallel"]["ring_size"] == 4
        assert p["spec"]["train"]["activation_checkpointing"] == "full"
        assert p["memory"]["total_bytes"] == p["fit"]["estimate_bytes"] <= 0.76 * GIB
        assert any(a["ring_size"] == 2 and not a["fits"] for a in p["fit"]["alternatives"])

        q = c.post("/v1/plan", json=SPEC, params={"fit_memory_per_rank_gib": 0.76}).json()
        assert q["spec"] == p["spec"]

        # no budget: a bundle's share of node memory, 12 GiB / 8 CPUs = 1.5 GiB
        d = c.post("/v1/plan", json={"spec": SPEC, "fit": {}}).json()
        assert d["fit"]["memory_per_rank_bytes"] == 1.5 * GIB
        assert d["fit"]["ring_size"] == 1 and d["fit"]["knobs_name"] == "full+tiled"

        bad = c.post("/v1/plan", json={"spec": SPEC, "fit": {}, "extra": 1})
        assert bad.status_code == 422 and bad.json()["error"]["field"] == "extra"
        bad = c.post("/v1/plan", json={"spec": SPEC, "fit": {"memory_per_rank_gib": -1}})
        assert bad.status_code == 422
        assert bad.json()["error"]["field"] == "fit.memory_per_rank_gib"

        auto = {**SPEC, "parallel": {"ring_size": "auto"}}
        r = c.post("/v1/jobs", json=auto)
        assert r.status_code == 201, r.text
        stored = c.get(f"/v1/jobs/{r.json()['id']}").json()["spec"]
        assert stored["parallel"]["ring_size"] == 1
        assert stored["train"]["activation_checkpointing"] == "full"
        assert stored["train"]["tiled_mlp"] == "auto"


def test_plan_fit_nothing_fits_is_422_with_the_shortfall(tmp_path):
    with running(tmp_path, RecordingLauncher(nodes=nodes(1, 4))) as srv:
        c = srv.client()
        r = c.post("/v1/plan", json={"spec": SPEC, "fit": {"memory_per_rank_gib": 0.45}})
        assert r.status_code == 422, r.text
        body = r.json()
        assert body["error"]["field"] == "fit.memory_per_rank_gib"
        short = body["fit"]["shortfall_bytes"]
        assert short > 0 and body["fit"]["ring_size"] == 4 and not body["fit"]["fits"]
        assert f"{short} bytes ({short / GIB:.2f} GiB) over" in body["error"]["message"]
        assert "16 devices" in body["error"]["message"]
        r = c.post("/v1/jobs", json={**SPEC, "parallel": {"ring_size": "auto"}})
        assert r.status_code == 201  # 4 GiB per bundle here: ring 1 fits


def test_cli_plan_fit(tmp_path, capsys, monkeypatch: pytest.MonkeyPatch):
    spec = Path(tmp_path / "spec.json")
    spec.write_text(json.dumps(SPEC))
    with running(tmp_path, RecordingLauncher(nodes=nodes(2, 8))) as srv:
        monkeypatch.setenv("RINGTRAIN_URL", srv.url)
        monkeypatch.setenv("RINGTRAIN_TOKEN", ALICE)
        assert main(["plan", str(spec), "--fit", "--memory-per-rank", "0.76"]) == 0
        out = capsys.readouterr().out
        assert "fit: ring_size 4 x ulysses_size 1, knobs full" in out and "of 0.76 GiB" in out
        assert main(["plan", str(spec), "--fit", "--json"]) == 0
        fitted = json.loads(capsys.readouterr().out)["fit"]
        assert fitted["ring_size"] == 1 and fitted["memory_per_rank_bytes"] == 1.5 * GIB
        assert main(["plan", str(spec), "--memory-per-rank", "0.01"]) == 1
        assert "over" in capsys.readouterr().err


def test_ring_auto_on_gpus_of_unknown_memory_names_what_to_give(tmp_path):
    gpus = [NodeInfo("g0", "10.0.0.9", True, 32, 32, 4, 4)]  # no GPU memory reported
    with running(tmp_path, RecordingLauncher(nodes=gpus)) as srv:
        c = srv.client()
        r = c.post("/v1/jobs", json={**SPEC, "parallel": {"ring_size": "auto"}})
        assert r.status_code == 422 and r.json()["error"]["field"] == "parallel.ring_size"
        assert "does not report its GPUs' memory" in r.json()["error"]["message"]
        assert "--memory-per-rank" in r.json()["error"]["message"]
        r = c.post("/v1/plan", json={"spec": SPEC, "fit": {}})
        assert r.status_code == 422 and r.json()["error"]["field"] == "fit.memory_per_rank_gib"
        r = c.post("/v1/plan", json={"spec": SPEC, "fit": {"memory_per_rank_gib": 0.3}})
        assert r.status_code == 200 and r.json()["fit"]["ulysses_size"] > 1
