"""An evaluation on the cluster (`service.evals`) runs `python -m workers.evals` through the launcher
protocol (`Launcher.run_task`), and its row follows the task's status and what the evaluation
prints: the `[eval]` lines as progress, the last JSON report as the result, `error: ...` as the
reason it failed. A stand-in launcher plays the cluster; refusals store nothing; another owner's
evaluations and jobs do not exist for the caller."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from api.cli import main
from service.db import make_engine, migrate
from service.evals import RULER_TASKS, EvalCreate, EvalRefused, EvalService, parse_log
from service.launcher import DriverInfo, DriverStatus, TaskRequest
from service.store import Store
from tests.support.api_harness import ALICE, BOB, TINY_SPEC, RecordingLauncher, running
from workers.config import JobSpec

# what `python -m workers.evals` prints for two tasks at 512 and 1024 tokens, one sample each
REPORT = {
    "tasks": {"niah_single_noise": {"512": 1.0, "1024": 0.0}, "vt": {"512": 0.5, "1024": 0.0}},
    "by_length": {"512": 0.75, "1024": 0.0},
    "effective_length": 0,
    "threshold": 0.856,
}
SAMPLE = "[eval] vt len=512 #0: score 0.50 (497 tokens, 0.41 s)\n"


@dataclass
class StandIn:
    """The launcher protocol's task side, as a cluster the test plays: `play(sid, status, log)`;
    a forgotten submission is UNKNOWN, as to a replaced Ray head."""

    tasks: list[TaskRequest] = field(default_factory=list)
    played: dict[str, tuple[DriverStatus, str]] = field(default_factory=dict)
    refuse: str | None = None

    def run_task(self, task: TaskRequest) -> str:
        if self.refuse:
            raise RuntimeError(self.refuse)
        self.tasks.append(task)
        self.played.setdefault(task.submission_id, (DriverStatus.PENDING, ""))
        return task.submission_id

    def play(self, sid: str, status: DriverStatus, log: str = "") -> None:
        self.played[sid] = (status, log)

    def status(self, sid: str) -> DriverInfo:
        if sid not in self.played:
            return DriverInfo(DriverStatus.UNKNOWN, f"Ray does not know job {sid}")
        return DriverInfo(self.played[sid][0], "")

    def logs(self, sid: str) -> str:
        return self.played.get(sid, (None, ""))[1]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    engine = make_engine(f"sqlite:///{tmp_path}/ringtrain.db")
    migrate(engine)
    yield Store(engine)
    engine.dispose()


def service(store: Store, launcher: StandIn, tmp_path: Path) -> EvalService:
    return EvalService(store.evals, store.jobs, launcher, [tmp_path], str(tmp_path / "ckpt"))


def body(**kw: Any) -> EvalCreate:
    base: dict[str, Any] = {
        "lengths": [1024, 512],
        "samples": 1,
        "tasks": ["niah_single_noise", "vt"],
    }
    return EvalCreate.model_validate({**base, **kw})


def test_the_task_names_are_the_evaluations_own() -> None:
    from workers.evals.ruler import TASKS

    assert list(RULER_TASKS) == list(TASKS)


def test_the_task_runs_the_evaluation_alone_or_under_torchrun(store: Store, tmp_path: Path) -> None:
    cluster = StandIn()
    svc = service(store, cluster, tmp_path)
    model = str(tmp_path / "m")
    one = svc.create("alice", body(model=model, seed=3))
    two = svc.create("alice", body(model=model, ring_size=2, tasks=None, lengths=[4096, 2048]))
    t1, t2 = cluster.tasks
    args = [model, "--lengths", "512,1024", "--samples", "1", "--seed", "3"]
    assert shlex.split(t1.entrypoint("/py")) == [
        *("/py", "-m", "workers.evals", *args, "--tasks", "niah_single_noise,vt")
    ]
    ring = ["/py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert shlex.split(t2.entrypoint("/py")) == [
        *ring,
        *("-m", "workers.evals", model, "--lengths", "2048,4096", "--samples", "1"),
        *("--seed", "0"),
    ]
    assert (t1.cpus, t2.cpus) == (1.0, 2.0)
    assert t1.submission_id == f"ringtrain-eval-{one['id']}"
    assert t1.metadata == {"ringtrain_eval_id": one["id"]}
    assert (one["lengths"], one["tasks"], one["ring_size"]) == (
        [512, 1024],
        ["niah_single_noise", "vt"],
        1,
    )
    assert (two["tasks"], two["progress"]) == (None, {"samples_done": 0, "samples_total": 8 * 2})


def test_the_report_is_the_last_json_report_in_the_log() -> None:
    log = (
        "WARNING: torch.distributed.run: OMP_NUM_THREADS is set to 1\n"
        + "[W1205 07:10:11 socket.cpp:464] [c10d] The IPv6 network addresses cannot be retrieved\n"
        + SAMPLE * 3
        + json.dumps({"tasks": {}, "by_length": {}, "effective_length": 0, "threshold": 0.5})
        + "\n{not json\n"
        + json.dumps({"progress": 1})
        + "\n"
        + json.dumps(REPORT)
        + "\n[eval] trailing words\n"
    )
    assert parse_log(log) == (4, REPORT, None)
    failed = "Traceback (most recent call last):\nFileNotFoundError: no config.json in /m\n"
    assert parse_log(failed) == (0, None, "FileNotFoundError: no config.json in /m")
    # the evaluation's own refusal wins over torchrun's summary of the child that printed it
    own = "error: length 300 is too short\ntorch.distributed.elastic.ChildFailedError: x\n"
    assert parse_log(own) == (0, None, "length 300 is too short")


def test_the_row_follows_the_task_and_its_output(store: Store, tmp_path: Path) -> None:
    cluster = StandIn()
    svc = service(store, cluster, tmp_path)
    ev = svc.create("alice", body(model=str(tmp_path / "m")))
    sid = f"ringtrain-eval-{ev['id']}"
    assert (ev["state"], ev["result"], ev["error"]) == ("QUEUED", None, None)
    assert ev["progress"] == {"samples_done": 0, "samples_total": 4}
    cluster.play(sid, DriverStatus.RUNNING, SAMPLE)
    now = svc.get(ev["id"], "alice")
    assert now is not None and now["state"] == "RUNNING" and now["result"] is None
    assert now["progress"] == {"samples_done": 1, "samples_total": 4}
    cluster.play(sid, DriverStatus.SUCCEEDED, SAMPLE * 4 + json.dumps(REPORT) + "\n")
    done = svc.get(ev["id"], "alice")
    assert done is not None and (done["state"], done["error"]) == ("SUCCEEDED", None)
    assert done["result"] == REPORT and done["progress"]["samples_done"] == 4
    cluster.played.pop(sid)  # a finished row is never read from the cluster again
    assert svc.get(ev["id"], "alice") == done

    def ended(status: DriverStatus, log: str, forget: bool = False) -> dict[str, Any]:
        e = svc.create("alice", body(model=str(tmp_path / "m")))
        cluster.play(f"ringtrain-eval-{e['id']}", status, log)
        if forget:
            cluster.played.pop(f"ringtrain-eval-{e['id']}")
        got = svc.get(e["id"], "alice")
        assert got is not None and got["state"] == "FAILED" and got["result"] is None, got
        return got

    assert ended(DriverStatus.FAILED, "error: unknown task(s) x\n")["error"] == "unknown task(s) x"
    # exited 0 without a report (killed output, a wrong entrypoint): not a success
    assert "ended SUCCEEDED" in ended(DriverStatus.SUCCEEDED, SAMPLE)["error"]
    assert "ended STOPPED" in ended(DriverStatus.STOPPED, "")["error"]
    assert "no longer knows" in ended(DriverStatus.RUNNING, "", forget=True)["error"]
    cluster.refuse = "Request failed with status code 500: no space"
    refused = svc.create("alice", body(model=str(tmp_path / "m")))
    assert refused["state"] == "FAILED" and refused["error"].endswith("no space")
    listed = [e["id"] for e in svc.list("alice")]
    assert len(listed) == 6 and listed[-1] == ev["id"] and listed[0] == refused["id"]
    assert svc.get(ev["id"], "bob") is None and svc.list("bob") == []


def test_requests_that_cannot_run_are_refused_naming_the_field(
    store: Store, tmp_path: Path
) -> None:
    def field_of(**kw: Any) -> str:
        with pytest.raises(ValidationError) as e:
            body(model=str(tmp_path / "m"), **kw)
        return ".".join(str(p) for p in e.value.errors()[0]["loc"])

    assert field_of(suite="babilong") == "suite"
    assert field_of(lengths=[]) == "lengths"
    assert field_of(lengths=[512, 100]) == "lengths.1"
    assert field_of(samples=0) == "samples"
    assert field_of(ring_size=0) == "ring_size"
    assert field_of(tasks=["vt", "nope"]) == "tasks.1"
    assert field_of(extra=1) == "extra"

    svc = service(store, StandIn(), tmp_path)
    spec = JobSpec.model_validate(TINY_SPEC)
    mine, theirs = store.jobs.create("alice", spec, "t1"), store.jobs.create("bob", spec, "t2")

    def refusal(**kw: Any) -> tuple[int, str, str]:
        with pytest.raises(EvalRefused) as e:
            svc.create("alice", body(**kw))
        return e.value.status, e.value.field, e.value.message

    assert refusal(model="/etc")[:2] == (422, "model")
    assert refusal(model=str(tmp_path / ".." / "elsewhere"))[:2] == (422, "model")
    assert refusal()[:2] == (422, "model")  # neither
    assert refusal(model=str(tmp_path / "m"), job=mine.id)[:2] == (422, "model")  # both
    # the whole suite below the length every task fits
    assert refusal(model=str(tmp_path / "m"), tasks=None)[:2] == (422, "lengths.0")
    no_model = refusal(job=mine.id)
    assert no_model[:2] == (422, "job") and "no exported model" in no_model[2]
    assert refusal(job=theirs.id) == (404, "job", f"no job {theirs.id}")
    assert refusal(job="j000000000000") == (404, "job", "no job j000000000000")
    assert store.evals.ids("alice") == []  # nothing stored on refusal

    exported = tmp_path / "ckpt" / mine.id / "model"
    exported.mkdir(parents=True)
    ev = svc.create("alice", body(job=mine.id))
    assert (ev["job"], ev["model"], ev["state"]) == (mine.id, str(exported), "QUEUED")
    # the whole suite from 2048 tokens on is fine
    assert svc.create("alice", body(job=mine.id, tasks=None, lengths=[2048]))["tasks"] is None


def test_the_api_maps_refusals_and_hides_other_owners(tmp_path: Path) -> None:
    """Through the real server: 201 with the row, 422/404 in the shared error shape naming the
    field, nothing stored on refusal, another owner's eval a 404."""
    model = str(tmp_path / "m")
    ok = {"model": model, "lengths": [512], "samples": 1, "tasks": ["vt"]}
    with running(tmp_path) as srv, srv.client() as c:
        job = c.post("/v1/jobs", json=TINY_SPEC).json()["id"]
        cases = {
            "lengths.0": {**ok, "lengths": [8]},
            "samples": {**ok, "samples": 0},
            "model": {**ok, "model": "/etc"},
            "job": {"lengths": [512], "tasks": ["vt"], "job": job},
        }
        for name, bad in cases.items():
            r = c.post("/v1/evals", json=bad)
            assert r.status_code == 422 and r.json()["error"]["field"] == name, r.text
        assert c.get("/v1/evals").json() == []
        r = c.post("/v1/evals", json=ok)
        assert r.status_code == 201, r.text
        ev = r.json()
        # the recording launcher's tasks run (and never end)
        assert ev["state"] == "RUNNING" and ev["model"] == model and ev["suite"] == "ruler"
        assert (ev["samples"], ev["ring_size"], ev["seed"], ev["job"]) == (1, 1, 0, None)
        assert [e["id"] for e in c.get("/v1/evals").json()] == [ev["id"]]
        with srv.client(BOB) as bob:
            r = bob.post("/v1/evals", json={"lengths": [512], "tasks": ["vt"], "job": job})
            assert r.status_code == 404 and r.json()["error"]["field"] == "job", r.text
            assert bob.get(f"/v1/evals/{ev['id']}").status_code == 404
            assert bob.get("/v1/evals").json() == []
        assert c.get(f"/v1/evals/{ev['id']}").json()["id"] == ev["id"]


class Finished(RecordingLauncher):
    """Every task has run and printed REPORT."""

    def status(self, submission_id: str) -> DriverInfo:
        return DriverInfo(DriverStatus.SUCCEEDED)

    def logs(self, submission_id: str) -> str:
        return SAMPLE + json.dumps(REPORT) + "\n"


def test_the_cli_runs_it_on_the_cluster_and_prints_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    launcher = Finished()
    (tmp_path / "m").mkdir()
    with running(tmp_path, launcher) as srv:
        argv = ["eval", str(tmp_path / "m"), "--on-cluster", "--lengths", "512,1024"]
        argv += ["--samples", "1", "--tasks", "niah_single_noise,vt", "--ring-size", "2"]
        argv += ["--url", srv.url, "--token", ALICE, "--poll-s", "0.01", "--json"]
        assert main(argv) == 0
        assert json.loads(capsys.readouterr().out) == REPORT
        (task,) = launcher.tasks
        assert task.module == "torch.distributed.run" and str(tmp_path / "m") in task.args
        # a job id is sent as `job`: another owner's (or a missing) one is refused
        assert main([*argv[:1], "j000000000000", *argv[2:]]) == 1
        assert "(field job)" in capsys.readouterr().err
