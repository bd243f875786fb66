"""/v1/jobs/{id}/artifacts: the exported model's files (name, size, SHA-256) and their download.

Downloads stream from disk (Starlette's FileResponse: HTTP Range requests answer 206, unsatisfiable ones
416), so a resumed or parallel download of a multi-GB weight file works with curl, wget or the CLI.

Auth is the owner's bearer token, as everywhere (another owner's job is 404). A browser link cannot send
that header, so each listed file also carries a `url` signed for this file only (HMAC-SHA256 over job, path
and expiry with a key that lives in this process), valid for `LINK_TTL_S`: the listing, which only the
owner can read, is what hands it out.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import BaseModel, Field

from api.deps import Ctx, Owner, bearer, current_owner
from api.errors import ApiError
from api.routers.jobs import ERRORS, JobId
from service.artifacts import ArtifactNotFound, list_artifacts, model_dir, resolve_artifact

router = APIRouter(prefix="/v1/jobs", tags=["artifacts"])

LINK_TTL_S = 3600
_KEY = secrets.token_bytes(32)


class ArtifactOut(BaseModel):
    name: str = Field(description="path inside the model directory, POSIX separators")
    size: int
    sha256: str
    url: str = Field(description="download link signed for this file, valid until `expires_at` (no token needed)")


class ArtifactList(BaseModel):
    job_id: str
    model_path: str = Field(description="the model directory on the cluster's checkpoint volume")
    total_bytes: int
    expires_at: int = Field(description="unix time after which the signed `url`s stop working")
    files: list[ArtifactOut]


def sign(job_id: str, name: str, expires: int) -> str:
    msg = f"{job_id}\n{name}\n{expires}".encode()
    return hmac.new(_KEY, msg, hashlib.sha256).hexdigest()


def _no_model(job_id: str, state: str, why: str, field: str = "id") -> ApiError:
    return ApiError(404, f"job {job_id} ({state}): {why}", code="no_artifacts", field=field)


@router.get("/{job_id}/artifacts", response_model=ArtifactList, responses=ERRORS)
async def list_job_artifacts(job_id: JobId, ctx: Ctx, owner: Owner) -> ArtifactList:
    """The exported model's files with size and SHA-256, and a signed download link for each."""
    job = await asyncio.to_thread(ctx.store.get_job, job_id, owner)
    path = model_dir(ctx.settings.checkpoint_dir, job_id)
    try:
        files = await asyncio.to_thread(list_artifacts, path)
    except ArtifactNotFound as e:
        raise _no_model(job_id, job.state, str(e)) from None
    expires = int(time.time()) + LINK_TTL_S
    base = f"/v1/jobs/{job_id}/artifacts/"
    return ArtifactList(
        job_id=job_id,
        model_path=str(path),
        total_bytes=sum(f.size for f in files),
        expires_at=expires,
        files=[
            ArtifactOut(
                name=f.name,
                size=f.size,
                sha256=f.sha256,
                url=f"{base}{quote(f.name)}?expires={expires}&sig={sign(job_id, f.name, expires)}",
            )
            for f in files
        ],
    )


@router.get(
    "/{job_id}/artifacts/{path:path}",
    response_class=FileResponse,
    responses={**ERRORS, 206: {"description": "the requested byte range"}, 416: {"description": "bad range"}},
)
async def download_artifact(
    job_id: JobId,
    path: str,
    request: Request,
    ctx: Ctx,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    expires: Annotated[int | None, Query(ge=0, le=2**62, description="expiry of a signed link")] = None,
    sig: Annotated[str | None, Query(max_length=128, description="signature of a signed link")] = None,
) -> FileResponse:
    """One file of the exported model, streamed (HTTP Range supported). Owner's token or a signed link."""
    if sig is not None and expires is not None:
        if expires < time.time() or not hmac.compare_digest(sig, sign(job_id, path, expires)):
            raise ApiError(401, "this download link is invalid or expired; list the artifacts again for a new one")
        job = await asyncio.to_thread(ctx.store.get_job, job_id)
    else:
        owner = current_owner(request=request, ctx=ctx, creds=creds)
        job = await asyncio.to_thread(ctx.store.get_job, job_id, owner)
    try:
        file = await asyncio.to_thread(resolve_artifact, model_dir(ctx.settings.checkpoint_dir, job_id), path)
    except ArtifactNotFound as e:
        raise _no_model(job_id, job.state, str(e), field="path") from None
    return FileResponse(file, media_type="application/octet-stream", filename=file.name)
