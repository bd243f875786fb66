"""What the tracking export sends, in process (service/tracking.py), without a tracking server: the
spec as params, the MLflow calls' fields (milliseconds, step, run status), TensorBoard's event
files read back, and one sink worker's pass over the store (NaN for a stored null, the model path
only for a SUCCEEDED job, a resume re-exports once, the outage noted once and its recovery).

MLflow's client is a recording fake (no tracking server); the entities it is handed are MLflow's own
(`mlflow.entities.Param`, `Metric`), so an argument order that drifts from MLflow's fails here."""

from __future__ import annotations

import math
import time
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from tenacity import Retrying, stop_after_attempt

from service.store import Event, Store
from service.tracking import (
    Exporter,
    JobView,
    MlflowSink,
    Point,
    Sink,
    TensorBoardSink,
    _SinkWorker,
    flatten,
)
from tests.support.stores import sqlite_store
from tests.unit.service.test_store import SPEC, metric, state

JOB = JobView(
    id="j1",
    name="tiny-run",
    owner="alice",
    state="SUCCEEDED",
    spec={"model": {"d_model": 64, "extra": {}}, "tags": ["a", "b"], "lr": 0.001, "note": None},
    created_at=1700000000.25,
    finished_at=1700000100.5,
    model_path="/models/j1",
)


def test_flatten_spec_into_params() -> None:
    assert flatten(JOB.spec) == {
        "model.d_model": "64",
        "model.extra": "{}",
        "tags": '["a", "b"]',
        "lr": "0.001",
        "note": "null",
    }


def test_point_tags_name_the_rank_including_rank_zero() -> None:
    assert Point(1, 2, "loss", None, 1.5, 0.0).tag == "loss"
    assert Point(1, 2, "mem_peak_bytes", 0, 1.5, 0.0).tag == "mem_peak_bytes/rank0"
    assert Point(1, 2, "mem_peak_bytes", 3, 1.5, 0.0).tag == "mem_peak_bytes/rank3"


# --- MLflow: the calls a sink makes ----------------------------------------------------------


def _metric(m: Any) -> tuple[str, float, int, int]:
    return (m.key, m.value, m.timestamp, m.step)


class _Info:
    def __init__(self, run_id: str) -> None:
        self.run_id = run_id


class _Run:
    def __init__(self, run_id: str) -> None:
        self.info = _Info(run_id)


class FakeMlflow:
    """MlflowClient's methods the sink uses, recording their arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.n = 0

    def get_experiment_by_name(self, name: str) -> Any:
        return types.SimpleNamespace(experiment_id=7)

    def search_runs(self, exps: list[str], filter_string: str) -> list[_Run]:
        self.calls.append(("search", (exps, filter_string)))
        return [_Run("old-run")]

    def delete_run(self, run_id: str) -> None:
        self.calls.append(("delete", run_id))

    def create_run(self, exp: str, **kw: Any) -> _Run:
        self.n += 1
        self.calls.append(("create", (exp, kw)))
        return _Run(f"run{self.n}")

    def log_batch(self, run_id: str, metrics: Any = (), params: Any = (), **kw: Any) -> None:
        self.calls.append(("batch", (run_id, list(metrics), list(params))))

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self.calls.append(("tag", (run_id, key, value)))

    def set_terminated(self, run_id: str, status: str, end_time: int) -> None:
        self.calls.append(("end", (run_id, status, end_time)))


@pytest.fixture
def mlflow_sink() -> tuple[MlflowSink, FakeMlflow]:
    sink = MlflowSink.__new__(MlflowSink)
    fake = FakeMlflow()
    sink.client, sink.experiment, sink._exp_id, sink.runs = fake, "exp", None, {}
    return sink, fake


def test_mlflow_run_params_and_metrics(mlflow_sink: tuple[MlflowSink, FakeMlflow]) -> None:
    sink, fake = mlflow_sink
    spec = {f"p{i:03d}": "v" * (7000 if i == 0 else 3) for i in range(205)}
    job = JobView(**{**JOB.__dict__, "spec": spec})
    sink.begin(job)
    kinds = [k for k, _ in fake.calls]
    assert kinds == ["search", "delete", "create", "batch", "batch", "batch"]
    assert fake.calls[1] == ("delete", "old-run")  # the earlier export is replaced
    exp, kw = fake.calls[2][1]
    assert exp == "7" and kw["run_name"] == "tiny-run"
    assert kw["start_time"] == 1700000000250  # milliseconds
    assert kw["tags"] == {"ringtrain.job_id": "j1", "ringtrain.owner": "alice"}
    batches = [c[1][2] for c in fake.calls[3:]]
    assert [len(b) for b in batches] == [100, 100, 5]  # 205 params, 100 per call, none lost
    sent = [p for b in batches for p in b]
    assert [p.key for p in sent] == sorted(spec)
    assert len(sent[0].value) == 6000 and sent[1].value == "vvv"  # MLflow's 6000-char limit

    fake.calls.clear()
    points = [Point(10 + i, 1 + i, "loss", None, 2.5 - i, 1700000001.5 + i) for i in range(1001)]
    points[3] = Point(13, 4, "mem", 2, 8.0, 1700000004.5)
    sink.write(job, points)
    batches = [c[1][1] for c in fake.calls]
    assert [c[1][0] for c in fake.calls] == ["run1", "run1"]
    assert [len(b) for b in batches] == [1000, 1]
    assert _metric(batches[0][0]) == ("loss", 2.5, 1700000001500, 1)
    assert _metric(batches[0][3]) == ("mem/rank2", 8.0, 1700000004500, 4)
    assert _metric(batches[1][0]) == ("loss", 2.5 - 1000, 1700001001500, 1001)


@pytest.mark.parametrize(
    ("state", "model_path", "status", "tagged"),
    [
        ("SUCCEEDED", "/models/j1", "FINISHED", True),
        ("CANCELLED", None, "KILLED", False),
        ("FAILED", None, "FAILED", False),
    ],
)
def test_mlflow_run_end(
    mlflow_sink: tuple[MlflowSink, FakeMlflow],
    state: str,
    model_path: str | None,
    status: str,
    tagged: bool,
) -> None:
    sink, fake = mlflow_sink
    job = JobView(**{**JOB.__dict__, "state": state, "model_path": model_path})
    sink.runs["j1"] = "r9"
    sink.finish(job)
    expect = [("tag", ("r9", "ringtrain.model_path", "/models/j1"))] if tagged else []
    assert fake.calls == [*expect, ("end", ("r9", status, 1700000100500))]
    assert "j1" not in sink.runs


# --- TensorBoard: event files read back ------------------------------------------------------


def test_tensorboard_scalars_by_step(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    sink = TensorBoardSink(tmp_path)
    sink.begin(JOB)
    sink.write(JOB, [Point(40, 3, "loss", None, 2.25, 1700000003.0)])
    sink.write(JOB, [Point(41, 3, "mem", 1, 7.0, 1700000003.5)])
    sink.finish(JOB)
    (f,) = (tmp_path / "j1").iterdir()
    scalars, texts = [], []
    for ev in EventFileLoader(str(f)).Load():
        for v in ev.summary.value:
            if v.metadata.plugin_data.plugin_name == "scalars":  # the loader's form of a scalar
                scalars.append((v.tag, ev.step, v.tensor.float_val[0], ev.wall_time))
            else:
                texts.append((v.tag, v.tensor.string_val[0].decode()))
    assert scalars == [("loss", 3, 2.25, 1700000003.0), ("mem/rank1", 3, 7.0, 1700000003.5)]
    assert [tag for tag, _ in texts] == ["spec", "result"]
    assert "| model.d_model | 64 |" in texts[0][1]
    assert texts[1][1] == "state SUCCEEDED; model: /models/j1"


# --- one sink worker's passes over the store -------------------------------------------------


class RecordingSink:
    name = "rec"

    def __init__(self) -> None:
        self.calls: list[tuple[str, JobView, list[Point]]] = []
        self.fail_writes = 0

    def begin(self, job: JobView) -> None:
        self.calls.append(("begin", job, []))

    def write(self, job: JobView, points: Sequence[Point]) -> None:
        if self.fail_writes:
            self.fail_writes -= 1
            raise ConnectionError("tracker down")
        self.calls.append(("write", job, list(points)))

    def finish(self, job: JobView) -> None:
        self.calls.append(("finish", job, []))

    def close(self) -> None:
        pass

    def kinds(self) -> list[str]:
        return [k for k, _, _ in self.calls]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with sqlite_store(tmp_path) as store:
        yield store


def worker(store: Store, sink: RecordingSink, notes: list[str]) -> _SinkWorker:
    w = _SinkWorker(
        sink, store, lambda jid: f"/models/{jid}", lambda jid, line: notes.append(line), 0.0, 1.0
    )
    w._retrying = lambda: Retrying(stop=stop_after_attempt(2), reraise=True)  # type: ignore[method-assign]
    return w


def test_a_pass_sends_nan_for_a_stored_null_and_the_model_path_only_on_success(
    store: Store,
) -> None:
    sink, notes = RecordingSink(), []
    w = worker(store, sink, notes)
    job = store.jobs.create("alice", SPEC, "tok")
    store.metrics.apply_report(job.id, [state(1, "RUNNING"), metric(2, 1, value=3.5)])
    store.metrics.apply_report(job.id, [metric(3, 2, value=math.inf), metric(4, 2, "mem", 7.0, 0)])
    assert w._sync(job.id)
    assert sink.kinds() == ["begin", "write"]
    assert sink.calls[0][1].model_path is None  # RUNNING: no model yet
    got = [(p.step, p.tag, p.value) for p in sink.calls[1][2]]
    assert got[0] == (1, "loss", 3.5) and got[2] == (2, "mem/rank0", 7.0)
    assert got[1][:2] == (2, "loss") and math.isnan(got[1][2])

    assert w._sync(job.id) and sink.kinds() == ["begin", "write"]  # nothing new: no call
    store.metrics.apply_report(job.id, [state(5, "SUCCEEDED", reason="done")])
    assert w._sync(job.id)
    assert sink.kinds()[2:] == ["finish"]
    assert sink.calls[2][1].model_path == f"/models/{job.id}"
    assert w._sync(job.id) and len(sink.calls) == 3  # exported to the end: never again

    ended = store.jobs.create("alice", SPEC, "tok")
    store.metrics.apply_report(ended.id, [state(1, "RUNNING"), metric(2, 1)])
    store.metrics.apply_report(ended.id, [state(3, "CANCELLED", reason="user")])
    assert w._sync(ended.id)
    assert [(k, j.model_path) for k, j, _ in sink.calls[3:]] == [
        ("begin", None),
        ("write", None),
        ("finish", None),
    ]


def test_a_resume_re_exports_once(store: Store) -> None:
    sink, notes = RecordingSink(), []
    w = worker(store, sink, notes)
    job = store.jobs.create("alice", SPEC, "tok")
    store.metrics.apply_report(
        job.id, [state(1, "RUNNING"), *[metric(2 + i, i + 1) for i in range(4)]]
    )
    assert w._sync(job.id) and sink.kinds() == ["begin", "write"]
    store.metrics.apply_report(job.id, [state(6, "RETRYING", reason="rank lost", resume_step=2)])
    assert w._sync(job.id)
    assert sink.kinds() == ["begin", "write", "begin", "write"]  # from scratch: steps 1..2
    assert [p.step for p in sink.calls[3][2]] == [1, 2]
    assert w._sync(job.id)  # the same resume, seen already: no new run
    assert sink.kinds() == ["begin", "write", "begin", "write"]


def test_an_outage_is_noted_once_and_its_recovery_once(store: Store) -> None:
    sink, notes = RecordingSink(), []
    w = worker(store, sink, notes)
    job = store.jobs.create("alice", SPEC, "tok")
    store.metrics.apply_report(job.id, [state(1, "RUNNING"), metric(2, 1)])
    sink.fail_writes = 4  # two passes of two attempts each
    assert not w._sync(job.id)
    assert len(notes) == 1  # noted on the first failed pass
    assert not w._sync(job.id)
    assert len(notes) == 1 and "export to rec failing (ConnectionError: tracker down)" in notes[0]
    assert w._sync(job.id)
    assert len(notes) == 2 and "recovered" in notes[1]
    assert [len(pts) for k, _, pts in sink.calls if k == "write"] == [1]  # sent once, complete
    assert w._sync(job.id) and len(notes) == 2


def test_notify_marks_on_non_log_events_and_resets_on_a_resume(store: Store) -> None:
    marks: list[tuple[str, bool]] = []

    class Marker:
        def mark(self, job_id: str, reset: bool) -> None:
            marks.append((job_id, reset))

    ex = Exporter(store, lambda: [], model_path=str, note=lambda jid, line: None)
    ex.workers = [Marker()]  # type: ignore[list-item]
    log = Event(5, "log", {"line": "export failing"})
    ex.notify("j1", [log])
    assert marks == []  # our own notes do not re-trigger an export
    ex.notify("j1", [log, Event(6, "metric", {"step": 1})])
    ex.notify("j1", [Event(7, "state", {"to": "RUNNING", "resume_step": None})])
    ex.notify("j1", [Event(8, "state", {"to": "RETRYING", "resume_step": 3})])
    assert marks == [("j1", False), ("j1", False), ("j1", True)]


def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)


def test_the_sweep_exports_a_job_written_without_a_notice(store: Store) -> None:
    """No bus listener and no `remote` notice (another replica wrote): only the sweep, which marks
    the jobs whose next event seq moved since its last pass, brings the new points out."""
    sink = RecordingSink()

    def sinks() -> list[Sink]:
        return [sink]

    job = store.jobs.create("alice", SPEC, "tok")
    store.metrics.apply_report(job.id, [state(1, "RUNNING"), metric(2, 1)])
    ex = Exporter(store, sinks, str, lambda jid, line: None, flush_s=0.0, sweep_s=60.0)
    ex.start()  # the first sweep exports the active job; the next ones only when woken
    try:
        sent = lambda: sum(len(p) for k, _, p in sink.calls if k == "write")
        until(lambda: sent() == 1 and ex._swept.is_set())
        store.metrics.apply_report(job.id, [metric(3, 2), metric(4, 3)])
        ex.remote(None)  # "something changed somewhere": one sweep
        until(lambda: sent() == 3, timeout=3.0)
        assert sink.kinds() == ["begin", "write", "write"]
    finally:
        ex.stop()


def test_a_finished_job_is_exported_again_only_when_a_reset_asks(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A late mark of a finished job changes nothing; a reset (a new term's catch-up) exports it
    from scratch. The worker remembers the newest DONE_KEPT finished jobs, dropping the oldest."""
    monkeypatch.setattr("service.tracking.DONE_KEPT", 2)
    sink, notes = RecordingSink(), []
    w = worker(store, sink, notes)
    ids = []
    for _ in range(3):
        job = store.jobs.create("alice", SPEC, "tok")
        store.metrics.apply_report(job.id, [state(1, "RUNNING"), metric(2, 1)])
        store.metrics.apply_report(job.id, [state(3, "SUCCEEDED", reason="done")])
        assert w._sync(job.id)
        ids.append(job.id)
    assert list(w.done) == ids[1:]  # the oldest forgotten
    n = len(sink.calls)
    assert w._sync(ids[2]) and len(sink.calls) == n  # a late mark: nothing sent again
    w.mark(ids[2], True)
    with w.cond:
        w.pending.clear()  # the pass below is this test's, not a thread's
    assert w._sync(ids[2])
    assert sink.kinds()[n:] == ["begin", "write", "finish"]
