"""GET /v1/jobs/{id}/series — the dashboard's initial load of a job, downsampled on the server.

One consistent snapshot at event seq `last_seq`: the job (with its transitions), every metric series
(one per name and rank) with at most `max_points` points each, and the last `logs` log lines. The page
then follows `GET /v1/jobs/{id}/events?after=<last_seq>` and appends live points, so a job with 100k
points per series costs a few thousand points on load instead of the whole history.

Downsampling keeps each bucket's first, minimum, maximum and last point in step order (an M4-style
decimation): spikes and the envelope of a noisy loss curve survive, the line looks the same at any
screen width up to ~max_points/2 pixels. Series that are short enough are returned as they are.
"""

from __future__ import annotations

import asyncio
import math
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field
from sqlalchemy import select

from api.deps import AppContext, Ctx, Owner
from api.routers.jobs import ERRORS, JobId
from api.schemas import JobOut, LogOut
from service.models import LogLine, MetricPointRow

router = APIRouter(prefix="/v1/jobs", tags=["dashboard"])


class SeriesOut(BaseModel):
    name: str
    rank: int | None = None
    count: int = Field(description="points stored for this series (before downsampling)")
    downsampled: bool
    step: list[int]
    value: list[float | None] = Field(description="null where the measured value was NaN or infinite")


class SeriesSnapshot(BaseModel):
    job: JobOut
    last_seq: int = Field(description="everything here is as of this event seq; follow /events?after=last_seq")
    max_points: int
    series: list[SeriesOut]
    logs: list[LogOut]


def decimate(steps: list[int], values: list[float | None], max_points: int) -> tuple[list[int], list[float | None]]:
    """First/min/max/last of each of max_points // 4 buckets, in their original order."""
    n = len(steps)
    if n <= max_points:
        return steps, values
    nb = max(1, max_points // 4)
    out_s: list[int] = []
    out_v: list[float | None] = []
    for b in range(nb):
        lo, hi = b * n // nb, (b + 1) * n // nb
        if lo >= hi:
            continue
        keep = {lo, hi - 1}
        imin = imax = None
        for i in range(lo, hi):
            v = values[i]
            if v is None:
                continue
            if imin is None or v < values[imin]:  # type: ignore[operator]
                imin = i
            if imax is None or v > values[imax]:  # type: ignore[operator]
                imax = i
        keep.update(i for i in (imin, imax) if i is not None)
        for i in sorted(keep):
            out_s.append(steps[i])
            out_v.append(values[i])
    return out_s, out_v


def snapshot(ctx: AppContext, job_id: str, owner: str, max_points: int, n_logs: int) -> SeriesSnapshot:
    store = ctx.store
    job = store.get_job(job_id, owner)
    last = int(job.next_event_seq) - 1
    M = MetricPointRow
    with store.engine.connect() as conn:
        rows = conn.execute(
            select(M.name, M.rank, M.step, M.value)
            .where(M.job_id == job_id, M.seq <= last)
            .order_by(M.name, M.rank, M.step, M.seq)
        ).all()
        log_rows = conn.execute(
            select(LogLine.seq, LogLine.time, LogLine.source, LogLine.line)
            .where(LogLine.job_id == job_id, LogLine.seq <= last)
            .order_by(LogLine.seq.desc()).limit(n_logs)
        ).all() if n_logs else []
    transitions = [t for t in store.transitions(job_id) if t.seq <= last]
    series: list[SeriesOut] = []
    groups: dict[tuple[str, int | None], tuple[list[int], list[Any]]] = {}
    for name, rank, step, value in rows:
        g = groups.get((name, rank))
        if g is None:
            g = groups[(name, rank)] = ([], [])
        g[0].append(int(step))
        g[1].append(value if value is not None and math.isfinite(value) else None)
    for (name, rank), (steps, values) in groups.items():
        s, v = decimate(steps, values, max_points)
        series.append(SeriesOut(name=name, rank=rank, count=len(steps), downsampled=len(s) < len(steps),
                                step=s, value=v))
    logs = [LogOut(seq=r.seq, time=r.time, source=r.source, line=r.line) for r in reversed(log_rows)]
    return SeriesSnapshot(job=JobOut.of(job, transitions), last_seq=last, max_points=max_points,
                          series=series, logs=logs)


@router.get("/{job_id}/series", response_model=SeriesSnapshot, responses=ERRORS)
async def job_series(
    job_id: JobId,
    ctx: Ctx,
    owner: Owner,
    max_points: Annotated[int, Query(ge=16, le=100_000, description="most points returned per series")] = 4000,
    logs: Annotated[int, Query(ge=0, le=5000, description="how many of the last log lines to include")] = 200,
) -> SeriesSnapshot:
    """The job, its metric series downsampled to `max_points` each, and its log tail, as of `last_seq`."""
    return await asyncio.to_thread(snapshot, ctx, job_id, owner, max_points, logs)

