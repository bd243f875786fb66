"""/v1/datasets: prepare a corpus on the cluster, list prepared datasets, follow one's progress.

A prepare runs as a task on the cluster (`service.datasets`); its row is refreshed from the cluster
whenever it is read, and `/events` streams the row (Server-Sent Events, one `progress` event per
change, a final `done`) until the prepare ends. Source, output and tokenizer paths must lie inside
the allowed data roots (`RINGTRAIN_DATA_ROOTS`), as a job's `data.path` must. Another owner's
dataset is a 404, as everywhere.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from api.body import check_path_in_roots, parse_json_body
from api.deps import Ctx, Owner
from api.errors import ApiError
from api.routers.jobs import ERRORS
from api.schemas import ErrorResponse
from service.datasets import DatasetService, PrepareRequest
from service.tasks import TERMINAL

router = APIRouter(prefix="/v1/datasets", tags=["datasets"])

DatasetId = Annotated[
    str, Path(min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_-]+$", description="dataset id")
]
POLL_S = 0.5


class DatasetCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str = Field(
        ..., min_length=1, max_length=4096, description="a .txt/.jsonl/.parquet file or directory"
    )
    out: str = Field(
        ..., min_length=1, max_length=4096, description="the dataset directory to write"
    )
    tokenizer: str = Field(
        "bytes", min_length=1, max_length=4096, description="a model directory, or 'bytes'"
    )
    format: Literal["text", "chat"] = "text"
    text_field: str = Field("text", min_length=1, max_length=256)


class DatasetProgress(BaseModel):
    done_bytes: int
    total_bytes: int
    documents: int
    tokens: int
    stage: str


class DatasetOut(BaseModel):
    id: str
    owner: str
    state: str = Field(description="QUEUED, RUNNING, SUCCEEDED or FAILED")
    source: str
    out: str
    tokenizer: str
    format: str
    text_field: str
    progress: DatasetProgress | None
    dataset_id: str | None = Field(
        description="the content address of the prepared data (manifest id)"
    )
    documents: int | None
    tokens: int | None
    bytes: int | None
    error: str | None
    created_at: float
    updated_at: float


def _service(request: Request, ctx: Any) -> DatasetService:
    svc: DatasetService | None = getattr(request.app.state, "datasets", None)
    if svc is None:
        svc = request.app.state.datasets = DatasetService(ctx.store.datasets, ctx.launcher)
    return svc


def _not_found(dataset_id: str) -> ApiError:
    return ApiError(404, f"no dataset {dataset_id}", code="not_found", field="id")


@router.post(
    "",
    status_code=201,
    response_model=DatasetOut,
    responses={**ERRORS, 400: {"model": ErrorResponse}},
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": DatasetCreate.model_json_schema()}},
        }
    },
)
async def create_dataset(request: Request, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    """Prepare `source` into `out` on the cluster; follow it with GET /v1/datasets/{id}/events.

    The body is read here, after authentication, so a caller without a token learns nothing from its
    body."""
    body = parse_json_body(await request.body(), DatasetCreate, "dataset request")
    if body.format == "chat" and body.tokenizer == "bytes":
        # refused now, not as a FAILED prepare later: a chat mask needs the model's chat template
        raise ApiError(
            422,
            "format 'chat' needs a model directory with a chat template as tokenizer, "
            "not the bytes tokenizer: pass the model's directory, or use format 'text'",
            code="validation_error",
            field="format",
        )
    roots = ctx.settings.resolved_data_roots()
    source = check_path_in_roots(body.source, roots, "source")
    out = check_path_in_roots(body.out, roots, "out")
    tokenizer = body.tokenizer
    if tokenizer != "bytes":
        tokenizer = str(check_path_in_roots(tokenizer, roots, "tokenizer"))
    req = PrepareRequest(str(source), str(out), tokenizer, body.format, body.text_field)
    return await asyncio.to_thread(_service(request, ctx).create, owner, req)


@router.get("", response_model=list[DatasetOut], responses=ERRORS)
async def list_datasets(request: Request, ctx: Ctx, owner: Owner) -> list[dict[str, Any]]:
    """Your datasets, newest first, with their document and token counts."""
    return await asyncio.to_thread(_service(request, ctx).list, owner)


class DataRoots(BaseModel):
    data_roots: list[str] = Field(
        description="the folders a job's data, a dataset's source and output may lie in"
    )


@router.get("/roots", response_model=DataRoots, responses=ERRORS)
async def data_roots(ctx: Ctx, owner: Owner) -> DataRoots:
    """The allowed data roots (`RINGTRAIN_DATA_ROOTS`), resolved: where `ringtrain data prepare`
    should write a dataset that jobs on this server will read. (Declared before `/{dataset_id}`;
    dataset ids never read "roots".)"""
    return DataRoots(data_roots=[str(r) for r in ctx.settings.resolved_data_roots()])


@router.get("/{dataset_id}", response_model=DatasetOut, responses=ERRORS)
async def get_dataset(
    dataset_id: DatasetId, request: Request, ctx: Ctx, owner: Owner
) -> dict[str, Any]:
    found = await asyncio.to_thread(_service(request, ctx).get, dataset_id, owner)
    if found is None:
        raise _not_found(dataset_id)
    return found


@router.get(
    "/{dataset_id}/events",
    responses={
        **ERRORS,
        200: {"content": {"text/event-stream": {}}, "description": "an SSE stream of the dataset"},
    },
)
async def dataset_events(
    dataset_id: DatasetId, request: Request, ctx: Ctx, owner: Owner
) -> StreamingResponse:
    """Server-Sent Events: `progress` with the dataset each time it changes, then `done` when it
    ends."""
    svc = _service(request, ctx)
    if await asyncio.to_thread(svc.get, dataset_id, owner) is None:
        raise _not_found(dataset_id)

    async def stream() -> AsyncIterator[str]:
        last: Any = None
        while not await request.is_disconnected():
            row = await asyncio.to_thread(svc.get, dataset_id, owner)
            if row is None:
                return
            view = (row["state"], row["progress"])
            if view != last:
                last = view
                yield f"event: progress\ndata: {json.dumps(row)}\n\n"
            if row["state"] in TERMINAL:
                yield f"event: done\ndata: {json.dumps(row)}\n\n"
                return
            await asyncio.sleep(POLL_S)

    return StreamingResponse(
        stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
