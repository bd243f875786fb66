"""The job state machine, in one place.

    QUEUED → PLACING ⇄ RUNNING → SUCCEEDED | FAILED | CANCELLED
                 ↑  ↓      ↓ ↑
                 RETRYING ←┘ (re-reserve, resume from the last checkpoint)

RUNNING → PLACING: a job with stages moves to a stage that needs another group of ranks.

Terminal states never change. Every transition is stored with a time and a reason (`service.store`).

The policy that decides a job's next state also lives here, as pure functions the store applies:
what a driver's state report does (a failure while cancelling ends CANCELLED), whether a lost driver
is resubmitted and whether that uses a restart, and when a cancel ends a job at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.protocol import TERMINAL_STATES, JobState

S = JobState
ALLOWED: dict[JobState, frozenset[JobState]] = {
    S.QUEUED: frozenset({S.PLACING, S.FAILED, S.CANCELLED}),
    S.PLACING: frozenset({S.RUNNING, S.RETRYING, S.FAILED, S.CANCELLED}),
    S.RUNNING: frozenset({S.PLACING, S.RETRYING, S.SUCCEEDED, S.FAILED, S.CANCELLED}),
    S.RETRYING: frozenset({S.PLACING, S.RUNNING, S.FAILED, S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}
ACTIVE_STATES = frozenset(s for s in JobState if s not in TERMINAL_STATES)


class InvalidTransition(ValueError):
    pass


def allowed(src: JobState, dst: JobState) -> bool:
    return dst in ALLOWED[src]


def path(src: JobState, dst: JobState) -> list[JobState]:
    """The states to pass through to get from `src` to `dst` ([] if already there).

    A driver may report RUNNING (or SUCCEEDED) before the control plane saw PLACING (or RUNNING):
    the implied intermediate states are filled in so the stored history still follows the machine.
    Raises InvalidTransition for anything else (e.g. leaving a terminal state).
    """
    if src == dst:
        return []
    # breadth-first over the machine: the shortest legal route
    frontier: list[list[JobState]] = [[src]]
    seen = {src}
    while frontier:
        nxt: list[list[JobState]] = []
        for route in frontier:
            for s in sorted(ALLOWED[route[-1]]):
                if s == dst:
                    return [*route[1:], s]
                if s not in seen and s not in TERMINAL_STATES and s != S.RETRYING:
                    seen.add(s)
                    nxt.append([*route, s])
        frontier = nxt
    raise InvalidTransition(f"a job cannot go from {src} to {dst}")


def is_terminal(state: str | JobState) -> bool:
    return JobState(state) in TERMINAL_STATES


# ---- job-state policy: pure decisions the store applies (unit-tested without a database) ---------


@dataclass(frozen=True)
class Step:
    """One transition to record: the state, its reason, and what else it does to the job."""

    state: JobState
    reason: str
    resume_step: int | None = None
    counts_restart: bool = False  # a RETRYING step uses one of the job's restarts
    error: str | None = None  # the job's error when it has none yet (FAILED steps)


@dataclass(frozen=True)
class Reported:
    """A driver's state report as the job takes it."""

    state: JobState
    reason: str | None
    clears_error: bool = False


def reported(
    state: JobState,
    reason: str | None,
    error: str | None,
    cancel_requested: bool,
) -> Reported:
    """A driver that fails while the user's cancel is under way ends CANCELLED, not FAILED: the stop
    was asked for, and the failure it reports is part of stopping."""
    if cancel_requested and state == S.FAILED:
        why = (reason or error or "failure")[:500]
        return Reported(S.CANCELLED, f"cancelled (the driver reported while stopping: {why})", True)
    return Reported(state, reason)


def report_steps(src: JobState, report: Reported, resume_step: int | None = None) -> list[Step]:
    """The transitions a driver's report makes from `src`, implied ones included. Raises
    InvalidTransition when the machine has no route (e.g. out of a terminal state)."""
    steps = []
    for st in path(src, report.state):
        final = st == report.state
        reason = report.reason if final else f"implied by the driver's {report.state} report"
        steps.append(
            Step(
                st,
                reason or st.value.lower(),
                resume_step=resume_step if final else None,
                counts_restart=st == S.RETRYING,
                error=(report.reason or "the driver reported failure") if st == S.FAILED else None,
            )
        )
    return steps


@dataclass(frozen=True)
class DriverRetry:
    """What resubmitting a lost driver does: the transitions (none when already RETRYING), a note
    for the job's log when there is no transition to carry the reason, and the restarts it uses."""

    steps: list[Step]
    note: str | None
    restarts_used: int


def driver_retry(
    src: JobState,
    *,
    reason: str,
    restarts: int,
    max_restarts: int,
    cancel_requested: bool,
    same_driver: bool,
    counts: bool = True,
) -> DriverRetry | None:
    """Whether a driver that died without a final report is resubmitted. None when the job ended,
    a cancel was asked for, another driver already replaced that one (`same_driver` False), or no
    restart is left. `counts=False`: the cluster lost the driver, not the job, so no restart is
    used."""
    if src.terminal or cancel_requested or not same_driver or (counts and restarts >= max_restarts):
        return None
    if counts:
        why = f"{reason}; restart {restarts + 1}/{max_restarts}: resubmitting the driver"
    else:
        why = f"{reason}: resubmitting the driver (no restart used)"
    if src == S.RETRYING:  # it died while re-reserving: no new transition, but say so
        return DriverRetry([], why, int(counts))
    route = path(src, S.RETRYING)
    steps = [Step(st, why if st == S.RETRYING else "implied by the driver's loss") for st in route]
    return DriverRetry(steps, None, int(counts))


def control_move(src: JobState, to: JobState, only_from: set[JobState] | None = None) -> bool:
    """Whether the control plane may move a job from `src` to `to` (restricted to `only_from`)."""
    return (only_from is None or src in only_from) and allowed(src, to)


def cancels_at_once(state: JobState, submission_id: str | None) -> bool:
    """A job not yet handed to the cluster has no driver to stop: a cancel ends it right away."""
    return submission_id is None and state == S.QUEUED
