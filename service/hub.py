"""In-process fan-out of freshly committed job events to live subscribers (SSE streams).

`publish` may be called from any thread (store writes run in worker threads); delivery happens on each
subscriber's event loop. A subscriber that falls behind by more than `max_queue` events is marked
`lagged` and its queue dropped: it must catch up from the store, which always holds everything.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict

from service.store import Event


class Subscription:
    def __init__(self, hub: Hub, job_id: str, loop: asyncio.AbstractEventLoop, max_queue: int) -> None:
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

    def subscribers(self, job_id: str | None = None) -> int:
        with self._lock:
            if job_id is not None:
                return len(self._subs.get(job_id, ()))
            return sum(len(s) for s in self._subs.values())
