"""The launcher protocol's plain values (service/launcher.py) with known answers: a task's
submission id (unsafe characters replaced, at most 100 of the task's), its shell-quoted entry
point, and which driver statuses are finished (PREEMPTED is not: the submission comes back)."""

from __future__ import annotations

from service.launcher import DriverStatus, TaskRequest


def test_submission_id_and_entrypoint() -> None:
    t = TaskRequest("eval e1/x y", "workers.evals", ("/data/my model", "--lengths", "512"))
    assert t.submission_id == "ringtrain-eval-e1-x-y"
    assert TaskRequest("a" * 150, "m").submission_id == "ringtrain-" + "a" * 100
    assert TaskRequest("A_b-9", "m").submission_id == "ringtrain-A_b-9"
    assert t.entrypoint("/py") == "/py -m workers.evals '/data/my model' --lengths 512"


def test_finished_statuses() -> None:
    done = {s.value for s in DriverStatus if s.finished}
    assert done == {"STOPPED", "SUCCEEDED", "FAILED", "UNKNOWN"}
