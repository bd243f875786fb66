"""The controller's decisions, one pass at a time and in process (`service.controller.Controller`): a real store on
SQLite, the recording launcher the API tests use (it stands for Ray and answers each driver's status as told), and
`schedule_once` / `reconcile_once` called directly instead of on their timers.

What a pass must decide: a driver Ray no longer knows is resubmitted without using a restart and with the store's
delivered watermark; a crashed driver uses a restart while any are left, then fails the job; a driver that ended is
waited for `reconcile_grace_s` (its final report may be in flight); a cancel the driver never confirms is forced
after `cancel_grace_s`, not before.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from service.controller import Controller
from service.db import make_engine, migrate
from service.launcher import DriverInfo, DriverStatus
from service.models import Job
from service.store import Store
from tests.support.api_harness import TINY_SPEC, RecordingLauncher, make_settings
from workers.config import JobSpec
from workers.protocol import JobState, MetricItem, StateItem


def _controller(tmp_path: Path, **over: Any) -> tuple[Controller, Store, RecordingLauncher]:
    engine = make_engine(f"sqlite:///{tmp_path}/store.db")
    migrate(engine)
    store = Store(engine)
    launcher = RecordingLauncher()
    return Controller(make_settings(tmp_path, **over), store, launcher), store, launcher


async def _schedule(ctrl: Controller) -> None:
    """One scheduler pass, and the submissions it started run to their end."""
    await ctrl.schedule_once()
    await asyncio.gather(*list(ctrl._submitting.values()))


def _running(store: Store, job: Job, world: int, steps: dict[int | None, int]) -> None:
    """The driver reports RUNNING, then points: series `rank` (None: global) through step `steps[rank]`."""
    items: list[StateItem | MetricItem] = [
        StateItem(seq=1, state=JobState.RUNNING, time=time.time(), reason="placed")
    ]
    for rank, last in steps.items():
        for s in range(1, last + 1):
            name = "loss" if rank is None else "mem_peak_bytes"
            items.append(
                MetricItem(seq=len(items) + 1, step=s, name=name, value=2.0, rank=rank, time=1.0)
            )
    store.metrics.apply_report(job.id, items)
    assert store.jobs.get(job.id).state == JobState.RUNNING.value


def test_a_driver_ray_forgot_is_resubmitted_without_a_restart_from_the_watermark(
    tmp_path: Path,
) -> None:
    ctrl, store, launcher = _controller(tmp_path, reconcile_grace_s=0.0)
    job = store.jobs.create("alice", JobSpec.model_validate(TINY_SPEC), "tok")  # ring 2: world 2

    async def main() -> None:
        await _schedule(ctrl)
        first = launcher.request_for(job.id)
        assert (first.attempt, first.delivered_through) == (0, 0)
        sid = store.jobs.get(job.id).submission_id
        assert sid == f"ringtrain-{job.id}-0"
        # global points through 4, rank 0 through 4, rank 1 through 3: steps 1..2 are surely complete
        _running(store, job, 2, {None: 4, 0: 4, 1: 3})
        launcher.statuses[sid] = DriverInfo(DriverStatus.UNKNOWN, "no such job")
        await ctrl.reconcile_once()
        got = store.jobs.get(job.id)
        assert (got.state, got.restarts, got.attempt, got.submission_id) == (
            JobState.RETRYING.value,
            0,
            1,
            None,
        )
        await _schedule(ctrl)
        again = launcher.request_for(job.id)
        assert (again.attempt, again.restarts, again.delivered_through) == (1, 0, 2)
        assert again.ingest_token != first.ingest_token

    asyncio.run(main())


def test_a_crashed_driver_uses_a_restart_then_the_job_fails(tmp_path: Path) -> None:
    ctrl, store, launcher = _controller(tmp_path, reconcile_grace_s=0.0)
    job = store.jobs.create("alice", JobSpec.model_validate({**TINY_SPEC, "max_restarts": 1}), "t")

    async def main() -> None:
        await _schedule(ctrl)
        _running(store, job, 2, {None: 1})
        launcher.statuses[f"ringtrain-{job.id}-0"] = DriverInfo(DriverStatus.FAILED, "killed\nmore")
        await ctrl.reconcile_once()
        got = store.jobs.get(job.id)
        assert (got.state, got.restarts, got.attempt) == (JobState.RETRYING.value, 1, 1)
        await _schedule(ctrl)
        assert launcher.request_for(job.id).restarts == 1
        launcher.statuses[f"ringtrain-{job.id}-1"] = DriverInfo(DriverStatus.FAILED, "killed")
        await ctrl.reconcile_once()
        got = store.jobs.get(job.id)
        assert got.state == JobState.FAILED.value and got.restarts == 1
        assert got.error is not None and got.error.endswith(
            "(Ray status FAILED: killed); no restarts left (max_restarts 1)"
        ), got.error

    asyncio.run(main())


def test_an_ended_driver_is_waited_for_so_its_final_report_wins(tmp_path: Path) -> None:
    ctrl, store, launcher = _controller(tmp_path, reconcile_grace_s=60.0)
    job = store.jobs.create("alice", JobSpec.model_validate(TINY_SPEC), "tok")

    async def main() -> None:
        await _schedule(ctrl)
        _running(store, job, 2, {None: 5})
        launcher.statuses[f"ringtrain-{job.id}-0"] = DriverInfo(DriverStatus.SUCCEEDED, "")
        await ctrl.reconcile_once()
        assert store.jobs.get(job.id).state == JobState.RUNNING.value
        late = StateItem(seq=7, state=JobState.SUCCEEDED, time=time.time(), reason="done")
        store.metrics.apply_report(job.id, [late])
        await ctrl.reconcile_once()
        got = store.jobs.get(job.id)
        assert got.state == JobState.SUCCEEDED.value and got.error is None

    asyncio.run(main())


def test_an_unconfirmed_cancel_is_forced_only_after_the_grace(tmp_path: Path) -> None:
    async def run(grace: float) -> tuple[Job, list[str]]:
        ctrl, store, launcher = _controller(tmp_path / str(grace), cancel_grace_s=grace)
        job = store.jobs.create("alice", JobSpec.model_validate(TINY_SPEC), "tok")
        await _schedule(ctrl)
        _running(store, job, 2, {None: 1})
        await ctrl.cancel(job.id, "alice")
        assert launcher.stops == [f"ringtrain-{job.id}-0"]
        launcher.statuses.clear()  # the driver ignores the stop: Ray still says RUNNING
        await ctrl.reconcile_once()
        return store.jobs.get(job.id), [t.reason for t in store.jobs.transitions(job.id)]

    (tmp_path / "60.0").mkdir()
    (tmp_path / "0.0").mkdir()
    patient, _ = asyncio.run(run(60.0))
    assert patient.state == JobState.RUNNING.value and patient.cancel_requested
    forced, reasons = asyncio.run(run(0.0))
    assert forced.state == JobState.CANCELLED.value
    assert reasons[-1] == (
        "cancel requested; the driver did not confirm within 0s (Ray status RUNNING)"
    )
