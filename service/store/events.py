"""A job's event stream: the one place each kind of event is built, and the bus that carries fresh
events to listeners after each commit.

Listeners are registered by name, once, where the app is assembled (`api.app.create_app`), so every
consumer of committed events (the SSE hub, the tracking export, ...) is visible in one place.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.models import LogLine, MetricPointRow, Transition

log = logging.getLogger("ringtrain.store")

Listener = Callable[[str, list["Event"]], None]


@dataclass(frozen=True)
class Event:
    """One entry of a job's event stream: kind is "state", "metric" or "log"."""

    seq: int
    kind: str
    data: dict[str, Any]


def finite(v: float | None) -> float | None:
    """NaN and inf are stored and sent as None (JSON has no such numbers)."""
    return v if v is not None and math.isfinite(v) else None


def metric_point(
    seq: int,
    step: int,
    name: str,
    value: float | None,
    rank: int | None,
    time: float,
) -> dict[str, Any]:
    """A metric point as stored, streamed and served: the single definition of its fields."""
    value = finite(value)
    return {"seq": seq, "step": step, "name": name, "value": value, "rank": rank, "time": time}


def metric_event(point: dict[str, Any]) -> Event:
    return Event(point["seq"], "metric", point)


def point_of(row: MetricPointRow) -> dict[str, Any]:
    return metric_point(row.seq, row.step, row.name, row.value, row.rank, row.time)


def latest_entry(point: dict[str, Any]) -> dict[str, Any]:
    """What `jobs.latest` keeps per global metric: the point less its name and rank."""
    return {k: point[k] for k in ("step", "value", "seq", "time")}


def transition_event(t: Transition) -> Event:
    data: dict[str, Any] = {
        "seq": t.seq,
        "time": t.time,
        "from": t.from_state,
        "to": t.to_state,
        "reason": t.reason,
    }
    if t.resume_step is not None:
        data["resume_step"] = t.resume_step
    return Event(t.seq, "state", data)


def log_event(r: LogLine) -> Event:
    return Event(r.seq, "log", {"seq": r.seq, "time": r.time, "source": r.source, "line": r.line})


class EventBus:
    """Named listeners for committed events. `publish` runs after each commit, under the store's
    write lock and in seq order, so a listener must be quick (mark work, never do it) and should not
    raise: one that does is logged with its name and the others still run."""

    def __init__(self) -> None:
        self._listeners: dict[str, Listener] = {}
        self._lock = threading.Lock()

    def listen(self, name: str, listener: Listener) -> None:
        with self._lock:
            if name in self._listeners:
                raise ValueError(f"an event listener named {name!r} is already registered")
            self._listeners[name] = listener

    def names(self) -> list[str]:
        with self._lock:
            return list(self._listeners)

    def publish(self, job_id: str, events: list[Event]) -> None:
        if not events:
            return
        with self._lock:
            listeners = list(self._listeners.items())
        for name, listener in listeners:
            try:
                listener(job_id, events)
            except Exception:  # the data is committed; a listener's fault must not fail the write
                log.exception("event listener %r failed on job %s", name, job_id)
