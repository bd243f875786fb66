"""One-off cluster tasks behind a stored row (a dataset's prepare, an evaluation): how a row's
task is started and how its status and output become the row's state.

Both kinds are the same machine: a row stored QUEUED, a `Launcher.run_task` submission, and on
every read the task's status plus what its output says (a final result, an `error:` line) folded
into QUEUED -> RUNNING -> SUCCEEDED | FAILED. Only what the output means differs, so it lives
with each kind; the state rules live here, once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from service.launcher import DriverInfo, DriverStatus, Launcher, TaskRequest

TERMINAL = ("SUCCEEDED", "FAILED")


def start(launcher: Launcher, task: TaskRequest, update: Callable[..., None], what: str) -> None:
    """Submit `task`; a refused or unreachable cluster leaves the row FAILED saying why, and a
    launcher that names the submission otherwise records that name."""
    try:
        sid = launcher.run_task(task)
    except Exception as e:  # the cluster's API refused or is unreachable, no cluster, ...
        update(state="FAILED", error=f"could not start the {what} on the cluster: {e}")
    else:
        if sid != task.submission_id:
            update(submission_id=sid)


def outcome(
    info: DriverInfo, result: Any, error: str | None, what: str, again: str
) -> dict[str, Any]:
    """The row's new state fields from the task's status and what its output said: SUCCEEDED
    only with a result; an end without one, a failure or a stop is FAILED with the output's own
    error first; a task the cluster no longer knows is FAILED (it would wait forever), saying
    `again` (what to do)."""
    if info.status is DriverStatus.SUCCEEDED and result is not None:
        return {"state": "SUCCEEDED", "result": result}
    if info.status in (DriverStatus.FAILED, DriverStatus.STOPPED, DriverStatus.SUCCEEDED):
        return {
            "state": "FAILED",
            "error": error or info.message or f"the {what} ended {info.status.value}",
        }
    if info.status is DriverStatus.UNKNOWN:
        return {
            "state": "FAILED",
            "error": f"the cluster no longer knows the {what} ({info.message}); {again}",
        }
    if info.status is DriverStatus.RUNNING:
        return {"state": "RUNNING"}
    return {}
