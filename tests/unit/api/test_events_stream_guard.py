"""The SSE stream's own logic (api/routers/events.py), driven in process with the real hub and a
store stand-in: where a resume starts (the later of `?after=` and `Last-Event-ID`), replay pages
until a short one, a live event already sent is not sent again, any terminal state (not only
SUCCEEDED) sends the reader back to the store for `end`, and `retry:` rides on the first message
only."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from api.routers import events as events_route
from service.hub import Hub
from service.store import Event


def metric(seq: int) -> Event:
    return Event(seq, "metric", {"seq": seq, "step": seq, "name": "loss", "value": 1.0})


def state(seq: int, to: str) -> Event:
    return Event(seq, "state", {"seq": seq, "from": "RUNNING", "to": to, "reason": "x"})


class FakeStore:
    """`jobs.get` and `metrics.events_after` over a list; records each replay's `after`."""

    def __init__(self, evs: list[Event], job_state: str) -> None:
        self.evs, self.state, self.asked = evs, job_state, []
        self.jobs = SimpleNamespace(get=self._get)
        self.metrics = SimpleNamespace(events_after=self._after)

    def _get(self, job_id: str, owner: str | None = None) -> Any:
        return SimpleNamespace(state=self.state)

    def _after(self, job_id: str, after: int, limit: int) -> list[Event]:
        self.asked.append(after)
        return [e for e in self.evs if e.seq > after][:limit]


def ctx_for(store: FakeStore) -> Any:
    return SimpleNamespace(store=store, hub=Hub(), settings=SimpleNamespace(sse_ping_s=15))


async def drain(gen: AsyncIterator[Any], timeout: float = 3.0) -> list[Any]:
    out = []
    async with asyncio.timeout(timeout):
        async for sse in gen:
            out.append(sse)
    return out


@pytest.mark.parametrize(
    ("after", "last_event_id", "start"),
    [(10, "4", 10), (10, "12", 12), (None, "7", 7), (3, "x7", 3), (None, None, 0)],
)
def test_a_resume_starts_at_the_later_of_after_and_last_event_id(
    after: int | None, last_event_id: str | None, start: int
) -> None:
    store = FakeStore([metric(i) for i in range(1, 16)], "SUCCEEDED")

    async def go() -> list[Any]:
        resp = await events_route.job_events("j1", ctx_for(store), "alice", after, last_event_id)
        return await drain(resp.body_iterator)

    got = asyncio.run(go())
    assert store.asked[0] == start
    assert [s.id for s in got[:-1]] == [str(i) for i in range(start + 1, 16)]
    assert got[-1].event == "end"


def test_replay_reads_pages_until_a_short_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events_route, "REPLAY_PAGE", 2)
    store = FakeStore([metric(i) for i in range(1, 6)], "FAILED")
    got = asyncio.run(drain(events_route.stream(ctx_for(store), "j1", 0)))
    assert [s.id for s in got] == ["1", "2", "3", "4", "5", None]
    assert store.asked == [0, 2, 4]
    assert got[0].retry == 2000 and all(s.retry is None for s in got[1:])
    assert got[-1].event == "end" and '"last_seq": 5' in got[-1].data


def test_live_events_once_and_any_terminal_state_ends_the_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Replayed 1, 2; live 2 again (sent already) and 3; then FAILED (4) ends the stream at once,
    not after a poll of the store (POLL_S is made longer than the test waits)."""
    monkeypatch.setattr(events_route, "POLL_S", 60.0)
    store = FakeStore([metric(1), metric(2)], "RUNNING")
    ctx = ctx_for(store)

    async def go() -> list[Any]:
        gen = events_route.stream(ctx, "j1", 0)
        got = [await gen.__anext__(), await gen.__anext__()]
        nxt = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)  # the stream waits on the hub now
        store.evs += [metric(3)]
        ctx.hub.publish("j1", [metric(2), metric(3)])
        got.append(await asyncio.wait_for(nxt, 2.0))
        store.evs += [state(4, "FAILED")]
        store.state = "FAILED"
        ctx.hub.publish("j1", [state(4, "FAILED")])
        return got + await drain(gen, timeout=2.0)

    got = asyncio.run(go())
    assert [(s.event, s.id) for s in got] == [
        ("metric", "1"),
        ("metric", "2"),
        ("metric", "3"),
        ("state", "4"),
        ("end", None),
    ]
    assert store.asked == [0, 4]  # 3 and 4 came from the hub: the store was read only to end
