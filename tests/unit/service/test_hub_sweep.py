"""SSE fan-out (`service.hub.Hub`) and the cross-replica notices' receiving end (`Relay._deliver`), in process.

A subscriber gets its own job's events in order from any publishing thread; one that falls `max_queue` behind is
marked lagged with its queue dropped (it re-reads the store); `refresh` sends one job's subscribers, or all, back to
the store; a replica ignores its own notices.
"""

from __future__ import annotations

import asyncio
import threading

from service.hub import Hub, Relay
from service.store import Event


def _events(first: int, n: int, kind: str = "metric") -> list[Event]:
    return [Event(seq=s, kind=kind, data={"step": s}) for s in range(first, first + n)]


def _drain(q: asyncio.Queue[Event]) -> list[int]:
    out = []
    while not q.empty():
        out.append(q.get_nowait().seq)
    return out


async def _settle() -> None:
    """Let the callbacks `publish` scheduled from other threads run."""
    for _ in range(3):
        await asyncio.sleep(0.01)


def _publish_from_thread(hub: Hub, job_id: str, events: list[Event]) -> None:
    t = threading.Thread(target=hub.publish, args=(job_id, events))
    t.start()
    t.join()


def test_events_reach_their_jobs_subscribers_in_order() -> None:
    async def main() -> None:
        hub = Hub(max_queue=100)
        a1, a2, b = hub.subscribe("A"), hub.subscribe("A"), hub.subscribe("B")
        assert (hub.subscribers("A"), hub.subscribers("B"), hub.subscribers()) == (2, 1, 3)
        _publish_from_thread(hub, "A", _events(1, 3))
        _publish_from_thread(hub, "A", _events(4, 2))
        await _settle()
        assert _drain(a1.queue) == [1, 2, 3, 4, 5] and _drain(a2.queue) == [1, 2, 3, 4, 5]
        assert b.queue.empty() and not b.wakeup.is_set() and a1.wakeup.is_set()
        with a2:
            pass  # leaving the block unsubscribes
        a1.close()
        assert (hub.subscribers("A"), hub.subscribers()) == (0, 1)
        _publish_from_thread(hub, "A", _events(6, 1))
        await _settle()
        assert a1.queue.empty()
        b.close()
        assert hub.subscribers() == 0 and not hub._subs  # no empty sets left behind

    asyncio.run(main())


def test_a_subscriber_max_queue_behind_is_lagged_and_reads_the_store() -> None:
    """Exactly max_queue events wait in the queue; one more marks the subscriber lagged and drops the queue, and
    later events are not queued (the store has them)."""

    async def main() -> None:
        hub = Hub(max_queue=3)
        sub = hub.subscribe("A")
        _publish_from_thread(hub, "A", _events(1, 3))
        await _settle()
        assert not sub.lagged and sub.queue.qsize() == 3
        _publish_from_thread(hub, "A", _events(4, 1))
        await _settle()
        assert sub.lagged and sub.queue.empty()
        _publish_from_thread(hub, "A", _events(5, 1))
        await _settle()
        assert sub.queue.empty() and sub.wakeup.is_set()
        sub.close()

    asyncio.run(main())


def test_refresh_sends_one_job_or_every_job_back_to_the_store() -> None:
    async def main() -> None:
        hub = Hub()
        a, b = hub.subscribe("A"), hub.subscribe("B")
        hub.refresh("A")
        await _settle()
        assert (a.lagged, b.lagged) == (True, False) and a.wakeup.is_set()
        c = hub.subscribe("C")
        hub.refresh()
        await _settle()
        assert (b.lagged, c.lagged) == (True, True)
        for s in (a, b, c):
            s.close()

    asyncio.run(main())


def test_relay_ignores_its_own_notices_and_passes_on_the_others() -> None:
    got: list[tuple[str | None, int, bool]] = []
    relay = Relay("postgresql://unused", "replica-1", lambda j, s, t: got.append((j, s, t)))
    relay._deliver('{"r": "replica-1", "j": "A", "s": 4, "t": true}')
    relay._deliver('{"r": "replica-2", "j": "A", "s": 7, "t": false}')
    relay._deliver('{"r": "replica-2", "j": "B", "s": 9, "t": true}')
    relay._deliver("not json")  # logged, not raised
    assert got == [("A", 7, False), ("B", 9, True)] and relay.received == 2
    relay.published("C", _events(10, 1, kind="state") + _events(11, 2))  # a state, then points
    relay.published("D", _events(20, 2))
    assert [relay._queue.get_nowait() for _ in range(2)] == [("C", 12, True), ("D", 21, False)]
