"""The job state machine, in one place.

    QUEUED → PLACING → RUNNING → SUCCEEDED | FAILED | CANCELLED
                 ↑  ↓      ↓ ↑
                 RETRYING ←┘ (re-reserve, resume from the last checkpoint)

Terminal states never change. Every transition is stored with a time and a reason (`service.store`).
"""

from __future__ import annotations

from workers.protocol import TERMINAL_STATES, JobState

S = JobState
ALLOWED: dict[JobState, frozenset[JobState]] = {
    S.QUEUED: frozenset({S.PLACING, S.FAILED, S.CANCELLED}),
    S.PLACING: frozenset({S.RUNNING, S.RETRYING, S.FAILED, S.CANCELLED}),
    S.RUNNING: frozenset({S.RETRYING, S.SUCCEEDED, S.FAILED, S.CANCELLED}),
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
