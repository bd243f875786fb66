"""Opt-in export of every job to the trackers teams already use: MLflow (a tracking URI) and
TensorBoard (event files, one directory per job).

What goes out per job: every metric point (per-rank metrics as `<name>/rank<r>`; NaN/inf as NaN),
the spec flattened into params (`model.d_model`, `train.lr`, …), and at the end the final state
and model path.

Why it cannot hurt a job: its listener on the store's event bus only marks the job dirty (a set
insert, O(1), nothing else under the store's write lock). One thread per sink reads the job's new
points *from the store* with a cursor on their `seq`, so the store is the buffer: a tracker that is
down loses nothing, and the sink catches up when it is back. Each call is retried with tenacity; a
sink still failing is retried with growing back-off, and the outage (and the recovery) is written
once into the job's own log. Points superseded by a resume (a retry that continues from a
checkpoint) cannot be deleted from MLflow, so the job is exported again from scratch into a fresh
run (the old one is deleted; TensorBoard's directory is rewritten): the tracker always holds
exactly what the store holds.

Replicas: only the leader exports (`Exporter.start(acting)` when it is elected, `stop()` when it
steps down; `api.app`), so each point goes out once however many replicas run. A point a follower
stored reaches the leader's export through the store: the other replica's notice
(`Exporter.remote`, from `service.hub.Relay`) marks the job, and a sweep every `sweep_s` marks
every job written since (`Jobs.changed_since`), so a lost notice delays the export, never loses
it. A resume is read from the stored transitions too, wherever it was stored. A new leader's first
sweep exports every active job, and every job written in the last `catch_up_s`, again from scratch
(replacing what the previous leader sent, which it may not have finished); a deposed leader checks
`acting()` before every call to a tracker, so at most a call already in flight lands after its
term (MLflow refuses it once the new leader deleted that run). `RINGTRAIN_TENSORBOARD_DIR` must be
one directory every replica sees (a shared volume), or each holds only what it exported as leader.

mlflow and tensorboard are imported only when configured (`pip install 'ringtrain[tracking]'`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tenacity import Retrying, retry_if_not_exception_type, stop_after_attempt, wait_exponential

from service.artifacts import model_dir
from service.settings import Settings
from service.store import Event, Store
from workers.protocol import JobState

log = logging.getLogger("ringtrain.tracking")

PAGE = 1000  # points read from the store per step (MLflow takes at most 1000 metrics per batch)


@dataclass(frozen=True)
class JobView:
    id: str
    name: str
    owner: str
    state: str
    spec: dict[str, Any]
    created_at: float
    finished_at: float | None
    model_path: str | None  # set once the job SUCCEEDED (the trainer exported it)


@dataclass(frozen=True)
class Point:
    seq: int
    step: int
    name: str
    rank: int | None
    value: float  # NaN where the store holds null (a non-finite measurement)
    time: float

    @property
    def tag(self) -> str:
        return self.name if self.rank is None else f"{self.name}/rank{self.rank}"


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested spec → {"model.d_model": "256", …}; lists and empty objects as JSON."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        elif isinstance(v, list | dict) or v is None:
            out[key] = json.dumps(v)
        else:
            out[key] = str(v)
    return out


class Sink(Protocol):
    name: str

    def begin(self, job: JobView) -> None:
        """Start the job's export from nothing (replacing any earlier export of it): run/dir and
        params."""

    def write(self, job: JobView, points: Sequence[Point]) -> None: ...

    def finish(self, job: JobView) -> None: ...

    def close(self) -> None: ...


class MlflowSink:
    """One MLflow run per job (tag `ringtrain.job_id`) in one experiment."""

    name = "mlflow"

    def __init__(self, tracking_uri: str, experiment: str) -> None:
        # our own retries (tenacity, then back-off) replace the client's long built-in ones
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
        os.environ.setdefault(
            "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true"
        )  # the server log is not a console
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.experiment = experiment
        self._exp_id: str | None = None
        self.runs: dict[str, str] = {}

    def _experiment_id(self) -> str:
        if self._exp_id is None:
            exp = self.client.get_experiment_by_name(self.experiment)
            if exp is None:
                try:
                    self._exp_id = str(self.client.create_experiment(self.experiment))
                except Exception:  # created meanwhile by another control plane
                    exp = self.client.get_experiment_by_name(self.experiment)
                    if exp is None:
                        raise
            if exp is not None:
                self._exp_id = str(exp.experiment_id)
        assert self._exp_id is not None
        return self._exp_id

    def runs_of(self, job_id: str) -> list[Any]:
        exp = self._experiment_id()
        return list(
            self.client.search_runs([exp], filter_string=f"tags.`ringtrain.job_id` = '{job_id}'")
        )

    def begin(self, job: JobView) -> None:
        from mlflow.entities import Param

        for old in self.runs_of(job.id):
            self.client.delete_run(old.info.run_id)
        run = self.client.create_run(
            self._experiment_id(),
            start_time=int(job.created_at * 1000),
            tags={"ringtrain.job_id": job.id, "ringtrain.owner": job.owner},
            run_name=job.name,
        )
        params = [Param(k, v[:6000]) for k, v in flatten(job.spec).items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(run.info.run_id, params=params[i : i + 100], synchronous=True)
        self.runs[job.id] = run.info.run_id

    def write(self, job: JobView, points: Sequence[Point]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(p.tag, p.value, int(p.time * 1000), p.step) for p in points]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(
                self.runs[job.id], metrics=metrics[i : i + 1000], synchronous=True
            )

    def finish(self, job: JobView) -> None:
        run_id = self.runs[job.id]
        if job.model_path:
            self.client.set_tag(run_id, "ringtrain.model_path", job.model_path)
        status = {"SUCCEEDED": "FINISHED", "CANCELLED": "KILLED"}.get(job.state, "FAILED")
        end = int((job.finished_at or time.time()) * 1000)
        self.client.set_terminated(run_id, status=status, end_time=end)
        self.runs.pop(job.id, None)

    def close(self) -> None:
        self.runs.clear()


class TensorBoardSink:
    """Event files under `<root>/<job id>/`: scalars per metric, the spec and model path as text."""

    name = "tensorboard"

    def __init__(self, root: str | Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._writer_cls = EventFileWriter
        self.root = Path(root).expanduser()
        self.writers: dict[str, Any] = {}

    def _text(self, job: JobView, tag: str, text: str) -> None:
        from tensorboard.compat.proto.event_pb2 import Event as TbEvent
        from tensorboard.plugins.text.summary_v2 import text_pb

        self.writers[job.id].add_event(
            TbEvent(wall_time=time.time(), step=0, summary=text_pb(tag, text))
        )

    def begin(self, job: JobView) -> None:
        old = self.writers.pop(job.id, None)
        if old is not None:
            old.close()
        d = self.root / job.id
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        self.writers[job.id] = self._writer_cls(str(d), max_queue_size=PAGE, flush_secs=5)
        rows = "\n".join(f"| {k} | {v} |" for k, v in flatten(job.spec).items())
        self._text(job, "spec", f"| param | value |\n|---|---|\n{rows}")
        self.writers[job.id].flush()

    def write(self, job: JobView, points: Sequence[Point]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event as TbEvent
        from tensorboard.compat.proto.summary_pb2 import Summary

        w = self.writers[job.id]
        for p in points:
            value = Summary.Value(tag=p.tag, simple_value=p.value)
            w.add_event(TbEvent(wall_time=p.time, step=p.step, summary=Summary(value=[value])))
        w.flush()

    def finish(self, job: JobView) -> None:
        self._text(job, "result", f"state {job.state}; model: {job.model_path or '(none)'}")
        self.writers.pop(job.id).close()

    def close(self) -> None:
        for w in self.writers.values():
            w.close()
        self.writers.clear()


class _NotLeading(Exception):
    """This replica's term ended: the export stops here (the next leader exports from scratch)."""


DONE_KEPT = 10000  # finished jobs a worker remembers, so a late mark does not export one again


class _SinkWorker:
    """One sink's thread: per-job cursors over the store, retries, back-off, outage notes in the
    job's log."""

    def __init__(
        self,
        sink: Sink,
        store: Store,
        model_path: Callable[[str], str],
        note: Callable[[str, str], None],
        flush_s: float,
        retry_max_s: float,
        acting: Callable[[], bool] = lambda: True,
    ) -> None:
        self.sink, self.store, self.model_path, self.note, self.flush_s = (
            sink,
            store,
            model_path,
            note,
            flush_s,
        )
        self.retry_max_s = retry_max_s
        self.acting = acting
        self.cond = threading.Condition()
        self.pending: set[str] = set()
        self.resets: set[str] = set()
        self.cursor: dict[str, int] = {}
        self.moves_seen: dict[str, int] = {}  # job -> the last transition seq checked for a resume
        self.done: dict[str, None] = {}  # jobs exported to the end (oldest first, DONE_KEPT)
        self.failing: dict[str, int] = {}  # job -> consecutive failed passes
        self.retry_at = 0.0
        self.busy = False
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name=f"tracking-{sink.name}", daemon=True)

    def mark(self, job_id: str, reset: bool) -> None:
        with self.cond:
            self.pending.add(job_id)
            if reset:
                self.resets.add(job_id)
            self.cond.notify()

    def idle(self) -> bool:
        with self.cond:
            return not self.pending and not self.busy

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.stopping and (not self.pending or time.monotonic() < self.retry_at):
                    self.cond.wait(
                        max(0.05, self.retry_at - time.monotonic()) if self.pending else None
                    )
                if self.stopping:
                    return
            time.sleep(self.flush_s)  # let a burst of reports collect into one batch
            with self.cond:
                jobs, self.pending, self.busy = sorted(self.pending), set(), True
            failed = 0
            for job_id in jobs:
                if not self._sync(job_id):
                    failed += 1
                    with self.cond:
                        self.pending.add(job_id)
            if failed:
                passes = max(self.failing.values(), default=1)
                self.retry_at = time.monotonic() + min(self.retry_max_s, 0.5 * 2 ** min(passes, 7))
            with self.cond:
                self.busy = False

    def _retrying(self) -> Retrying:
        return Retrying(
            stop=stop_after_attempt(3),
            wait=wait_exponential(multiplier=0.2, max=2.0),
            retry=retry_if_not_exception_type(_NotLeading),
            reraise=True,
        )

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        for attempt in self._retrying():
            with attempt:
                if not self.acting():
                    raise _NotLeading
                fn(*args)

    def _sync(self, job_id: str) -> bool:
        """Bring the job's export up to date with the store; False (and a log note once) if the sink
        failed."""
        reset = False
        try:
            row = self.store.jobs.get(job_id)
            terminal = JobState(row.state).terminal
            job = JobView(
                row.id,
                row.name,
                row.owner,
                row.state,
                dict(row.spec),
                row.created_at,
                row.finished_at,
                self.model_path(row.id) if row.state == JobState.SUCCEEDED.value else None,
            )
            with self.cond:
                asked = job_id in self.resets
                self.resets.discard(job_id)
            if not asked and job_id in self.done:  # exported to the end already
                return True
            reset = asked or job_id not in self.cursor
            # a resume superseded points the sink may hold: read from the store, whichever replica
            # stored it (before the points, so one stored meanwhile is seen on the next pass)
            moves = self.store.jobs.transitions(job_id)
            seen = self.moves_seen.get(job_id, 0)
            reset = reset or any(m.resume_step is not None and m.seq > seen for m in moves)
            if reset:
                self.cursor.pop(job_id, None)
                self.done.pop(job_id, None)
                self._call(self.sink.begin, job)
                self.cursor[job_id] = 0
            self.moves_seen[job_id] = moves[-1].seq if moves else 0
            while True:
                rows = self.store.metrics.points(job_id, after=self.cursor[job_id], limit=PAGE)
                if not rows:
                    break
                points = [
                    Point(
                        r.seq,
                        r.step,
                        r.name,
                        r.rank,
                        math.nan if r.value is None else r.value,
                        r.time,
                    )
                    for r in rows
                ]
                self._call(self.sink.write, job, points)
                self.cursor[job_id] = rows[-1].seq
                if len(rows) < PAGE:
                    break
            if terminal:
                self._call(self.sink.finish, job)
                self.cursor.pop(job_id, None)
                self.moves_seen.pop(job_id, None)
                self.done[job_id] = None
                while len(self.done) > DONE_KEPT:
                    del self.done[next(iter(self.done))]
        except _NotLeading:
            if reset:
                with self.cond:
                    self.resets.add(job_id)
            return True
        except Exception as e:
            n = self.failing.get(job_id, 0) + 1
            self.failing[job_id] = n
            if reset:
                with self.cond:
                    self.resets.add(job_id)
            log.warning("job %s: export to %s failed (%s); retrying", job_id, self.sink.name, e)
            if n == 1:
                self._note(
                    job_id,
                    f"export to {self.sink.name} failing ({type(e).__name__}: {str(e)[:300]}); "
                    "retrying in the background - "
                    "training and ringtrain's own metrics are unaffected",
                )
            return False
        if self.failing.pop(job_id, None):
            self._note(
                job_id, f"export to {self.sink.name} recovered; everything up to now is exported"
            )
        return True

    def _note(self, job_id: str, line: str) -> None:
        try:
            self.note(job_id, line)
        except Exception as e:  # the store itself is down: the server log has it
            log.warning("job %s: could not log the export status (%s)", job_id, e)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout)
        try:
            self.sink.close()
        except Exception as e:
            log.warning("closing the %s export: %s", self.sink.name, e)


class Exporter:
    """Feeds each configured sink from the store, on the leader only (`start` / `stop` per term);
    `notify` is its listener on the store's event bus, `remote` hears of other replicas' commits.

    `sinks` makes a fresh set of sinks per term (called once here too, so a tracker that is
    configured but not installed fails at start-up)."""

    def __init__(
        self,
        store: Store,
        sinks: Callable[[], Iterable[Sink]],
        model_path: Callable[[str], str],
        note: Callable[[str, str], None],
        flush_s: float = 0.5,
        retry_max_s: float = 60.0,
        sweep_s: float = 5.0,
        window_s: float = 60.0,
        catch_up_s: float = 600.0,
    ) -> None:
        self.store = store
        self.make_sinks = sinks
        for sink in list(sinks()):
            sink.close()
        self.model_path, self.note = model_path, note
        self.flush_s, self.retry_max_s = flush_s, retry_max_s
        # sweep every sweep_s for the jobs written in the last window_s (writers' clocks may
        # differ by less than that); a new term first re-exports what changed in catch_up_s
        self.sweep_s, self.window_s, self.catch_up_s = sweep_s, window_s, catch_up_s
        self.workers: list[_SinkWorker] = []  # empty while not leading: marks go nowhere
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._swept = threading.Event()
        self._sweeper: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._sweeper is not None

    def notify(self, job_id: str, events: list[Event]) -> None:
        """Runs under the store's write lock: only marks the job; log-only batches (our own notes)
        are ignored."""
        if not any(e.kind != "log" for e in events):
            return
        reset = any(e.kind == "state" and e.data.get("resume_step") is not None for e in events)
        for w in self.workers:
            w.mark(job_id, reset)

    def remote(self, job_id: str | None) -> None:
        """Another replica stored events of `job_id` (None: anything, e.g. after the notices were
        lost): mark the job, or sweep now. Any thread."""
        if job_id is None:
            self._wake.set()
            return
        for w in self.workers:
            w.mark(job_id, False)

    def start(self, acting: Callable[[], bool] | None = None) -> None:
        """Export from now on (this replica leads; `acting` says while it still does): fresh sinks
        and workers, and the sweep, whose first pass exports from scratch every active job and
        every job written in the last `catch_up_s`. Lists nothing itself (never blocks)."""
        with self._lock:
            if self._sweeper is not None:
                return
            still = acting or (lambda: True)
            args = (self.store, self.model_path, self.note, self.flush_s, self.retry_max_s, still)
            workers = [_SinkWorker(s, *args) for s in self.make_sinks()]
            for w in workers:
                w.start()
            self.workers = workers
            self._stop, self._wake, self._swept = (threading.Event() for _ in range(3))
            self._sweeper = threading.Thread(
                target=self._sweep_loop,
                args=(workers, self._stop, self._wake, self._swept),
                name="tracking-sweep",
                daemon=True,
            )
            self._sweeper.start()

    def _sweep_loop(
        self,
        workers: list[_SinkWorker],
        stop: threading.Event,
        wake: threading.Event,
        swept: threading.Event,
    ) -> None:
        seen: dict[str, int] | None = None  # job -> next event seq at the last sweep
        last = time.time() - self.catch_up_s
        while not stop.is_set():
            t0 = time.time()
            try:
                changed = self.store.jobs.changed_since(min(last, t0 - self.window_s))
                if seen is None:  # a new term: (re)export from scratch, the last one may be stale
                    jobs = set(changed) | {j.id for j in self.store.jobs.active()}
                    marks = [(jid, True) for jid in sorted(jobs)]
                else:
                    marks = [(jid, False) for jid, n in changed.items() if seen.get(jid) != n]
                for jid, reset in marks:
                    for w in workers:
                        w.mark(jid, reset)
                seen, last = changed, t0
                swept.set()
            except Exception as e:
                log.warning("tracking export: cannot read the jobs to export (%s)", e)
            wake.wait(self.sweep_s)
            wake.clear()

    def idle(self) -> bool:
        return (not self.running or self._swept.is_set()) and all(w.idle() for w in self.workers)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop exporting (the term ended, or shutdown); safe when not started."""
        with self._lock:
            sweeper, self._sweeper = self._sweeper, None
            workers, self.workers = self.workers, []
            self._stop.set()
            self._wake.set()
        for w in workers:
            w.stop(timeout)
        if sweeper is not None:
            sweeper.join(timeout)


def exporter_for(settings: Settings, store: Store) -> Exporter | None:
    """The exporter the settings ask for (None when neither tracker is configured). It reads from
    the store; the caller subscribes `Exporter.notify` to the store's event bus and runs it on the
    leader only (`api.app.create_app`)."""
    if not (settings.mlflow_tracking_uri or settings.tensorboard_dir):
        return None

    def sinks() -> list[Sink]:
        out: list[Sink] = []
        if settings.mlflow_tracking_uri:
            out.append(MlflowSink(settings.mlflow_tracking_uri, settings.mlflow_experiment))
        if settings.tensorboard_dir:
            out.append(TensorBoardSink(settings.tensorboard_dir))
        return out

    return Exporter(
        store,
        sinks,
        model_path=lambda job_id: str(model_dir(settings.checkpoint_dir, job_id)),
        note=lambda job_id, line: store.metrics.add_log(job_id, "tracking", line),
        retry_max_s=settings.tracking_retry_max_s,
    )
