"""GET /v1/metrics/catalog: what every metric name means and how to show it (`workers.metrics`).

The dashboard and the CLI read this instead of knowing metric names themselves, so a metric
added to the catalog is charted, listed and printed without a change to either.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field

from api.deps import Owner
from api.schemas import ErrorResponse
from workers.metrics import catalog_json

router = APIRouter(prefix="/v1/metrics", tags=["metrics"])


class MetricGroup(BaseModel):
    id: str
    title: str


class GridAxes(BaseModel):
    rows: str = Field(description="the field whose values are the grid's rows")
    columns: str = Field(description="the field whose values are the grid's columns")


class MetricInfo(BaseModel):
    name: str = Field(description="the exact name, or a family's pattern with {field} placeholders")
    key: str = Field(description="stable id (dashboard element ids): the name, or a family's key")
    title: str
    unit: str = Field(description="empty for a plain number")
    group: str = Field(description="one of `groups`: where the job page puts its chart")
    description: str
    format: Literal["num", "fixed", "si", "bytes", "seconds", "exp", "percent"]
    digits: int = Field(description="significant digits (num) or decimals (fixed, exp)")
    per_rank: bool = Field(description="each rank reports its own value (the point's rank is set)")
    view: Literal["line", "grid", "stat"]
    fields: list[str] = Field(description="a family's fields in regex group order; [] for a name")
    regex: str = Field(description="anchored name test, a group per field (Python and JS syntax)")
    grid: GridAxes | None = Field(description="for view grid: which fields are rows and columns")
    profile: str | None = Field(
        default=None,
        description="a line family also drawn against this field (x, ordered numerically): the "
        "latest and the first evaluation's value of each member",
    )
    column: bool = Field(description="a column of the jobs list")
    progress: bool = Field(description="shown on the CLI's --follow progress line")


class MetricCatalog(BaseModel):
    groups: list[MetricGroup] = Field(description="chart groups in display order")
    formats: dict[str, str] = Field(description="format -> how values are written")
    views: dict[str, str] = Field(description="view -> how the dashboard shows a metric")
    metrics: list[MetricInfo] = Field(description="a name's entry: exact one, else first match")


@router.get("/catalog", response_model=MetricCatalog, responses={401: {"model": ErrorResponse}})
async def metric_catalog(owner: Owner) -> MetricCatalog:
    """Every metric ringtrain emits: name or pattern, unit, per rank, group, format, meaning."""
    return MetricCatalog.model_validate(catalog_json())
