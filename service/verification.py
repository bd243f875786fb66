"""A job's `verification`, derived from the `verify_*` metric points it stored (no own column).

Every job's ranks check their distributed math against a one-rank reference before step 1
(`workers.training.verify`) and rank 0 emits the result as ordinary metric points, so it is
stored, streamed, journaled and exported like any metric. The job row already keeps the newest
global point of every metric (`Job.latest`); the job's `verification` is read from there, and the
jobs list filters on the same JSON field. A resume onto another parallel shape verifies again: the
newest check wins.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from sqlalchemy import ColumnElement

from service.models import Job
from workers.metrics import (
    VERIFY_FP32_REL_ERR,
    VERIFY_MAX_REL_ERR,
    VERIFY_PASSED,
    VERIFY_SECONDS,
    VERIFY_TOKENS,
    VERIFY_TOLERANCE,
)

Outcome = Literal["passed", "failed"]
PASSED = VERIFY_PASSED.name  # 1.0 passed, 0.0 failed
ERROR = VERIFY_MAX_REL_ERR.name


def _value(latest: Mapping[str, Any], name: str) -> Any:
    point = latest.get(name)
    if point is None:
        return None
    return point.get("value") if isinstance(point, Mapping) else getattr(point, "value", None)


def verification_of(latest: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """{passed, max_rel_err, tolerance, tokens, seconds, fp32_rel_err} from a job's latest points;
    None when the job has not verified (yet, or `verify: {enabled: false}`). A non-finite error is
    stored as null: not passed."""
    latest = latest or {}
    if PASSED not in latest or ERROR not in latest:
        return None
    tokens = _value(latest, VERIFY_TOKENS.name)
    return {
        "passed": _value(latest, PASSED) == 1.0,
        "max_rel_err": _value(latest, ERROR),
        "tolerance": _value(latest, VERIFY_TOLERANCE.name),
        "tokens": int(tokens) if tokens is not None else None,
        "seconds": _value(latest, VERIFY_SECONDS.name),
        "fp32_rel_err": _value(latest, VERIFY_FP32_REL_ERR.name),
    }


def verification_is(outcome: Outcome) -> ColumnElement[bool]:
    """A `select(Job)` condition: the job's newest verification had `outcome` (a JSON path that
    SQLite and PostgreSQL both evaluate)."""
    value = Job.latest[PASSED]["value"].as_float()
    condition: ColumnElement[bool] = value == 1.0 if outcome == "passed" else value == 0.0
    return condition
