"""GET /v1/jobs/{id}/series — the dashboard's initial load of a job, downsampled on the server.

One consistent snapshot at event seq `last_seq`: the job (with its transitions), every metric series
(one per name and rank) with at most `max_points` points each, and the last `logs` log lines. The
page then follows `GET /v1/jobs/{id}/events?after=<last_seq>` and appends live points, so a job with
100k points per series costs a few thousand points on load instead of the whole history.

Downsampling keeps each bucket's first, minimum, maximum and last point in step order (an M4-style
decimation): spikes and the envelope of a noisy loss curve survive, the line looks the same at any
screen width up to ~max_points/2 pixels. Series that are short enough are returned as they are.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from api.deps import AppContext, Ctx, Owner
from api.routers.jobs import ERRORS, JobId
from api.schemas import JobOut, LogOut

router = APIRouter(prefix="/v1/jobs", tags=["dashboard"])


class SeriesOut(BaseModel):
    name: str
    rank: int | None = None
    count: int = Field(description="points stored for this series (before downsampling)")
    downsampled: bool
    step: list[int]
    value: list[float | None] = Field(
        description="null where the measured value was NaN or infinite"
    )


class SeriesSnapshot(BaseModel):
    job: JobOut
    last_seq: int = Field(
        description="everything here is as of this event seq; follow /events?after=last_seq"
    )
    max_points: int
    series: list[SeriesOut]
    logs: list[LogOut]


def decimate(steps: Any, values: Any, max_points: int) -> tuple[list[int], list[float | None]]:
    """First/min/max/last of each of max_points // 4 equal-count buckets, in their original
    order."""
    st = np.asarray(steps, dtype=np.int64)
    va = np.asarray(
        [np.nan if v is None else v for v in values] if isinstance(values, list) else values,
        dtype=np.float64,
    )
    n = len(st)
    if n > max_points:
        nb = max(1, max_points // 4)
        k = -(-n // nb)
        nb = -(-n // k)
        padded = np.full(nb * k, np.nan)
        padded[:n] = va
        grid = padded.reshape(nb, k)
        empty = np.isnan(grid).all(axis=1)
        safe = np.where(empty[:, None], 0.0, grid)  # nanarg* refuse all-NaN rows
        base = np.arange(nb) * k
        imin = base + np.where(
            empty, 0, np.nanargmin(np.where(np.isnan(grid), np.inf, safe), axis=1)
        )
        imax = base + np.where(
            empty, 0, np.nanargmax(np.where(np.isnan(grid), -np.inf, safe), axis=1)
        )
        first, last = base, np.minimum(base + k - 1, n - 1)
        keep = np.unique(np.concatenate([first, imin, imax, last]))
        keep = keep[keep < n]
        st, va = st[keep], va[keep]
    return st.tolist(), [None if v != v else v for v in va.tolist()]


def snapshot(
    ctx: AppContext, job_id: str, owner: str, max_points: int, n_logs: int
) -> SeriesSnapshot:
    store = ctx.store
    job = store.jobs.get(job_id, owner)
    last = job.next_event_seq - 1
    series: list[SeriesOut] = []
    for sr in store.metrics.series(job_id, through=last):
        steps = np.asarray(sr.steps, dtype=np.int64)
        values = np.array(sr.values, dtype=np.float64)  # None → NaN
        values[~np.isfinite(values)] = np.nan
        if (
            len(steps) > 1 and (np.diff(steps) < 0).any()
        ):  # steps out of seq order: sort by step, stable
            order = np.argsort(steps, kind="stable")
            steps, values = steps[order], values[order]
        s, v = decimate(steps, values, max_points)
        count = len(sr.steps)
        series.append(
            SeriesOut(
                name=sr.name, rank=sr.rank, count=count, downsampled=len(s) < count, step=s, value=v
            )
        )
    transitions = [t for t in store.jobs.transitions(job_id) if t.seq <= last]
    tail = store.metrics.log_tail(job_id, through=last, n=n_logs)
    logs = [LogOut.model_validate(r) for r in tail]
    return SeriesSnapshot(
        job=JobOut.of(job, transitions),
        last_seq=last,
        max_points=max_points,
        series=series,
        logs=logs,
    )


@router.get("/{job_id}/series", response_model=SeriesSnapshot, responses=ERRORS)
async def job_series(
    job_id: JobId,
    ctx: Ctx,
    owner: Owner,
    max_points: Annotated[
        int, Query(ge=16, le=100_000, description="most points returned per series")
    ] = 4000,
    logs: Annotated[
        int, Query(ge=0, le=5000, description="how many of the last log lines to include")
    ] = 200,
) -> SeriesSnapshot:
    """The job, its metric series downsampled to `max_points` each, and its log tail, as of
    `last_seq`."""
    return await asyncio.to_thread(snapshot, ctx, job_id, owner, max_points, logs)
