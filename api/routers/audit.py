"""GET /v1/audit — the audit trail (see `api.audit`), newest first.

Owner-scoped: each owner reads the rows of their own requests (for one job with `job_id=`, which the
dashboard's job page shows in its timeline). Owners named in `RINGTRAIN_AUDIT_READERS` (default:
`admin`, the generated token's owner) read every owner's rows, or one owner's with `owner=`.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field, field_validator

from api.deps import Ctx, Owner
from api.errors import ApiError
from api.routers.jobs import ERRORS

router = APIRouter(prefix="/v1", tags=["audit"])


class AuditOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    time: datetime
    owner: str = Field(description="who: the owner of the API token used")
    action: str = Field(
        description="job.create, job.cancel, or '<METHOD> <route>' for other changing routes"
    )
    method: str
    route: str
    job_id: str | None
    status: int = Field(description="the HTTP status answered")
    outcome: str = Field(
        description="ok, already_ended, or the error code answered (validation_error, …)"
    )
    client: str = Field(description="the client address the request came from")

    @field_validator("time", mode="before")
    @classmethod
    def _unix(cls, v: object) -> object:
        return datetime.fromtimestamp(v, tz=UTC) if isinstance(v, int | float) else v


class AuditPage(BaseModel):
    events: list[AuditOut]
    next_before: int | None = Field(
        description="pass as before= for older rows; null when there are none"
    )


@router.get("/audit", response_model=AuditPage, responses={**ERRORS, 403: ERRORS[401]})
async def audit(
    ctx: Ctx,
    me: Owner,
    job_id: Annotated[
        str | None, Query(max_length=64, description="only rows about this job")
    ] = None,
    owner: Annotated[
        str | None, Query(max_length=200, description="audit readers only: this owner's rows")
    ] = None,
    before: Annotated[
        int | None, Query(ge=1, le=2**62, description="only rows with id below this")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> AuditPage:
    """Who created or cancelled what, when, from where, and the outcome — your own requests,
    newest first."""
    reader = me in ctx.settings.audit_readers
    if owner is not None and owner != me and not reader:
        raise ApiError(
            403, "only RINGTRAIN_AUDIT_READERS may read other owners' audit rows", field="owner"
        )
    scope = owner if owner is not None else (None if reader else me)
    rows = await asyncio.to_thread(ctx.store.audit.events, scope, job_id, before, limit + 1)
    more = len(rows) > limit
    rows = rows[:limit]
    return AuditPage(
        events=[AuditOut.model_validate(r) for r in rows], next_before=rows[-1].id if more else None
    )
