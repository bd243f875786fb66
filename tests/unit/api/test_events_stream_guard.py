"""The SSE stream's own logic (api/routers/events.py), driven in process with the real hub fed by a
real store on a temporary SQLite file (wired as the app wires them: the store's bus publishes each
commit to the hub): where a resume starts (the later of `?after=` and `Last-Event-ID`), replay
pages until a short one, a live event already sent is not sent again, any terminal state (not only
SUCCEEDED) sends the reader back to the store for `end`, and `retry:` rides on the first message
only.

A job's events as the store numbers them: 1 is its QUEUED transition (the create), 2 its PLACING one
(the controller's submit), then what the driver reports, from 3 (RUNNING) on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from api.routers import events as events_route
from service.hub import Hub
from service.settings import Settings
from service.store import EventBus, Store
from tests.support.stores import sqlite_store
from workers.config import JobSpec
from workers.protocol import JobState, MetricItem, StateItem

SPEC = JobSpec.model_validate(
    {"name": "tiny", "model": {"d_model": 32, "n_layers": 1, "n_heads": 2}, "train": {"steps": 5}}
)


@pytest.fixture(scope="module")
def wired(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Store, list[Hub]]]:
    """One database for the module (each test streams a job of its own); its bus publishes each
    commit to the current test's hub, as the app wires its one hub."""
    hubs: list[Hub] = []
    bus = EventBus()
    bus.listen("sse", lambda job_id, events: hubs[-1].publish(job_id, events))
    with sqlite_store(tmp_path_factory.mktemp("events"), bus) as store:
        yield store, hubs


@pytest.fixture
def ctx(wired: tuple[Store, list[Hub]], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The stream's context: the real store and a fresh hub; `ctx.asked` records the `after` of
    each replay read (the real `events_after`, observed)."""
    store, hubs = wired
    hubs.append(Hub())
    asked: list[int] = []
    real_after = store.metrics.events_after

    def events_after(job_id: str, after: int, limit: int = 1000) -> Any:
        asked.append(after)
        return real_after(job_id, after, limit)

    monkeypatch.setattr(store.metrics, "events_after", events_after)
    return SimpleNamespace(store=store, hub=hubs[-1], settings=Settings(sse_ping_s=15), asked=asked)


def _state(seq: int, to: JobState) -> StateItem:
    return StateItem(seq=seq, state=to, time=time.time(), reason="x")


def _metric(seq: int) -> MetricItem:
    return MetricItem(seq=seq, time=1.0, step=seq, name="loss", value=1.0)


def job(ctx: Any, metrics: int | None = None, end: JobState | None = None) -> str:
    """alice's job: events 1 (QUEUED, the create) and 2 (PLACING, the controller's submit); with
    `metrics`, its driver's report: 3 (RUNNING), then `metrics` points, then `end`."""
    store: Store = ctx.store
    job_id = store.jobs.create("alice", SPEC, "ingest").id
    assert store.jobs.transition(job_id, JobState.PLACING, "submitted")
    if metrics is not None:
        items: list[Any] = [_state(1, JobState.RUNNING)]
        items += [_metric(s) for s in range(2, metrics + 2)]
        if end is not None:
            items.append(_state(metrics + 2, end))
        store.metrics.apply_report(job_id, items)
    return job_id


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
    ctx: Any, after: int | None, last_event_id: str | None, start: int
) -> None:
    j1 = job(ctx, metrics=11, end=JobState.SUCCEEDED)  # events 1..15

    async def go() -> list[Any]:
        resp = await events_route.job_events(j1, ctx, "alice", after, last_event_id)
        return await drain(resp.body_iterator)

    got = asyncio.run(go())
    assert ctx.asked[0] == start
    assert [s.id for s in got[:-1]] == [str(i) for i in range(start + 1, 16)]
    assert got[-1].event == "end"


def test_replay_reads_pages_until_a_short_one(ctx: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events_route, "REPLAY_PAGE", 2)
    j1 = job(ctx, metrics=1, end=JobState.FAILED)  # events 1..5
    got = asyncio.run(drain(events_route.stream(ctx, j1, 0)))
    assert [s.id for s in got] == ["1", "2", "3", "4", "5", None]
    assert ctx.asked == [0, 2, 4]
    assert got[0].retry == 2000 and all(s.retry is None for s in got[1:])
    assert got[-1].event == "end" and '"last_seq": 5' in got[-1].data


def test_live_events_once_and_any_terminal_state_ends_the_stream(
    ctx: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Replayed 1, 2; live 2 again (sent already, as a relay from another replica may repeat it)
    and the driver's RUNNING (3); then FAILED (4) ends the stream at once, not after a poll of the
    store (POLL_S is made longer than the test waits)."""
    monkeypatch.setattr(events_route, "POLL_S", 60.0)
    j1 = job(ctx)  # events 1, 2: PLACING
    (second,) = ctx.store.metrics.events_after(j1, 1, 1)
    ctx.asked.clear()
    store: Store = ctx.store

    async def go() -> list[Any]:
        gen = events_route.stream(ctx, j1, 0)
        got = [await gen.__anext__(), await gen.__anext__()]
        nxt = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)  # the stream waits on the hub now
        ctx.hub.publish(j1, [second])
        store.metrics.apply_report(j1, [_state(1, JobState.RUNNING)])  # 3, to the hub by the bus
        got.append(await asyncio.wait_for(nxt, 2.0))
        store.metrics.apply_report(j1, [_state(2, JobState.FAILED)])  # event 4
        return got + await drain(gen, timeout=2.0)

    got = asyncio.run(go())
    assert [(s.event, s.id) for s in got] == [
        ("state", "1"),
        ("state", "2"),
        ("state", "3"),
        ("state", "4"),
        ("end", None),
    ]
    assert ctx.asked == [0, 4]  # 3 and 4 came from the hub: the store was read only to end
