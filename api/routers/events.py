"""GET /v1/jobs/{id}/events — a job's live event stream (Server-Sent Events).

Every message is one stored event of the job; `id:` is its event seq (per job, strictly increasing,
never reused, shared by state changes, metric points and log lines), `data:` one line of JSON:

    event: state
    id: 7
    data: {"seq":7,"time":…,"from":"PLACING","to":"RUNNING","reason":"all 2 ranks placed"}

    event: state            (with resume_step — a retry or a resubmitted driver: drop points
                             with step > resume_step)
    id: 80
    data: {"seq":80,"time":…,"from":"RUNNING","to":"RETRYING","reason":"…","resume_step":20}

    event: metric
    id: 8
    data: {"seq":8,"step":1,"name":"loss","value":5.54,"rank":null,"time":1764410001.3}
          (value is null when it was NaN/inf; rank is set for per-rank metrics such as
          mem_peak_bytes)

    event: log
    id: 9
    data: {"seq":9,"time":…,"source":"driver","line":"step 1/30 loss 5.54"}

    event: end              (no id; the job is terminal and everything up to it was sent — close)
    data: {"state":"SUCCEEDED","last_seq":123}

Heartbeats are SSE comment lines (`: ping …`) every `RINGTRAIN_SSE_PING_S` seconds (15 by
default), invisible to EventSource. Resume: reconnect with `Last-Event-ID: <last id seen>` (browsers
do this by themselves) or `?after=<seq>`; the stream replays everything after it from the store,
then continues live, with no gaps and no repeats. `retry:` is set to 2000 ms on the first message.
Seqs of superseded metric points are absent from replays (they were deleted), so gaps in `id` are
normal.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Query
from sse_starlette import EventSourceResponse, ServerSentEvent

from api.deps import AppContext, Ctx, Owner
from api.routers.jobs import ERRORS, JobId
from service.lifecycle import is_terminal
from service.store import Event

router = APIRouter(prefix="/v1/jobs", tags=["events"])

REPLAY_PAGE = 500
POLL_S = (
    5.0  # re-check the store this often even without hub wake-ups (other replicas, missed wake-ups)
)


def _sse(e: Event, first: bool = False) -> ServerSentEvent:
    return ServerSentEvent(
        data=json.dumps(e.data, separators=(",", ":"), allow_nan=False),
        event=e.kind,
        id=str(e.seq),
        retry=2000 if first else None,
    )


async def stream(ctx: AppContext, job_id: str, after: int) -> AsyncIterator[ServerSentEvent]:
    store = ctx.store
    sub = ctx.hub.subscribe(
        job_id
    )  # subscribe before reading the store: nothing can fall in between
    last = after
    first = True
    try:
        while True:
            job = await asyncio.to_thread(store.jobs.get, job_id)
            terminal = is_terminal(job.state)
            sub.lagged = False
            while True:  # catch up from the store
                evs = await asyncio.to_thread(store.metrics.events_after, job_id, last, REPLAY_PAGE)
                for e in evs:
                    yield _sse(e, first)
                    first = False
                    last = e.seq
                if len(evs) < REPLAY_PAGE:
                    break
            if terminal:
                yield ServerSentEvent(
                    data=json.dumps({"state": job.state, "last_seq": last}), event="end"
                )
                return
            # live: take events from the hub while they follow on; anything else → back to the
            # store
            need_store = False
            while not need_store:
                sub.wakeup.clear()
                while not sub.queue.empty():
                    e = sub.queue.get_nowait()
                    if e.seq <= last:
                        continue
                    if e.seq != last + 1:
                        need_store = True
                        break
                    yield _sse(e, first)
                    first = False
                    last = e.seq
                    if e.kind == "state" and is_terminal(e.data["to"]):
                        need_store = True
                        break
                if need_store or sub.lagged:
                    break
                try:
                    await asyncio.wait_for(sub.wakeup.wait(), timeout=POLL_S)
                except TimeoutError:
                    need_store = True
    finally:
        sub.close()


@router.get(
    "/{job_id}/events",
    responses={
        **ERRORS,
        200: {
            "content": {"text/event-stream": {}},
            "description": "an SSE stream (see module docs)",
        },
    },
)
async def job_events(
    job_id: JobId,
    ctx: Ctx,
    owner: Owner,
    after: Annotated[
        int | None, Query(ge=0, le=2**62, description="replay events with seq > after")
    ] = None,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", max_length=32)] = None,
) -> EventSourceResponse:
    """State changes, metric points and log lines: replayed from the store, then live."""
    await asyncio.to_thread(ctx.store.jobs.get, job_id, owner)  # 404 before the stream starts
    start = after or 0
    if last_event_id and last_event_id.strip().isdigit():
        start = max(start, min(int(last_event_id.strip()), 2**62))
    return EventSourceResponse(
        stream(ctx, job_id, start), ping=ctx.settings.sse_ping_s, send_timeout=60
    )
