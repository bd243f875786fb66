"""In-process fan-out of freshly committed job events to live subscribers (SSE streams).

`publish` may be called from any thread (store writes run in worker threads); delivery happens on
each subscriber's event loop. A subscriber that falls behind by more than `max_queue` events is
marked `lagged` and its queue dropped: it must catch up from the store, which always holds
everything.

Replicas (several `ringtrain serve` on one PostgreSQL store): `Relay` tells the other replicas, by
LISTEN/NOTIFY, "job J has new events through seq S" after each commit; on a replica that did not
store them, `Hub.refresh(J)` sends that job's subscribers back to the store (`events_after`), which
holds everything, so nothing is carried twice and nothing is lost if a notification is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import threading
from collections import defaultdict
from collections.abc import Callable

from service.store import Event

log = logging.getLogger("ringtrain.hub")


class Subscription:
    def __init__(
        self, hub: Hub, job_id: str, loop: asyncio.AbstractEventLoop, max_queue: int
    ) -> None:
        self.hub = hub
        self.job_id = job_id
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.max_queue = max_queue
        self.lagged = False
        self.wakeup = asyncio.Event()

    def _push(self, events: list[Event]) -> None:  # runs on self.loop
        if self.lagged:
            self.wakeup.set()
            return
        for e in events:
            if self.queue.qsize() >= self.max_queue:
                self.lagged = True
                self.queue = asyncio.Queue()
                break
            self.queue.put_nowait(e)
        self.wakeup.set()

    def _refresh(self) -> None:  # runs on self.loop
        """Events were stored elsewhere: the queue no longer holds everything, read the store."""
        self.lagged = True
        self.wakeup.set()

    def close(self) -> None:
        self.hub.unsubscribe(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Hub:
    def __init__(self, max_queue: int = 10000) -> None:
        self._subs: dict[str, set[Subscription]] = defaultdict(set)
        self._lock = threading.Lock()
        self.max_queue = max_queue

    def subscribe(self, job_id: str) -> Subscription:
        sub = Subscription(self, job_id, asyncio.get_running_loop(), self.max_queue)
        with self._lock:
            self._subs[job_id].add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            subs = self._subs.get(sub.job_id)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[sub.job_id]

    def publish(self, job_id: str, events: list[Event]) -> None:
        with self._lock:
            subs = list(self._subs.get(job_id, ()))
        for sub in subs:
            try:
                sub.loop.call_soon_threadsafe(sub._push, list(events))
            except RuntimeError:  # loop closed: the subscriber is gone
                self.unsubscribe(sub)

    def refresh(self, job_id: str | None = None) -> None:
        """Send the subscribers of `job_id` (None: every job) back to the store; any thread."""
        with self._lock:
            subs = list(self._subs.get(job_id, ())) if job_id is not None else self._all()
        for sub in subs:
            with contextlib.suppress(RuntimeError):  # loop closed: the subscriber is gone
                sub.loop.call_soon_threadsafe(sub._refresh)

    def _all(self) -> list[Subscription]:
        return [s for subs in self._subs.values() for s in subs]

    def subscribers(self, job_id: str | None = None) -> int:
        with self._lock:
            if job_id is not None:
                return len(self._subs.get(job_id, ()))
            return sum(len(s) for s in self._subs.values())


# (job id or None: any job, seq, whether a state changed)
RemoteEvents = Callable[[str | None, int, bool], None]


class Relay:
    """Cross-replica event notices over PostgreSQL LISTEN/NOTIFY, on two threads of their own.

    `published` (an `EventBus` listener) only queues; the sender coalesces the queue per job into
    one `pg_notify` each. The listener calls `on_remote(job, seq, state)` for every notice another
    replica sent, and `on_remote(None, 0, True)` after each (re)connection, since notices sent while
    it was away are gone. Notices carry no data: the store is the one source of events.
    """

    CHANNEL = "ringtrain_events"

    def __init__(self, dsn: str, replica: str, on_remote: RemoteEvents) -> None:
        self.dsn = dsn
        self.replica = replica
        self.on_remote = on_remote
        self._queue: queue.Queue[tuple[str, int, bool] | None] = queue.Queue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.sent = 0
        self.received = 0

    def published(self, job_id: str, events: list[Event]) -> None:
        self._queue.put((job_id, events[-1].seq, any(e.kind == "state" for e in events)))

    def start(self) -> None:
        for fn in (self._send_loop, self._listen_loop):
            t = threading.Thread(target=fn, name=f"ringtrain-relay-{fn.__name__}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        self._queue.put(None)
        for t in self._threads:
            t.join(timeout=5)

    def _send_loop(self) -> None:
        import psycopg

        conn: psycopg.Connection[tuple[object, ...]] | None = None
        while not self._stop.is_set():
            first = self._queue.get()
            if first is None:
                break
            pending = {first[0]: first}
            with contextlib.suppress(queue.Empty):
                while len(pending) < 1000:
                    item = self._queue.get_nowait()
                    if item is None:
                        self._stop.set()
                        break
                    old = pending.get(item[0])
                    pending[item[0]] = (item[0], item[1], item[2] or (old is not None and old[2]))
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=5)
                with conn.transaction():
                    for job_id, seq, state in pending.values():
                        body = json.dumps({"r": self.replica, "j": job_id, "s": seq, "t": state})
                        conn.execute("SELECT pg_notify(%s, %s)", (self.CHANNEL, body))
                self.sent += len(pending)
            except Exception as e:  # lost: the other replicas' SSE streams poll the store anyway
                log.warning("event notice not sent (%s: %s)", type(e).__name__, str(e)[:200])
                with contextlib.suppress(Exception):
                    if conn is not None:
                        conn.close()
                conn = None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _listen_loop(self) -> None:
        import psycopg

        backoff = 0.2
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.dsn, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(f"LISTEN {self.CHANNEL}")
                    backoff = 0.2
                    self.on_remote(None, 0, True)  # whatever was sent while we were not listening
                    while not self._stop.is_set():
                        for n in conn.notifies(timeout=1.0):
                            self._deliver(n.payload)
            except Exception as e:
                if self._stop.is_set():
                    break
                log.warning("event notices: listener lost (%s); reconnecting", type(e).__name__)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def _deliver(self, payload: str) -> None:
        try:
            msg = json.loads(payload)
            if msg.get("r") == self.replica:
                return
            self.received += 1
            self.on_remote(str(msg["j"]), int(msg["s"]), bool(msg.get("t")))
        except Exception:
            log.exception("bad event notice %r", payload[:200])
