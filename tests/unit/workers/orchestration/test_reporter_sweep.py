"""The driver's report channel (`workers.orchestration.reporter.Reporter`) in process, in the fast tier.

The control plane is a small in-process stand-in behind `httpx.MockTransport` that follows the report route's
documented rule (`api.routers.reports`, `Store.metrics.apply_report`): items with seq <= its mark are skipped, the
first new one must be mark + 1 or the answer is 409 with `acked_seq`, success answers `{"acked_seq": mark}`. It
can be down (connection refused) and can forget items, so the reporter's own numbering, batching, bounded queue
and recovery are what is checked, each against hand-written expectations.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from workers.orchestration.reporter import Reporter
from workers.protocol import JobState, MetricPoint


class Plane:
    """The report route's sequence rule, plus what a test needs to look at (batches, answers, arrivals)."""

    def __init__(self, mark: int = 0) -> None:
        self.lock = threading.Lock()
        self.mark = mark
        self.up = True
        self.refuse_name: str | None = None  # a metric of this name makes the batch a 422
        self.items: list[dict[str, Any]] = []  # applied, in order
        self.batches: list[int] = []  # sizes of the non-empty batches that reached the server
        self.codes: list[int] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        if not self.up:
            raise httpx.ConnectError("connection refused", request=request)
        items = json.loads(request.content)["items"]
        with self.lock:
            if items:
                self.batches.append(len(items))
            resp = self._apply(items)
            self.codes.append(resp.status_code)
            return resp

    def _apply(self, items: list[dict[str, Any]]) -> httpx.Response:
        if self.refuse_name is not None and any(it.get("name") == self.refuse_name for it in items):
            return httpx.Response(422, json={"error": {"code": "invalid", "message": "no"}})
        fresh = sorted((it for it in items if it["seq"] > self.mark), key=lambda it: it["seq"])
        for it in fresh:
            if it["seq"] != self.mark + 1:
                gap = {"error": {"code": "sequence_gap", "message": "gap"}, "acked_seq": self.mark}
                return httpx.Response(409, json=gap)
            self.mark = it["seq"]
            self.items.append(it)
        return httpx.Response(200, json={"acked_seq": self.mark})

    def seqs(self) -> list[int]:
        with self.lock:
            return [it["seq"] for it in self.items]

    def steps(self) -> list[int]:
        with self.lock:
            return [it["step"] for it in self.items if it["type"] == "metric"]


@contextmanager
def reporter(plane: Plane, **kw: Any) -> Iterator[Reporter]:
    rep = Reporter(
        "http://plane",
        "job-1",
        "tok",
        interval_s=0.01,
        backoff_max_s=0.05,
        transport=httpx.MockTransport(plane.handle),
        **kw,
    )
    try:
        yield rep
    finally:
        rep.close(timeout_s=2.0)


def _point(step: int, name: str = "loss") -> MetricPoint:
    return MetricPoint(step=step, name=name, value=1.0 / step, time=time.time())


def test_a_later_driver_continues_after_the_servers_mark() -> None:
    """The handshake's ack is the server's mark: a resubmitted driver numbers from mark + 1, else its first
    items would be skipped as duplicates of the previous driver's."""
    plane = Plane(mark=5)
    with reporter(plane) as rep:
        for s in (1, 2, 3):
            rep.metric(_point(s))
        assert rep.flush(5)
        assert plane.seqs() == [6, 7, 8] and plane.steps() == [1, 2, 3]
        assert rep.acked_seq == 8


def test_batches_hold_at_most_max_batch_items() -> None:
    """A backlog after an outage goes out in batches of max_batch (the route's size limit), in order."""
    plane = Plane()
    plane.up = False  # nothing is numbered before the handshake: all 10 wait in the queue
    with reporter(plane, max_batch=4) as rep:
        for s in range(1, 11):
            assert rep.metric(_point(s))
        plane.up = True
        assert rep.flush(5)
        assert plane.batches == [4, 4, 2]
        assert plane.seqs() == list(range(1, 11)) and plane.steps() == list(range(1, 11))


def test_a_full_queue_drops_new_metrics_but_never_replays_or_states() -> None:
    """max_queue bounds the droppable items exactly; a replay and a state are queued anyway, and the drop is
    announced by one driver log line in front of the next item that is kept."""
    plane = Plane()
    plane.up = False
    with reporter(plane, max_queue=4) as rep:
        assert [rep.metric(_point(s)) for s in range(1, 7)] == [True] * 4 + [False] * 2
        assert rep.metric(_point(3), replay=True)
        rep.state(JobState.RUNNING, "placed")
        assert rep.pending() == 7  # 4 points, the announcement, the replay, the state
        plane.up = True
        assert rep.flush(5)
    kinds = [(it["type"], it.get("step"), it.get("replay")) for it in plane.items]
    assert kinds == [("metric", 1, False), ("metric", 2, False), ("metric", 3, False),
                     ("metric", 4, False), ("log", None, None), ("metric", 3, True),
                     ("state", None, None)]  # fmt: skip
    assert plane.items[4]["line"] == "report queue full: dropped 2 metric/log items"
    assert plane.seqs() == list(range(1, 8))


def test_a_server_that_forgot_items_gets_the_next_ones_renumbered() -> None:
    """After the server lost items (restored from a backup), its 409 carries its mark and the reporter resends
    what it holds renumbered from mark + 1, instead of retrying a gap forever."""
    plane = Plane()
    with reporter(plane) as rep:
        for s in range(1, 7):
            rep.metric(_point(s))
        assert rep.flush(5) and plane.seqs() == list(range(1, 7))
        with plane.lock:
            plane.mark = 3
            del plane.items[3:]
        rep.metric(_point(7))
        rep.metric(_point(8))
        assert rep.flush(5)
        assert plane.seqs() == [1, 2, 3, 4, 5] and plane.steps() == [1, 2, 3, 7, 8]
        assert 409 in plane.codes


def test_a_refused_item_is_dropped_without_leaving_a_gap() -> None:
    """An item the server refuses (422) is isolated by halving the batch and dropped; the items after it are
    renumbered, so the server never sees a gap (no 409) and gets every other point, in order."""
    plane = Plane()
    plane.refuse_name = "poison"
    plane.up = False  # all ten go out as one batch, so the halving is exercised
    with reporter(plane) as rep:
        for s in range(1, 11):
            rep.metric(_point(s, "poison" if s == 4 else "loss"))
        plane.up = True
        assert rep.flush(5)
        assert plane.steps() == [1, 2, 3, 5, 6, 7, 8, 9, 10]
        assert plane.seqs() == list(range(1, 10))
        assert 409 not in plane.codes
