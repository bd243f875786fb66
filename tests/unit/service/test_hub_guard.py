"""The parts of `service.hub` the sweep test leaves out, in process and without PostgreSQL.

A subscriber whose event loop closed is dropped on the next publish (else every publish for its job
keeps failing on it); the relay's sender coalesces queued notices per job into one `pg_notify` each,
keeping the newest seq and whether any of them carried a state change; its listener tells the hub
to re-read everything after each (re)connection, then passes on other replicas' notices. psycopg's
`connect` is replaced by a recording stand-in: no server, no network.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest

from service.hub import Hub, Relay
from service.store import Event


def _events(first: int, n: int, kind: str = "metric") -> list[Event]:
    return [Event(seq=s, kind=kind, data={"step": s}) for s in range(first, first + n)]


def test_a_subscriber_whose_loop_closed_is_dropped_on_publish() -> None:
    hub = Hub()
    loop = asyncio.new_event_loop()

    async def subscribe() -> None:
        hub.subscribe("A")

    loop.run_until_complete(subscribe())
    loop.close()
    assert hub.subscribers("A") == 1
    hub.publish("A", _events(1, 2))  # call_soon_threadsafe on a closed loop: RuntimeError
    assert hub.subscribers("A") == 0 and not hub._subs


def test_one_batch_past_max_queue_leaves_nothing_queued() -> None:
    """Lagging in the middle of one publish drops the rest of that batch too: a queue holding
    events after a gap would read as complete."""

    async def main() -> None:
        hub = Hub(max_queue=3)
        sub = hub.subscribe("A")
        hub.publish("A", _events(1, 6))
        for _ in range(3):
            await asyncio.sleep(0)
        assert sub.lagged and sub.queue.empty() and sub.wakeup.is_set()
        sub.close()

    asyncio.run(main())


class FakeConn:
    """What the relay uses of a psycopg connection: execute, transaction, notifies, close."""

    def __init__(self, notices: list[str] | None = None, on_notify: Any = None) -> None:
        self.executed: list[tuple[str, Any]] = []
        self.closed = False
        self.notices = notices or []
        self.on_notify = on_notify

    def execute(self, sql: str, params: Any = None) -> None:
        self.executed.append((sql, params))

    @contextmanager
    def transaction(self) -> Iterator[None]:
        yield

    def notifies(self, timeout: float) -> Iterator[SimpleNamespace]:
        for payload in self.notices:
            yield SimpleNamespace(payload=payload)
        self.on_notify()

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> FakeConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def test_the_sender_coalesces_notices_per_job_into_one_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three notices of job A (a state change first, then points) and one of B become two
    pg_notify calls: A at its newest seq with the state flag kept, B as it was."""
    conns: list[FakeConn] = []

    def connect(dsn: str, **kw: Any) -> FakeConn:
        conns.append(FakeConn())
        return conns[-1]

    monkeypatch.setattr(psycopg, "connect", connect)
    relay = Relay("postgresql://unused", "replica-1", lambda j, s, t: None)
    relay.published("A", _events(5, 1, kind="state"))
    relay.published("A", _events(6, 2))
    relay.published("B", _events(40, 3))
    relay.published("A", _events(8, 1))
    relay._queue.put(None)  # stop after this batch
    relay._send_loop()  # on this thread: one batch, then it stops
    (conn,) = conns
    sent = [(sql, channel, json.loads(body)) for sql, (channel, body) in conn.executed]
    assert sent == [
        (
            "SELECT pg_notify(%s, %s)",
            "ringtrain_events",
            {"r": "replica-1", "j": "A", "s": 8, "t": True},
        ),
        (
            "SELECT pg_notify(%s, %s)",
            "ringtrain_events",
            {"r": "replica-1", "j": "B", "s": 42, "t": False},
        ),
    ]
    assert relay.sent == 2 and conn.closed


def test_the_listener_rereads_everything_on_connect_then_passes_on_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    got: list[tuple[str | None, int, bool]] = []
    relay = Relay("postgresql://unused", "replica-1", lambda j, s, t: got.append((j, s, t)))
    conns: list[FakeConn] = []
    notices = [
        json.dumps({"r": "replica-2", "j": "A", "s": 3, "t": True}),
        json.dumps({"r": "replica-1", "j": "A", "s": 4, "t": False}),  # its own: ignored
        json.dumps({"r": "replica-3", "j": "B", "s": 9, "t": False}),
    ]

    def connect(dsn: str, **kw: Any) -> FakeConn:
        conns.append(FakeConn(notices, on_notify=relay._stop.set))
        return conns[-1]

    monkeypatch.setattr(psycopg, "connect", connect)
    relay._listen_loop()  # on this thread: returns once the stand-in sets _stop
    assert got == [(None, 0, True), ("A", 3, True), ("B", 9, False)]
    assert conns[0].executed == [("LISTEN ringtrain_events", None)] and relay.received == 2
