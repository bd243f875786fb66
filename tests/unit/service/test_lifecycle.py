"""The job-state policy in `service.lifecycle`, as pure decisions: no database, known answers."""

from __future__ import annotations

import pytest

from service import lifecycle
from service.lifecycle import DriverRetry, Reported, Step
from workers.protocol import JobState

S = JobState


def test_a_failure_reported_while_cancelling_ends_cancelled() -> None:
    got = lifecycle.reported(S.FAILED, "rank 0: boom", "traceback", cancel_requested=True)
    assert got == Reported(
        S.CANCELLED,
        "cancelled (the driver reported while stopping: rank 0: boom)",
        clears_error=True,
    )
    # no reason: the error text stands in, cut to 500 characters
    got = lifecycle.reported(S.FAILED, None, "x" * 900, cancel_requested=True)
    assert got.reason == f"cancelled (the driver reported while stopping: {'x' * 500})"
    assert lifecycle.reported(S.FAILED, None, None, True).reason == (
        "cancelled (the driver reported while stopping: failure)"
    )


def test_other_reports_are_taken_as_sent() -> None:
    got = lifecycle.reported(S.FAILED, "oom", "tb", cancel_requested=False)
    assert got == Reported(S.FAILED, "oom")
    got = lifecycle.reported(S.SUCCEEDED, None, None, cancel_requested=True)
    assert got == Reported(S.SUCCEEDED, None)


def test_report_steps_fill_in_implied_states_and_count_restarts() -> None:
    steps = lifecycle.report_steps(S.QUEUED, Reported(S.SUCCEEDED, "done"))
    assert steps == [
        Step(S.PLACING, "implied by the driver's SUCCEEDED report"),
        Step(S.RUNNING, "implied by the driver's SUCCEEDED report"),
        Step(S.SUCCEEDED, "done"),
    ]
    # only the reported state carries the resume step; a RETRYING step uses a restart
    steps = lifecycle.report_steps(S.RUNNING, Reported(S.RETRYING, "rank lost"), resume_step=40)
    assert steps == [Step(S.RETRYING, "rank lost", resume_step=40, counts_restart=True)]
    steps = lifecycle.report_steps(S.QUEUED, Reported(S.RETRYING, None), resume_step=7)
    assert steps == [
        Step(S.PLACING, "implied by the driver's RETRYING report"),
        Step(S.RETRYING, "retrying", resume_step=7, counts_restart=True),
    ]
    assert lifecycle.report_steps(S.RUNNING, Reported(S.RUNNING, "again")) == []


def test_a_failed_step_names_the_error_to_keep() -> None:
    [step] = lifecycle.report_steps(S.RUNNING, Reported(S.FAILED, "rank 1: nan loss"))
    assert step == Step(S.FAILED, "rank 1: nan loss", error="rank 1: nan loss")
    [step] = lifecycle.report_steps(S.RUNNING, Reported(S.FAILED, None))
    assert step == Step(S.FAILED, "failed", error="the driver reported failure")


def test_report_steps_refuse_what_the_machine_forbids() -> None:
    with pytest.raises(lifecycle.InvalidTransition, match="RUNNING to QUEUED"):
        lifecycle.report_steps(S.RUNNING, Reported(S.QUEUED, None))
    for end in (S.SUCCEEDED, S.FAILED, S.CANCELLED):
        with pytest.raises(lifecycle.InvalidTransition):
            lifecycle.report_steps(end, Reported(S.RUNNING, None))


def _retry(src: JobState, **over: object) -> DriverRetry | None:
    kw: dict[str, object] = dict(
        reason="driver lost", restarts=0, max_restarts=2, cancel_requested=False, same_driver=True
    )
    kw.update(over)
    return lifecycle.driver_retry(src, **kw)  # type: ignore[arg-type]


def test_a_lost_driver_is_resubmitted_with_a_restart() -> None:
    why = "driver lost; restart 1/2: resubmitting the driver"
    assert _retry(S.RUNNING) == DriverRetry([Step(S.RETRYING, why)], None, 1)
    assert _retry(S.QUEUED) == DriverRetry(
        [Step(S.PLACING, "implied by the driver's loss"), Step(S.RETRYING, why)], None, 1
    )
    # already RETRYING (it died while re-reserving): no transition, the reason goes to the log
    note = "driver lost; restart 2/2: resubmitting the driver"
    assert _retry(S.RETRYING, restarts=1) == DriverRetry([], note, 1)


def test_a_driver_lost_by_the_cluster_uses_no_restart() -> None:
    why = "head replaced: resubmitting the driver (no restart used)"
    got = _retry(S.RUNNING, reason="head replaced", restarts=2, counts=False)
    assert got == DriverRetry([Step(S.RETRYING, why)], None, 0)


@pytest.mark.parametrize(
    "src, over",
    [
        (S.RUNNING, {"restarts": 2}),  # budget spent
        (S.RUNNING, {"cancel_requested": True}),
        (S.RUNNING, {"same_driver": False}),  # another driver already replaced it
        (S.SUCCEEDED, {}),
        (S.CANCELLED, {"counts": False}),
    ],
)
def test_no_resubmission(src: JobState, over: dict[str, object]) -> None:
    assert _retry(src, **over) is None


def test_control_plane_moves_and_cancels() -> None:
    assert lifecycle.control_move(S.QUEUED, S.PLACING)
    assert not lifecycle.control_move(S.SUCCEEDED, S.FAILED)
    assert not lifecycle.control_move(S.QUEUED, S.RETRYING)
    assert lifecycle.control_move(S.RUNNING, S.RETRYING, only_from={S.PLACING, S.RUNNING})
    assert not lifecycle.control_move(S.RETRYING, S.PLACING, only_from={S.QUEUED})
    assert lifecycle.cancels_at_once(S.QUEUED, None)
    assert not lifecycle.cancels_at_once(S.QUEUED, "sub-1")  # handed over: its driver stops it
    assert not lifecycle.cancels_at_once(S.RUNNING, None)


def test_lifecycle_machine() -> None:
    assert lifecycle.path(S.QUEUED, S.RUNNING) == [S.PLACING, S.RUNNING]
    assert lifecycle.path(S.RETRYING, S.SUCCEEDED) == [S.RUNNING, S.SUCCEEDED]
    assert lifecycle.path(S.RUNNING, S.RUNNING) == []
    assert lifecycle.path(S.RUNNING, S.PLACING) == [S.PLACING]  # a staged job's next group
    for term in (S.SUCCEEDED, S.FAILED, S.CANCELLED):
        for dst in S:
            if dst != term:
                with pytest.raises(lifecycle.InvalidTransition):
                    lifecycle.path(term, dst)
    assert lifecycle.path(S.QUEUED, S.RETRYING) == [S.PLACING, S.RETRYING]
    with pytest.raises(lifecycle.InvalidTransition):
        lifecycle.path(S.RUNNING, S.QUEUED)


# The machine as the module docstring draws it (written out here, not read from ALLOWED).
EXPECTED_MOVES: dict[JobState, set[JobState]] = {
    S.QUEUED: {S.PLACING, S.FAILED, S.CANCELLED},
    S.PLACING: {S.RUNNING, S.RETRYING, S.FAILED, S.CANCELLED},
    S.RUNNING: {S.PLACING, S.RETRYING, S.SUCCEEDED, S.FAILED, S.CANCELLED},  # PLACING: next stage
    S.RETRYING: {S.PLACING, S.RUNNING, S.FAILED, S.CANCELLED},
    S.SUCCEEDED: set(),
    S.FAILED: set(),
    S.CANCELLED: set(),
}


def test_every_pair_of_states_is_allowed_exactly_as_the_machine_says() -> None:
    """Each of the 49 (from, to) pairs: a dropped or added edge (a job stuck PLACING that cannot be
    cancelled, a QUEUED job jumping to RUNNING) changes one answer here."""
    for src in S:
        for dst in S:
            assert lifecycle.allowed(src, dst) == (dst in EXPECTED_MOVES[src]), (src, dst)
            assert lifecycle.control_move(src, dst) == (dst in EXPECTED_MOVES[src]), (src, dst)
    assert lifecycle.path(S.PLACING, S.CANCELLED) == [S.CANCELLED]
    assert set(lifecycle.ACTIVE_STATES) == {S.QUEUED, S.PLACING, S.RUNNING, S.RETRYING}
