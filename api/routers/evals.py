"""/v1/evals: run a RULER-style evaluation of a model on the cluster, list them, show one.

An evaluation runs as a task on the cluster (`service.evals`), like a dataset's prepare; its row is
refreshed from the cluster whenever it is read. The model is a directory inside the allowed data
roots (`RINGTRAIN_DATA_ROOTS`) or a job of the caller's that exported its model. Another owner's
evaluation, like another owner's job named as `job`, is a 404, as everywhere.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from pydantic import BaseModel, Field

from api.body import parse_json_body
from api.deps import Ctx, Owner
from api.errors import ApiError
from api.routers.jobs import ERRORS
from api.schemas import ErrorResponse
from service.evals import EvalCreate, EvalRefused, EvalService

router = APIRouter(prefix="/v1/evals", tags=["evals"])

EvalId = Annotated[
    str, Path(min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_-]+$", description="eval id")
]


class EvalProgress(BaseModel):
    samples_done: int
    samples_total: int | None


class EvalReport(BaseModel):
    """What `ringtrain eval --json` prints: lengths are object keys, so strings."""

    tasks: dict[str, dict[str, float]] = Field(description="task -> length -> mean score")
    by_length: dict[str, float] = Field(description="length -> mean over tasks")
    effective_length: int = Field(description="longest length scoring >= threshold; 0: none")
    threshold: float


class EvalOut(BaseModel):
    id: str
    owner: str
    state: str = Field(description="QUEUED, RUNNING, SUCCEEDED or FAILED")
    model: str = Field(description="the model directory evaluated")
    job: str | None = Field(description="the job whose exported model it is, if one was named")
    suite: str
    lengths: list[int]
    samples: int
    ring_size: int
    seed: int
    tasks: list[str] | None = Field(description="null: every task")
    progress: EvalProgress | None
    result: EvalReport | None
    error: str | None
    created_at: float
    updated_at: float


def _service(request: Request, ctx: Any) -> EvalService:
    svc: EvalService | None = getattr(request.app.state, "evals", None)
    if svc is None:
        svc = request.app.state.evals = EvalService(
            ctx.store.evals,
            ctx.store.jobs,
            ctx.launcher,
            ctx.settings.resolved_data_roots(),
            ctx.settings.checkpoint_dir,
        )
    return svc


@router.post(
    "",
    status_code=201,
    response_model=EvalOut,
    responses={**ERRORS, 400: {"model": ErrorResponse}},
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": EvalCreate.model_json_schema()}},
        }
    },
)
async def create_eval(request: Request, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    """Evaluate `model` (or `job`'s exported model) on the cluster; poll GET /v1/evals/{id}.

    The body is read here, after authentication, so a caller without a token learns nothing from its
    body."""
    body = parse_json_body(await request.body(), EvalCreate, "eval request")
    try:
        return await asyncio.to_thread(_service(request, ctx).create, owner, body)
    except EvalRefused as e:
        raise ApiError(e.status, e.message, field=e.field) from None


@router.get("", response_model=list[EvalOut], responses=ERRORS)
async def list_evals(request: Request, ctx: Ctx, owner: Owner) -> list[dict[str, Any]]:
    """Your evaluations, newest first, with their scores once done."""
    return await asyncio.to_thread(_service(request, ctx).list, owner)


@router.get("/{eval_id}", response_model=EvalOut, responses=ERRORS)
async def get_eval(eval_id: EvalId, request: Request, ctx: Ctx, owner: Owner) -> dict[str, Any]:
    found = await asyncio.to_thread(_service(request, ctx).get, eval_id, owner)
    if found is None:
        raise ApiError(404, f"no eval {eval_id}", code="not_found", field="id")
    return found
