"""/v1/jobs/{id}/artifacts: the exported model's files (name, size, SHA-256) and their download.

Downloads stream from disk (Starlette's FileResponse: HTTP Range requests answer 206, unsatisfiable
ones 416), so a resumed or parallel download of a multi-GB weight file works with curl, wget or the
CLI.

Auth is the owner's bearer token, as everywhere (another owner's job is 404). A browser link cannot
send that header, so each listed file also carries a `url` signed for this file only (HMAC-SHA256
over job, path and expiry with a key that lives in this process), valid for `LINK_TTL_S`: the
listing, which only the owner can read, is what hands it out.
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
    url: str = Field(
        description="download link signed for this file, valid until `expires_at` (no token needed)"
    )


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
    job = await asyncio.to_thread(ctx.store.jobs.get, job_id, owner)
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


def _download_owner(
    request: Request,
    ctx: Ctx,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    # Plain strings, checked here: a malformed signed link is an invalid credential
    # (401), never a 422.
    expires: Annotated[
        str | None, Query(description="expiry of a signed link (unix seconds)")
    ] = None,
    sig: Annotated[str | None, Query(description="signature of a signed link")] = None,
) -> str | None:
    """Who downloads: the owner's token, or None for a valid signed link. A dependency, so that like
    every secured route it answers 401 before the path is validated (a bad job id without
    credentials is still a 401)."""
    if sig is None or expires is None:
        return current_owner(request=request, ctx=ctx, creds=creds)
    job_id, path = request.path_params.get("job_id", ""), request.path_params.get("path", "")
    when = int(expires) if expires.isascii() and expires.isdigit() and len(expires) <= 18 else -1
    expected = sign(str(job_id), str(path), when).encode() if when >= 0 else b""
    if when < time.time() or not hmac.compare_digest(sig.encode()[:256], expected):
        raise ApiError(
            401, "this download link is invalid or expired; list the artifacts again for a new one"
        )
    return None


@router.get(
    "/{job_id}/artifacts/{path:path}",
    response_class=FileResponse,
    responses={
        **ERRORS,
        206: {"description": "the requested byte range"},
        416: {"description": "bad range"},
    },
)
async def download_artifact(
    job_id: JobId, path: str, ctx: Ctx, owner: Annotated[str | None, Depends(_download_owner)]
) -> FileResponse:
    """One file of the exported model, streamed (HTTP Range supported). Owner's token or a signed
    link."""
    if owner is None:  # a signed link names its job and file itself
        job = await asyncio.to_thread(ctx.store.jobs.get, job_id)
    else:
        job = await asyncio.to_thread(ctx.store.jobs.get, job_id, owner)
    try:
        file = await asyncio.to_thread(
            resolve_artifact, model_dir(ctx.settings.checkpoint_dir, job_id), path
        )
    except ArtifactNotFound as e:
        raise _no_model(job_id, job.state, str(e), field="path") from None
    return FileResponse(file, media_type="application/octet-stream", filename=file.name)
