"""Evaluation requests and logs at their edges (service/evals.py), in process: a task named twice
runs once (and counts once in the sample total), a ring of 2 already runs under torchrun with 2
CPUs, and only a JSON object with both `tasks` and `by_length` is the report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from service.evals import EvalCreate, EvalService, parse_log


def accept(tmp_path: Path, **kw: Any) -> Any:
    svc = EvalService(None, None, None, [tmp_path], str(tmp_path / "ckpt"))  # type: ignore[arg-type]
    body = {"model": str(tmp_path / "m"), "lengths": [1024, 512, 1024], "samples": 3, **kw}
    return svc.accept("alice", EvalCreate.model_validate(body))


def test_a_task_named_twice_runs_once(tmp_path: Path) -> None:
    req = accept(tmp_path, tasks=["vt", "cwe", "vt"])
    assert req.tasks == ("vt", "cwe") and req.lengths == (512, 1024)
    assert req.total_samples() == 2 * 2 * 3
    assert req.args()[-2:] == ("--tasks", "vt,cwe")


def test_a_ring_of_two_runs_under_torchrun(tmp_path: Path) -> None:
    task = accept(tmp_path, tasks=["vt"], ring_size=2).task("e1")
    assert task.module == "torch.distributed.run" and task.cpus == 2.0
    assert task.args[:4] == ("--standalone", "--nproc-per-node=2", "-m", "workers.evals")
    alone = accept(tmp_path, tasks=["vt"]).task("e2")
    assert alone.module == "workers.evals" and alone.cpus == 1.0


def test_only_an_object_with_tasks_and_by_length_is_the_report() -> None:
    report = {"tasks": {"vt": {"512": 1.0}}, "by_length": {"512": 1.0}}
    log = "[eval] vt len=512 #0: score 1.00\n" + json.dumps(report) + "\n"
    log += json.dumps({"tasks": ["vt"], "note": "not a report"}) + "\n"
    assert parse_log(log) == (1, report, None)
