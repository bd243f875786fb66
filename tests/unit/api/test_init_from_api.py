"""`init_from` at submission, through the real server: resolved to the source job's checkpoint
directory and step, or refused with a 422 naming the field, and nothing created."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.api_harness import ALICE, BOB, TINY_SPEC, running


def _checkpoint(root: Path, job: str, *steps: int) -> Path:
    where = root / "ckpt" / job
    for step in steps:
        (where / f"step-{step:06d}").mkdir(parents=True)
        (where / f"step-{step:06d}" / "state.pt").write_bytes(b"marker")
    (where / "step-000012").mkdir()  # no completion marker: never a source
    return where


def _with(init_from: dict[str, Any], **over: Any) -> dict[str, Any]:
    return {**TINY_SPEC, **over, "init_from": init_from}


def test_init_from_is_resolved_or_refused_naming_the_field(tmp_path: Path) -> None:
    with running(tmp_path) as srv, srv.client() as alice, srv.client(BOB) as bob:
        source = alice.post("/v1/jobs", json=TINY_SPEC).json()["id"]
        empty = alice.post("/v1/jobs", json=TINY_SPEC).json()["id"]
        where = _checkpoint(tmp_path, source, 4, 8)
        bad: list[tuple[Any, dict[str, Any], str, str]] = [
            (bob, _with({"job": source}), "init_from.job", "no job"),  # another owner's
            (alice, _with({"job": "nope"}), "init_from.job", "no job nope"),
            (alice, _with({"job": empty}), "init_from.job", "no complete checkpoint"),
            (alice, _with({"job": source, "step": 5}), "init_from.step", "steps 4, 8"),
            (alice, _with({"job": source, "step": 12}), "init_from.step", "steps 4, 8"),
            (
                alice,
                _with({"job": source}, model={"d_model": 64, "n_layers": 1, "n_heads": 2}),
                "init_from.job",
                "d_model 32 -> 64",
            ),
            (alice, _with({"checkpoint": str(where)}), "init_from.checkpoint", "init_from.job"),
            (alice, _with({"checkpoint": "/etc"}), "init_from.checkpoint", "data roots"),
            (alice, _with({}), "init_from", "a job or a checkpoint"),
            (alice, _with({"job": source, "state": "all"}), "init_from.state", ""),
            (
                alice,
                _with({"job": source, "state": "full"}),  # continues at 9, but steps is 5
                "init_from.state",
                "train.steps is 5",
            ),
        ]
        for client, spec, field, words in bad:
            r = client.post("/v1/jobs", json=spec)
            assert r.status_code == 422, (spec["init_from"], r.text)
            body = r.json()["error"]
            assert body["field"] == field and words in body["message"], (spec["init_from"], body)
        assert alice.get("/v1/jobs").json()["total"] == 2  # nothing half-written
        assert bob.get("/v1/jobs").json()["total"] == 0

        latest = alice.post("/v1/jobs", json=_with({"job": source})).json()
        assert latest["spec"]["init_from"] == {
            "job": source,
            "checkpoint": str(where.resolve()),
            "step": 8,
            "state": "weights",
        }
        earlier = _with({"job": source, "step": 4, "state": "full"}, train={"steps": 20})
        r = alice.post("/v1/jobs", json=earlier)
        assert r.status_code == 201, r.text
        assert r.json()["spec"]["init_from"]["step"] == 4
        assert ALICE  # the harness's default client is Alice's
